"""Training data read from `s3://`, served by a real S3-compatible server (moto's standalone server from the
package registry) that the test starts on 127.0.0.1: the durable Parquet path through pyarrow's S3 client."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ray_helpers import make_trainer, read_jsonl

from raytrain.errors import ConfigError
from raytrain.parquet_source import ParquetSource
from raytrain.toy import write_regression_parquet

pytestmark = pytest.mark.ray


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    """A moto S3 server on 127.0.0.1 and a pyarrow `S3FileSystem` for it, with bucket "train-data"."""
    import pyarrow.fs as pafs

    server = shutil.which("moto_server")
    assert server, "moto_server is not installed: pip install 'moto[server]' (in the test extras)"
    port = _free_port()
    process = subprocess.Popen(
        [server, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        fs = pafs.S3FileSystem(
            endpoint_override=f"127.0.0.1:{port}",
            scheme="http",
            access_key="testing",
            secret_key="testing",
            region="us-east-1",
            allow_bucket_creation=True,
        )
        for _ in range(300):
            try:
                fs.create_dir("train-data")
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise RuntimeError(f"moto server on port {port} did not answer")
        yield fs
    finally:
        process.terminate()
        process.wait(10)


def test_parquet_on_s3_trains_like_local_files(ray_local: None, tmp_path: Path, s3: Any) -> None:
    """The same data uploaded to the S3 server: the index matches the local one, and 2 workers reading from S3
    follow the loss curve of 1 worker reading the local files."""
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

    def run(name: str, workers: int, source: ParquetSource) -> list[dict[str, Any]]:
        trainer = make_trainer(tmp_path, name, workers=workers, steps=6, audit=True)
        trainer.datasets["train"] = source
        return read_jsonl(trainer.fit().metrics_path)

    one = run("local", 1, ParquetSource(local, shuffle_window=2))
    two = run("s3", 2, remote)
    assert [m["global_batch_size"] for m in two] == [20, 20, 20, 20, 10, 20]
    for a, b in zip(one, two, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    audit = read_jsonl(tmp_path / "s3" / "samples.jsonl")
    assert sorted(i for r in audit if r["epoch"] == 0 for i in r["ids"]) == list(range(90))
