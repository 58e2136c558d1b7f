"""Object storage, served by a real S3-compatible server (moto's standalone server from the package registry) that
the tests start on 127.0.0.1: training data read from `s3://` (the durable Parquet path through pyarrow's S3
client), and checkpoints written to an `s3://` storage path, verified there and resumed at another world size."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ray_helpers import make_trainer, read_jsonl

from raytrain.checkpoint_files import checkpoint_dirs, checkpoint_paths, latest_committed, verify
from raytrain.config import CheckpointConfig
from raytrain.data.parquet import ParquetSource
from raytrain.errors import ConfigError
from raytrain.ports import free_port
from raytrain.storage import run_storage
from raytrain.toy import write_regression_parquet

pytestmark = pytest.mark.ray


def _client(port: int, allow_bucket_creation: bool = True) -> Any:
    """A pyarrow `S3FileSystem` for the moto server on `port`."""
    import pyarrow.fs as pafs

    return pafs.S3FileSystem(
        endpoint_override=f"127.0.0.1:{port}",
        scheme="http",
        access_key="testing",
        secret_key="testing",
        region="us-east-1",
        allow_bucket_creation=allow_bucket_creation,
    )


@pytest.fixture(scope="module")
def s3_port() -> Iterator[int]:
    """A moto S3 server on 127.0.0.1 with buckets "train-data" and "ckpt"; its port."""
    server = shutil.which("moto_server")
    assert server, "moto_server is not installed: pip install 'moto[server]' (in the test extras)"
    port = free_port()
    process = subprocess.Popen(
        [server, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        fs = _client(port)
        for _ in range(300):
            try:
                fs.create_dir("train-data")
                fs.create_dir("ckpt")
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise RuntimeError(f"moto server on port {port} did not answer")
        yield port
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture
def s3(s3_port: int) -> Any:
    """A pyarrow `S3FileSystem` for the test's S3 server."""
    return _client(s3_port)


def test_parquet_and_checkpoints_on_s3_resume_there_at_another_world_size(
    ray_local: None, tmp_path: Path, s3: Any, s3_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The training data uploaded to the S3 server (its index matches the local one) and the checkpoints written
    there: 2 workers train 4 steps reading s3://, then the same run restarted with 1 worker and 8 steps resumes
    from the S3 checkpoint (resharded by DCP). Both follow the loss curve of 1 worker trained 8 steps on the local
    files and local storage; every sample of the epoch once across the restart; the run's own files stay in the
    local log directory, nothing of them in the bucket. The trained model exports from the bucket by its URI."""
    local = tmp_path / "local"
    for path in write_regression_parquet(local, 90, files=3, row_group=8):
        with open(path, "rb") as f, s3.open_output_stream(f"train-data/toy/{Path(path).name}") as out:
            out.write(f.read())
    remote = ParquetSource("s3://train-data/toy", filesystem=s3, shuffle_window=2)
    index = remote.index(("x", "y"), "id")
    assert index.files == (
        "train-data/toy/part-000.parquet",
        "train-data/toy/part-001.parquet",
        "train-data/toy/part-002.parquet",
    )
    assert index.num_rows == 90
    with pytest.raises(ConfigError, match="does not exist"):
        ParquetSource("s3://train-data/missing", filesystem=s3).resolve()

    def run(name: str, workers: int, steps: int, source: ParquetSource, storage: str | None) -> list[dict[str, Any]]:
        trainer = make_trainer(
            tmp_path,
            name,
            workers=workers,
            steps=steps,
            every=2,
            audit=True,
            storage=storage,
            storage_filesystem=s3 if storage else None,
        )
        trainer.datasets["train"] = source
        return read_jsonl(trainer.fit().metrics_path)

    reference = run("local", 1, 8, ParquetSource(local, shuffle_window=2), None)
    first = run("remote", 2, 4, remote, "s3://ckpt/runs")
    assert [m["step"] for m in first] == [1, 2, 3, 4]
    committed = latest_committed("ckpt/runs/remote", s3)
    assert committed is not None and committed[0] == 4
    assert verify(committed[1], s3) is None
    resumed = run("remote", 1, 8, remote, "s3://ckpt/runs")
    assert [m["step"] for m in resumed] == list(range(1, 9))
    assert [m["world_size"] for m in resumed] == [2] * 4 + [1] * 4
    assert [m["global_batch_size"] for m in resumed] == [20, 20, 20, 20, 10, 20, 20, 20]
    for a, b in zip(reference, resumed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    audit = read_jsonl(tmp_path / "remote" / "samples.jsonl")
    assert sorted(i for r in audit if r["epoch"] == 0 for i in r["ids"]) == list(range(90))
    import pyarrow.fs as pafs

    names = {info.base_name for info in s3.get_file_info(pafs.FileSelector("ckpt/runs/remote"))}
    assert not names & {"metrics.jsonl", "events.jsonl", "raytrain.log"}
    assert (tmp_path / "remote" / "metrics.jsonl").exists()
    # The trained model out of the bucket by its URI (the checkpoint read by byte ranges), equal to a local export
    # of the same run's model read back through load_model
    from raytrain.model_export import export, load_model
    from raytrain.toy import mlp_factory

    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(key, value)
    uri = f"s3://ckpt/runs/remote?endpoint_override=127.0.0.1:{s3_port}&scheme=http&region=us-east-1"
    exported = export(uri, str(tmp_path / "exported"))
    assert exported.step == 8 and exported.files == ["model.safetensors"]
    from safetensors.torch import load_file

    model = load_model(uri, mlp_factory(8, 16))
    tensors = load_file(tmp_path / "exported" / "model.safetensors")
    assert tensors.keys() == model.state_dict().keys()
    assert all(bool((tensors[n] == t).all()) for n, t in model.state_dict().items())


def _upload(s3: Any, local: Path, remote: str) -> None:
    import pyarrow.fs as pafs

    pafs.copy_files(str(local), remote, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=s3)


def test_checkpoints_on_s3_are_listed_verified_and_damage_is_named(tmp_path: Path, s3: Any, s3_port: int) -> None:
    """The checkpoint bookkeeping through pyarrow's S3 client (no Ray): a whole checkpoint uploaded verifies; a
    shard cut short or missing is named; a run whose only checkpoint is damaged is refused before it starts, with
    the s3:// URI in the message. A bucket that does not exist is refused by name."""
    import torch
    from torch import nn

    from raytrain.checkpoint import TrainState, save_checkpoint
    from raytrain.config import BatchConfig, ClusterConfig, LoopConfig, LRConfig
    from raytrain.data.id_ranges import IdRanges
    from raytrain.trainer import TrainSpec, check_resumable, check_storage

    model = nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    local = Path(save_checkpoint(model, optimizer, TrainState(step=7), 0, IdRanges()))
    spec = TrainSpec(
        batch=BatchConfig(global_batch=4, micro_batch=2),
        lr=LRConfig(base_lr=0.1),
        loop=LoopConfig(),
        checkpoint=CheckpointConfig(storage_path="s3://ckpt/books", run_name="r", log_dir=str(tmp_path)),
        cluster=ClusterConfig(),
    )
    run_dir, storage = check_storage(spec, s3)
    assert run_dir == str(tmp_path / "r")
    assert (storage.path, storage.uri) == ("ckpt/books/r", "s3://ckpt/books/r")
    _upload(s3, local, "ckpt/books/r/checkpoint_7")
    assert checkpoint_dirs("ckpt/books/r", s3) == [(7, "ckpt/books/r/checkpoint_7")]
    assert verify("ckpt/books/r/checkpoint_7", s3) is None
    check_resumable(storage)  # intact: no error
    shard = "ckpt/books/r/checkpoint_7/__0_0.distcp"
    size = s3.get_file_info(shard).size
    with s3.open_output_stream(shard) as out:
        out.write((local / "__0_0.distcp").read_bytes()[: size // 2])
    assert verify("ckpt/books/r/checkpoint_7", s3) == f"__0_0.distcp has {size // 2} of its {size} bytes"
    s3.delete_file(shard)
    assert verify("ckpt/books/r/checkpoint_7", s3) == "__0_0.distcp is missing"
    with pytest.raises(ConfigError, match=r"no intact checkpoint in s3://ckpt/books/r .*__0_0.distcp is missing"):
        check_resumable(storage)
    assert latest_committed("ckpt/books/r", s3) is None  # Ray never committed anything here

    strict = _client(s3_port, allow_bucket_creation=False)
    missing = TrainSpec(
        batch=spec.batch,
        lr=spec.lr,
        loop=spec.loop,
        checkpoint=CheckpointConfig(storage_path="s3://no-such-bucket/runs", log_dir=str(tmp_path)),
        cluster=spec.cluster,
    )
    with pytest.raises(ConfigError, match=r"storage_path 's3://no-such-bucket/runs/run' is not writable"):
        check_storage(missing, strict)


def test_uncommitted_checkpoints_on_s3_are_removed_and_older_ones_are_candidates(s3: Any) -> None:
    """What a restart does on object storage (no Ray): the checkpoints after Ray's latest committed one are
    deleted from the bucket, a save cut short after it (no train state: Ctrl-C or a lost node mid-save) too; one
    cut short before it is not ours to judge and stays; the candidates to load are the latest, then the older
    ones, newest first."""
    import torch
    from torch import nn

    from raytrain.checkpoint import TrainState, save_checkpoint
    from raytrain.checkpoint_files import remove_uncommitted
    from raytrain.data.id_ranges import IdRanges
    from raytrain.worker_loop import restore_candidates

    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (3, 5, 8):  # named as Ray names them: checkpoint_<timestamp>
        local = Path(save_checkpoint(model, optimizer, TrainState(step=step), 0, IdRanges()))
        _upload(s3, local, f"ckpt/re/checkpoint_2026-11-30_0{step}")
    for cut_short in ("04", "09"):  # DCP's data written, the train state not yet
        s3.create_dir(f"ckpt/re/checkpoint_2026-11-30_{cut_short}")
        with s3.open_output_stream(f"ckpt/re/checkpoint_2026-11-30_{cut_short}/__0_0.distcp") as out:
            out.write(b"x" * 64)
    assert [step for step, _ in checkpoint_dirs("ckpt/re", s3)] == [3, 5, 8]
    assert remove_uncommitted("ckpt/re/checkpoint_2026-11-30_05", s3) == [
        "ckpt/re/checkpoint_2026-11-30_08",
        "ckpt/re/checkpoint_2026-11-30_09",
    ]
    assert len(checkpoint_paths("ckpt/re", s3)) == 3
    assert [step for step, _ in checkpoint_dirs("ckpt/re", s3)] == [3, 5]
    assert restore_candidates("ckpt/re/checkpoint_2026-11-30_05", s3) == [
        "ckpt/re/checkpoint_2026-11-30_05",
        "ckpt/re/checkpoint_2026-11-30_03",
    ]


def test_storage_uri_options_and_filesystem_checks() -> None:
    """A URI's options reach pyarrow (no request is made); a filesystem object needs a URI storage_path."""
    storage = run_storage(
        CheckpointConfig(storage_path="s3://bucket/runs/?endpoint_override=127.0.0.1:9&scheme=http", run_name="a")
    )
    assert (storage.path, storage.uri, storage.is_local) == ("bucket/runs/a", "s3://bucket/runs/a", False)
    for uri in ("s3://AKIAKEY:hunter2@bucket/runs?scheme=http", "s3://AKIAKEY:hun/ter2@bucket/runs"):
        with pytest.raises(ConfigError, match="storage_path must not hold credentials") as refused:
            CheckpointConfig(storage_path=uri)  # checkpoints store the config: the secret would be in every one
        assert "hun" not in str(refused.value) and "AKIAKEY" not in str(refused.value)
    with pytest.raises(ConfigError, match="log_dir must be a local or shared directory, got 's3://b/logs'"):
        CheckpointConfig(storage_path="s3://b/runs", log_dir="s3://b/logs")
    with pytest.raises(ConfigError, match="storage_path 'nosuch://x' is not a URI pyarrow can open"):
        run_storage(CheckpointConfig(storage_path="nosuch://x"))


def test_fit_dry_run_checks_an_s3_storage_uri_with_its_options(
    tmp_path: Path, s3_port: int, ray_head_env: dict[str, str]
) -> None:
    """`raytrain fit --storage s3://...?endpoint_override=...` as a user types it (credentials in the environment):
    the bucket is probed and the run's files go to --log-dir; a bucket that does not exist is refused by name."""
    import os
    import sys

    env = {**os.environ, **ray_head_env, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    options = f"?endpoint_override=127.0.0.1:{s3_port}&scheme=http&region=us-east-1"
    command = [sys.executable, "-m", "raytrain.cli", "fit", "examples/fit_mlp.toml", "--dry-run", "--log-dir"]
    ok = subprocess.run(
        [*command, str(tmp_path), "--storage", f"s3://ckpt/cli{options}"], env=env, capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    missing = subprocess.run(
        [*command, str(tmp_path), "--storage", f"s3://no-such-bucket/cli{options}"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2
    assert "storage_path 's3://no-such-bucket/cli/fit-mlp' is not writable" in missing.stderr


def test_pretrained_weights_are_read_from_s3_by_range(s3: Any, s3_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """init_from on object storage (no Ray): a Hugging Face directory written by save_pretrained and uploaded;
    the URI's options reach pyarrow, the names check against the model, and a shard of a tensor is read as one
    range of its rows (the bytes read are that shard's), equal to the file's rows."""
    import torch
    from test_pretrained import file_tensors, saved
    from user_models import gpt2

    from raytrain.model_init import record_build
    from raytrain.pretrained import check_names, open_pretrained

    _upload(s3, saved("gpt2"), "ckpt/hf/gpt2")
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(key, value)
    uri = f"s3://ckpt/hf/gpt2?endpoint_override=127.0.0.1:{s3_port}&scheme=http&region=us-east-1"
    pretrained = open_pretrained(uri)
    assert check_names(pretrained, record_build(gpt2).model)[0].startswith(f"weights from {uri}: ")
    expected = file_tensors(saved("gpt2"))["transformer.wte.weight"]
    assert torch.equal(pretrained.read_full("transformer.wte.weight"), expected)
    pretrained.bytes_read = 0
    entry = pretrained.entries["transformer.wte.weight"]
    assert torch.equal(pretrained._read(entry, 16, 32), expected[16:48])  # a zero3 rank's rows: one range request
    assert pretrained.bytes_read == 32 * 32 * 4
