"""The durable Parquet data path without Ray workers: the windowed sample order (pure) and `ParquetSteps` reading
real Parquet files in every rank of a world, at several world sizes, with bounded memory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from raytrain.batch_plan import plan_batch
from raytrain.data.parquet import MAX_WINDOWS_AHEAD, OPEN_FILES, ParquetIndex, ParquetSource, ParquetSteps, as_source
from raytrain.data.sample_order import WindowedOrder, canonical_ids, windows_between
from raytrain.errors import ConfigError
from raytrain.toy import regression_arrays, write_regression_parquet


@given(
    st.lists(st.integers(1, 30), min_size=1, max_size=12),
    st.integers(0, 5),
    st.integers(0, 3),
    st.integers(1, 5),
)
def test_the_windowed_order_visits_every_row_once(rows: list[int], seed: int, epoch: int, window: int) -> None:
    order = WindowedOrder(np.array(rows), seed=seed, epoch=epoch, window_chunks=window)
    chunks, within = order.locate(np.arange(order.num_rows))
    ids = canonical_ids(np.array(rows), chunks, within)
    assert sorted(ids.tolist()) == list(range(sum(rows)))
    assert all((within < np.array(rows)[chunks]).tolist())
    # Every window holds the rows of its chunks only: a worker needs those chunks and nothing else.
    for w, members in enumerate(order.windows):
        lo, hi = order.window_start[w], order.window_start[w + 1]
        assert set(chunks[lo:hi].tolist()) == set(members.tolist())


def test_the_order_depends_on_seed_and_epoch_only() -> None:
    rows = np.array([16, 14, 16, 14, 16, 14])
    a = WindowedOrder(rows, seed=3, epoch=1, window_chunks=2).locate(np.arange(90))
    b = WindowedOrder(rows, seed=3, epoch=1, window_chunks=2).locate(np.arange(90))
    c = WindowedOrder(rows, seed=3, epoch=2, window_chunks=2).locate(np.arange(90))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not (np.array_equal(a[0], c[0]) and np.array_equal(a[1], c[1]))
    order = WindowedOrder(rows, seed=3, epoch=1, window_chunks=2)
    assert windows_between(order, 0, 0) == []
    assert windows_between(order, 0, 90) == [0, 1, 2]


def _index(
    tmp_path: Path, rows: int, *, row_group: int = 16, window: int = 2, id_column: str | None = None
) -> ParquetIndex:
    write_regression_parquet(tmp_path / "data", rows, files=3, row_group=row_group)
    return ParquetSource(tmp_path / "data", shuffle_window=window).index(("x", "y"), id_column)


def _epoch_ids(
    index: ParquetIndex, world: int, global_batch: int, epoch: int, *, drop_last: bool = False
) -> list[list[int]]:
    """Every step's global ids (ranks' slices concatenated in rank order) of one epoch, read rank by rank."""
    plan = plan_batch(global_batch, 4, world)
    sources = [
        ParquetSteps(index, seed=7, plan=plan, rank=r, device=torch.device("cpu"), drop_last=drop_last, epochs=9)
        for r in range(world)
    ]
    steps, position = [], 0
    while True:
        parts = [s.next_step(epoch, position) for s in sources]
        if parts[0] is None:
            assert all(p is None for p in parts)
            break
        assert all(sum(len(b["y"]) for b in p.micro_batches) == len(p.ids) for p in parts)
        steps.append([int(i) for p in parts for i in p.ids])
        position += len(steps[-1])
    for source in sources:
        source.close()
    return steps


def test_every_world_size_reads_the_same_global_batches(tmp_path: Path) -> None:
    index = _index(tmp_path, 90)
    one = _epoch_ids(index, 1, 20, epoch=0)
    assert [len(s) for s in one] == [20, 20, 20, 20, 10]
    assert sorted(i for s in one for i in s) == list(range(90))
    for world in (2, 3, 4):
        assert _epoch_ids(index, world, 20, epoch=0) == one
    assert _epoch_ids(index, 3, 20, epoch=1) != one  # each epoch reshuffles
    assert [len(s) for s in _epoch_ids(index, 2, 20, epoch=0, drop_last=True)] == [20, 20, 20, 20]


def test_rows_are_the_ones_the_ids_name(tmp_path: Path) -> None:
    """The tensors a rank trains on are the rows of its ids, with an id column and with canonical ids."""
    arrays = regression_arrays(90)
    for id_column in ("id", None):
        index = _index(tmp_path / str(id_column), 90, id_column=id_column)
        plan = plan_batch(20, 4, 2)
        source = ParquetSteps(index, seed=1, plan=plan, rank=1, device=torch.device("cpu"), drop_last=False, epochs=1)
        step = source.next_step(0, 40)
        x = torch.cat([b["x"] for b in step.micro_batches]).numpy()
        assert np.array_equal(x, arrays["x"][step.ids])
        source.close()


def test_a_worker_holds_a_few_windows_not_the_data_set(tmp_path: Path) -> None:
    """240 row groups in windows of 2: the bytes a rank holds stay within its step's windows plus the ones loaded
    ahead (MAX_WINDOWS_AHEAD) over a whole epoch, far below the data set."""
    index = _index(tmp_path, 3840, row_group=16, window=2)
    plan = plan_batch(16, 4, 2)
    source = ParquetSteps(index, seed=0, plan=plan, rank=0, device=torch.device("cpu"), drop_last=False, epochs=1)
    position = 0
    while source.next_step(0, position) is not None:
        position += 16
    window_bytes = 32 * (8 * 4 + 4 + 8)  # 32 rows of x (8 float32), y (float32) and the canonical id (int64)
    assert 0 < source.stats.peak_bytes <= (2 + MAX_WINDOWS_AHEAD) * window_bytes
    assert source.stats.peak_bytes / (3840 * (8 * 4 + 4 + 8)) <= 0.05
    source.close()


def test_bad_sources_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        ParquetSource(tmp_path / "missing").resolve()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no \*\.parquet file"):
        ParquetSource(tmp_path / "empty").resolve()
    with pytest.raises(ConfigError, match="shuffle_window must be an int >= 1"):
        ParquetSource(tmp_path, shuffle_window=0)
    write_regression_parquet(tmp_path / "data", 10, files=1)
    with pytest.raises(ConfigError, match=r"no column\(s\) \['label'\]"):
        ParquetSource(tmp_path / "data").index(("x", "label"), None)
    assert isinstance(as_source(str(tmp_path / "data")), ParquetSource)
    assert as_source(42) == 42


def test_a_path_is_a_parquet_source_and_streaming_refuses_it(tmp_path: Path) -> None:
    """`datasets={"train": "<dir>"}` becomes a ParquetSource; streaming mode (which needs a Ray dataset) says so."""
    from raytrain.config import BatchConfig, LoopConfig, LRConfig
    from raytrain.toy import mlp_factory, sgd, squared_error
    from raytrain.trainer import ElasticTrainer

    write_regression_parquet(tmp_path / "data", 10, files=1)
    common = {
        "model_fn": mlp_factory(),
        "loss_fn": squared_error,
        "optimizer_fn": sgd,
        "batch": BatchConfig(global_batch=4, micro_batch=2),
        "lr": LRConfig(base_lr=0.1),
    }
    trainer = ElasticTrainer(datasets={"train": str(tmp_path / "data")}, **common)  # type: ignore[arg-type]
    assert trainer.datasets["train"] == ParquetSource(str(tmp_path / "data"))
    with pytest.raises(ConfigError, match=r"deterministic=False streams a ray\.data\.Dataset"):
        ElasticTrainer(
            datasets={"train": tmp_path / "data"},
            loop=LoopConfig(deterministic=False, id_column="id"),
            **common,  # type: ignore[arg-type]
        )


def test_many_files_keep_a_bounded_number_open(tmp_path: Path) -> None:
    """40 files of 2 row groups: one epoch reads every row once and never holds more than OPEN_FILES handles."""
    write_regression_parquet(tmp_path / "data", 320, files=40, row_group=4)
    index = ParquetSource(tmp_path / "data", shuffle_window=3).index(("x", "y"), None)
    assert len(index.files) == 40 and len(index.chunk_rows) == 80
    source = ParquetSteps(
        index, seed=0, plan=plan_batch(16, 4, 1), rank=0, device=torch.device("cpu"), drop_last=False, epochs=1
    )
    seen, position = [], 0
    while (step := source.next_step(0, position)) is not None:
        seen += step.ids.tolist()
        position += len(step.ids)
        assert len(source._files) <= OPEN_FILES
    source.close()
    assert sorted(seen) == list(range(320))
