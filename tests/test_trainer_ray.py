"""End-to-end tests of `ElasticTrainer` on a real local Ray cluster (CPU, gloo, 1-3 workers)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
from ray_helpers import ROWS, make_trainer, read_jsonl

from raytrain.config import BatchConfig, ClusterConfig, LoopConfig, LRConfig, ParallelConfig
from raytrain.console import LOG_FILE
from raytrain.data.parquet import ParquetSource
from raytrain.errors import ConfigError
from raytrain.toy import (
    block_mlp_factory,
    inverse_sqrt_schedule,
    mlp_factory,
    sgd,
    squared_error,
    write_regression_parquet,
)
from raytrain.trainer import ElasticTrainer

pytestmark = pytest.mark.ray


def test_fit_end_to_end_writes_one_metrics_line_per_step(
    ray_local: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The driver's start watch speaks at once and every 0.5 s until the controller's run loop begins, then never
    monkeypatch.setattr("raytrain.start_watch.SAY_AFTER_S", 0.0)
    monkeypatch.setattr("raytrain.start_watch.REPEAT_S", 0.5)
    trainer = make_trainer(tmp_path, "e2e", workers=2, audit=True, every=4)
    write_regression_parquet(tmp_path / "val", 25, seed=1, files=2, row_group=8)  # read whole on the driver
    trainer.datasets["val"] = ParquetSource(tmp_path / "val")  # (README's snippet validates on a Ray dataset)
    result = trainer.fit()
    log = (Path(result.run_dir) / LOG_FILE).read_text().splitlines()
    said = [i for i, line in enumerate(log) if "Ray Train's controller" in line and "has not begun the run" in line]
    first_step = next(i for i, line in enumerate(log) if "step     1 |" in line)
    assert said and said[-1] < first_step, log  # it spoke, and stopped once the controller's run loop had begun
    assert any("(actor " in log[i] for i in said), log  # with the controller's actor, once Ray Train created it
    lines = read_jsonl(result.metrics_path)
    # Rank 0 alone writes: one line per optimizer step, none duplicated by other ranks.
    assert [m["step"] for m in lines] == list(range(1, 11))
    assert {m["world_size"] for m in lines} == {2}
    # Full steps carry exactly the global batch; each epoch's last step the remainder 90 - 4 * 20 = 10.
    assert [m["global_batch_size"] for m in lines] == [20, 20, 20, 20, 10] * 2
    assert all(sum(m["per_rank_samples"]) == m["global_batch_size"] for m in lines)
    assert lines[-1]["samples_seen"] == 2 * ROWS
    assert lines[0]["lr"] == pytest.approx(0.1) and lines[2]["lr"] == pytest.approx(0.2)  # warmup, then peak
    for key in ("epoch", "accumulation_steps", "loss", "step_time_s"):
        assert key in lines[0]
    last_epoch = sum(m["loss"] for m in lines if m["epoch"] == 1) / 5
    assert last_epoch < lines[0]["loss"]  # it learns: the last epoch's batches fit better than the initial model
    # Every id exactly once per epoch, and the epochs were shuffled differently.
    audit = read_jsonl(result.samples_path or "")
    by_epoch: dict[int, list[int]] = {}
    for record in audit:
        by_epoch.setdefault(record["epoch"], []).extend(record["ids"])
    assert sorted(by_epoch[0]) == sorted(by_epoch[1]) == list(range(ROWS))
    assert by_epoch[0] != by_epoch[1]
    assert result.metrics is not None and result.metrics["step"] == 10
    # Validation loss at each checkpoint (steps 4 and 8) and at the run's last step (10, between checkpoints: the
    # final validation is in metrics.jsonl), computed over all 25 rows whatever W is; in view on the terminal.
    assert [m["step"] for m in lines if "val_loss" in m] == [4, 8, 10]
    assert 0 < result.metrics["val_loss"] < 10 and result.metrics["val_loss"] == lines[-1]["val_loss"]
    shown = [line for line in log if "| val_loss " in line]
    assert [line.split("step")[1].split("|")[0].strip() for line in shown] == ["4", "8", "10"], log
    assert f"val_loss {round(lines[-1]['val_loss'], 6)} (" in next(x for x in log if x.startswith("[raytrain] done:"))
    assert result.checkpoint is not None
    events = read_jsonl(result.events_path)
    assert len(events) == 1 and events[0]["world_size"] == 2
    # What lives for the whole run (modules, model, optimizer, data) is out of the collector's reach before step 1,
    # so a full collection cannot stall a step (`worker_loop.settle_heap`).
    assert events[0]["frozen_objects"] > 10_000


@pytest.mark.parametrize("data", ["parquet", "ray"])
def test_deterministic_loss_curve_is_independent_of_world_size(ray_local: None, tmp_path: Path, data: str) -> None:
    """Plain W = 1 against zero3 with activation checkpointing and sharded accumulation at W = 3, both built by
    the sharded build (`init="meta"`: the same weights at every W), on Parquet files read in place (a block model,
    one FSDP unit per block) or a Ray dataset (a top-1 mixture of experts whose experts sit out steps per rank,
    built with trunc_normal_, a private generator and attribute tensors: the driver's probe keeps the experts out
    of the FSDP units and says so): the same initial weights, the same samples per step, the same loss curve."""
    import sys

    import ray.cloudpickle
    from user_models import TopOneMoE

    ray.cloudpickle.register_pickle_by_value(sys.modules["user_models"])
    model_fn = block_mlp_factory(8, 16, 3) if data == "parquet" else functools.partial(TopOneMoE, 8)
    options = {"model_fn": model_fn, "lr": LRConfig(base_lr=0.05), "steps": 6, "data": data}
    parallel = ParallelConfig(activation_checkpointing=True, grad_accumulation="sharded", init="meta")
    one = read_jsonl(  # the sharded build on both sides: each tensor's draws are its own, the same at every W
        make_trainer(tmp_path, "w1", workers=1, parallel=ParallelConfig(init="meta"), **options).fit().metrics_path  # type: ignore[arg-type]
    )
    three = make_trainer(tmp_path, "w3", workers=3, strategy="zero3", parallel=parallel, **options)  # type: ignore[arg-type]
    lines = read_jsonl(three.fit().metrics_path)
    assert [m["accumulation_steps"] for m in one] != [m["accumulation_steps"] for m in lines]
    for a, b in zip(one, lines, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    if data == "ray":
        log = (tmp_path / "w3" / LOG_FILE).read_text()
        assert "FSDP units: no repeated blocks: 2 direct children with parameters + root; 4 modules not called " in log
    if data == "parquet":  # rank 0's data threads' CPU since the run began, on every line
        cpu = [m["data_cpu_s"] for m in lines]
        assert cpu[0] > 0 and cpu == sorted(cpu), cpu


def test_missing_column_fails_before_workers_and_writes_nothing(ray_local: None, tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, "bad", workers=2)
    trainer.required_columns = ("x", "label")
    with pytest.raises(ConfigError, match=r"no column\(s\) \['label'\]; its columns are \['id', 'x', 'y'\]"):
        trainer.fit()
    assert not os.path.exists(tmp_path / "bad")


def test_unwritable_storage_path_fails_clearly(ray_local: None, tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"storage_path .* is not usable: .*a_file' is not a directory"):
        make_trainer(blocker / "runs", "x", workers=1).fit()
    assert blocker.read_text() == "not a directory"


def test_unknown_strategy_and_bad_ranges_are_rejected_before_anything_runs() -> None:
    with pytest.raises(ConfigError, match="strategy must be one of auto, ddp, zero1, zero2, zero3, got 'zero4'"):
        LoopConfig(strategy="zero4")
    with pytest.raises(ConfigError, match="min_workers must be <= max_workers, got min_workers=3 > max_workers=2"):
        ClusterConfig(min_workers=3, max_workers=2)
    with pytest.raises(ConfigError, match="micro_batch must be an integer >= 1, got 0"):
        BatchConfig(global_batch=8, micro_batch=0)
    with pytest.raises(ConfigError, match="max_workers must be <= global_batch"):
        ElasticTrainer(
            model_fn=mlp_factory(),
            loss_fn=squared_error,
            optimizer_fn=sgd,
            datasets={"train": None},
            batch=BatchConfig(global_batch=2, micro_batch=1),
            lr=LRConfig(base_lr=0.1),
            cluster=ClusterConfig(min_workers=1, max_workers=3),
        )


def test_streaming_mode_uses_every_sample_once_per_epoch(ray_local: None, tmp_path: Path) -> None:
    """Every sample once per epoch at W = 3."""
    result = make_trainer(tmp_path, "stream", workers=3, audit=True, deterministic=False).fit()
    lines = read_jsonl(result.metrics_path)
    sizes = [m["global_batch_size"] for m in lines]
    # Exactly B at every step but each epoch's last, which holds the remainder: 4 full steps and 10 samples.
    assert sizes == [20, 20, 20, 20, 10] * 2
    assert all(max(m["per_rank_samples"]) <= 20 for m in lines)
    audit = read_jsonl(result.samples_path or "")
    for epoch in (0, 1):
        ids = [i for record in audit if record["epoch"] == epoch for i in record["ids"]]
        assert sorted(ids) == list(range(ROWS)), f"epoch {epoch}: duplicates or missing ids"


def test_a_plain_arrow_list_column_reaches_the_loss_as_a_2d_array(ray_local: None) -> None:
    """Ray Data hands a plain Arrow list column (not a tensor column) over as an object array of arrays; the
    streaming reader (`StreamingShard`, the class each rank reads its shard with) stacks each read into one 2-D
    array, as the materialized reader does."""
    import numpy as np
    import pyarrow as pa
    import ray.data

    from raytrain.data.id_ranges import IdRanges
    from raytrain.data.streaming import StreamingShard
    from raytrain.toy import regression_arrays

    arrays = regression_arrays(ROWS, 8, 0)
    table = {name: pa.array(list(value)) if value.ndim > 1 else pa.array(value) for name, value in arrays.items()}
    dataset = ray.data.from_arrow(pa.table(table))
    given = next(iter(dataset.iter_batches(batch_size=16, batch_format="numpy")))
    assert given["x"].dtype == object  # what the reader is given
    empty = {name: value[:0] for name, value in arrays.items()}
    shard = StreamingShard(
        dataset,
        id_column="id",
        consumed=IdRanges(),
        seed=0,
        epoch=0,
        rank=0,
        shuffle_buffer=32,
        read_batch=16,
        empty=empty,
    )
    shard.fill(ROWS)
    rows = shard.take(ROWS)
    assert rows["x"].shape == (ROWS, 8) and rows["x"].dtype == arrays["x"].dtype
    assert np.array_equal(rows["x"], arrays["x"][rows["id"]])  # each row's features, in the shuffled order


def test_indexed_data_orders_rows_by_id_whatever_the_block_order(ray_local: None) -> None:
    import numpy as np
    import pyarrow as pa
    import ray.data

    from raytrain.data.materialized import IndexedData

    first = pa.table({"id": pa.array([5, 1, 3], pa.int64()), "x": pa.array([5.0, 1.0, 3.0])})
    second = pa.table({"id": pa.array([0, 4, 2], pa.int64()), "x": pa.array([0.0, 4.0, 2.0])})
    one = IndexedData.from_dataset(ray.data.from_arrow([first, second]), "id", ["x"])
    other = IndexedData.from_dataset(ray.data.from_arrow([second, first]), "id", ["x"])
    assert one.ids.tolist() == other.ids.tolist() == [0, 1, 2, 3, 4, 5]
    for data in (one, other):
        columns = data.load_columns()
        assert np.array_equal(columns["id"], np.arange(6))
        assert np.array_equal(columns["x"], np.arange(6, dtype=float))


def test_bf16_zero2_with_a_user_lr_schedule_trains_end_to_end(ray_local: None, tmp_path: Path) -> None:
    """bf16 mixed precision under zero2, and a user's `lr_schedule_fn` setting every step's LR."""
    parallel = ParallelConfig(precision="bf16")
    model_fn = block_mlp_factory(8, 16, 3)
    lr = LRConfig(base_lr=0.05)
    trainer = make_trainer(
        tmp_path,
        "bf16",
        workers=2,
        steps=10,
        strategy="zero2",
        model_fn=model_fn,
        parallel=parallel,
        lr=lr,
        lr_schedule_fn=inverse_sqrt_schedule,
    )
    lines = read_jsonl(trainer.fit().metrics_path)
    assert len(lines) == 10 and sum(m["loss"] for m in lines[-3:]) < sum(m["loss"] for m in lines[:3])
    assert [m["lr"] for m in lines] == pytest.approx([0.05 / (s + 1) ** 0.5 for s in range(10)])
