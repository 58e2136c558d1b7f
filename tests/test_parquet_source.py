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
from raytrain.data.parquet import (
    MAX_WINDOWS_AHEAD,
    OPEN_FILES,
    ParquetIndex,
    ParquetSource,
    ParquetSteps,
    as_source,
    describe_reads,
)
from raytrain.data.sample_order import PartitionedOrder, canonical_ids, effective_partitions
from raytrain.errors import ConfigError
from raytrain.toy import regression_arrays, write_regression_parquet


@given(
    st.lists(st.integers(1, 30), min_size=1, max_size=12),
    st.integers(0, 5),
    st.integers(0, 3),
    st.integers(1, 5),
    st.integers(1, 6),
)
def test_the_partitioned_order_visits_every_row_once(
    rows: list[int], seed: int, epoch: int, window: int, partitions: int
) -> None:
    order = PartitionedOrder(np.array(rows), seed=seed, epoch=epoch, window_chunks=window, partitions=partitions)
    assert order.partitions == min(partitions, len(rows))
    chunks, within = order.locate(np.arange(order.num_rows))
    ids = canonical_ids(np.array(rows), chunks, within)
    assert sorted(ids.tolist()) == list(range(sum(rows)))
    assert all((within < np.array(rows)[chunks]).tolist())
    # A partition's rows come from its own chunks, a window's from the window's chunks: a rank holding a share of
    # partitions needs their chunks and nothing else.
    partition, index = order.locate_partition(np.arange(order.num_rows))
    windows = order.window_of(partition, index)
    for w, members in enumerate(order.windows):
        assert set(chunks[windows == w].tolist()) == set(members.tolist())
        assert set(partition[windows == w].tolist()) == {order.window_partition[w]}
    # Round robin: while every partition has rows, consecutive positions cycle through all of them.
    first = order.partitions * int(order.partition_rows.min())
    assert partition[:first].tolist() == list(range(order.partitions)) * int(order.partition_rows.min())


def test_the_order_depends_on_seed_and_epoch_only() -> None:
    rows = np.array([16, 14, 16, 14, 16, 14])

    def order(seed: int, epoch: int) -> PartitionedOrder:
        return PartitionedOrder(rows, seed=seed, epoch=epoch, window_chunks=2, partitions=3)

    a, b, c = (order(3, 1).locate(np.arange(90)), order(3, 1).locate(np.arange(90)), order(3, 2).locate(np.arange(90)))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not (np.array_equal(a[0], c[0]) and np.array_equal(a[1], c[1]))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_ranks_split_the_row_groups_instead_of_each_reading_them(world: int) -> None:
    """64 row groups of 10 rows in 8 partitions, B = 32: over an epoch, each rank's share of each step touches only
    its partitions' row groups. With W dividing P every row group is read by exactly one rank; otherwise a share's
    boundary cuts at most W - 1 partitions, each then read by two ranks."""
    rows = np.full(64, 10)
    order = PartitionedOrder(rows, seed=0, epoch=0, window_chunks=2, partitions=8)
    plan = plan_batch(32, 32, world)
    read: list[set[int]] = [set() for _ in range(world)]
    for begin in range(0, order.num_rows, 32):
        partition, index = order.step_items(begin, begin + 32)
        assert sorted(partition.tolist()) == partition.tolist()  # laid out partition by partition
        chunks, _ = order.locate_items(partition, index)
        for r in range(world):
            lo = plan.rank_offset(r)
            read[r] |= set(chunks[lo : lo + plan.per_rank_samples[r]].tolist())
    reads = sum(len(r) for r in read)
    assert set().union(*read) == set(range(64))
    assert reads == 64 if 8 % world == 0 else 64 <= reads <= 64 + (world - 1) * 8


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


def test_a_source_told_a_new_share_mid_epoch_reads_what_a_fresh_source_for_that_share_reads(tmp_path: Path) -> None:
    """Live mode's replicas keep one source while the participants change (`set_share` before a step): the steps
    assembled ahead for the old share are dropped, and the new share's rows are the ones a fresh source gives,
    the partial last step of the epoch included."""
    index = _index(tmp_path, 90)
    cpu = torch.device("cpu")
    moving = ParquetSteps(index, seed=7, plan=plan_batch(20, 4, 2), rank=1, device=cpu, drop_last=False, epochs=9)
    for position, (world, rank) in zip(range(0, 90, 20), [(2, 1), (2, 1), (1, 0), (3, 2), (3, 0)], strict=True):
        moving.set_share(plan_batch(20, 4, world), rank)
        got = moving.next_step(0, position)
        fresh = ParquetSteps(
            index, seed=7, plan=plan_batch(20, 4, world), rank=rank, device=cpu, drop_last=False, epochs=9
        )
        want = fresh.next_step(0, position)
        fresh.close()
        assert got is not None and want is not None
        assert got.plan == want.plan and got.ids.tolist() == want.ids.tolist(), (position, world, rank)
        for a, b in zip(got.micro_batches, want.micro_batches, strict=True):
            assert torch.equal(a["x"], b["x"]) and torch.equal(a["y"], b["y"])
    moving.close()


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


def test_a_worker_holds_a_few_windows_and_reads_its_share_once(tmp_path: Path) -> None:
    """240 row groups in 8 partitions, windows of 2, W = 2: over a whole epoch a rank holds at most its share's
    current windows (8 / 2 partitions) plus as many loaded ahead, far below the data set, and reads half of the
    rows from storage, each once; the CPU of both data threads is counted."""
    write_regression_parquet(tmp_path / "data", 3840, files=3, row_group=16)
    index = ParquetSource(tmp_path / "data", shuffle_window=2, partitions=8).index(("x", "y"), None)
    plan = plan_batch(16, 4, 2)
    source = ParquetSteps(index, seed=0, plan=plan, rank=0, device=torch.device("cpu"), drop_last=False, epochs=1)
    position = 0
    while source.next_step(0, position) is not None:
        position += 16
    window_bytes = 32 * (8 * 4 + 4 + 8)  # 32 rows of x (8 float32), y (float32) and the canonical id (int64)
    assert 0 < source.stats.peak_bytes <= (4 + max(4, MAX_WINDOWS_AHEAD)) * window_bytes
    assert source.stats.peak_bytes / (3840 * (8 * 4 + 4 + 8)) <= 0.07
    assert source.stats.rows_loaded == 3840 // 2
    assert source.stats.load_cpu_s > 0 and source.stats.assemble_cpu_s > 0  # each thread's CPU, counted
    source.close()


@pytest.mark.parametrize(("partitions", "amplification"), [(1, 4.0), (8, 1.0)])
def test_an_epoch_at_w4_reads_the_data_once_not_w_times(tmp_path: Path, partitions: int, amplification: float) -> None:
    """Four ranks through one epoch of 40 row groups of 16 rows, windows of 4 (B = 32): the rows they load from
    storage together are the data set once with 8 partitions; with one partition (the layout before partitions:
    every rank's share inside the same window) four times."""
    write_regression_parquet(tmp_path / "data", 640, files=2, row_group=16)
    index = ParquetSource(tmp_path / "data", shuffle_window=4, partitions=partitions).index(("x", "y"), None)
    plan = plan_batch(32, 8, 4)
    loaded, seen = 0, []
    for rank in range(4):
        source = ParquetSteps(
            index, seed=3, plan=plan, rank=rank, device=torch.device("cpu"), drop_last=False, epochs=1
        )
        position = 0
        while (step := source.next_step(0, position)) is not None:
            seen += step.ids.tolist()
            position += 32
        loaded += source.stats.rows_loaded
        source.close()
    assert sorted(seen) == list(range(640))
    assert loaded / 640 == amplification


def test_an_epoch_begun_in_one_order_ends_in_it_after_a_resume_with_other_partitions(tmp_path: Path) -> None:
    """Half an epoch with partitions=8, windows of 2; resumed with partitions=3, windows of 1 (and W 2 -> 3): the
    rest of that epoch still follows the order it began in (every row once), the next epoch the new one, and the
    checkpoint's `data_order` says which is which. A changed data set is named instead."""
    write_regression_parquet(tmp_path / "data", 640, files=2, row_group=16)
    before = ParquetSource(tmp_path / "data", shuffle_window=2, partitions=8).index(("x", "y"), None)
    after = ParquetSource(tmp_path / "data", shuffle_window=1, partitions=3).index(("x", "y"), None)

    def source(index: ParquetIndex, world: int, rank: int) -> ParquetSteps:
        plan = plan_batch(32, 8, world)
        return ParquetSteps(index, seed=5, plan=plan, rank=rank, device=torch.device("cpu"), drop_last=False, epochs=3)

    first = [source(before, 2, r) for r in range(2)]
    seen = [i for position in range(0, 320, 32) for s in first for i in s.next_step(0, position).ids.tolist()]
    stored = first[0].order_params(0)
    assert stored == {"row_groups": 40, "rows": 640, "partitions": 8, "shuffle_window": 2}
    resumed = [source(after, 3, r) for r in range(3)]
    notes = {s.keep_order(0, 320, stored) for s in resumed}
    assert notes == {
        "data order: epoch 0 began with partitions=8, shuffle_window=2 and ends in that order (every sample once); "
        "epochs from 1 use partitions=3, shuffle_window=1"
    }
    seen += [i for position in range(320, 640, 32) for s in resumed for i in s.next_step(0, position).ids.tolist()]
    assert sorted(seen) == list(range(640))
    assert resumed[0].order_params(0) == stored and resumed[0].order_params(1) == after.order_params()
    fresh = [source(after, 3, r) for r in range(3)]
    assert [i for s in resumed for i in s.next_step(1, 0).ids.tolist()] == [
        i for s in fresh for i in s.next_step(1, 0).ids.tolist()
    ]
    assert fresh[0].keep_order(1, 0, stored) is None  # at an epoch's start there is nothing to keep
    grown = {**stored, "rows": 600}
    assert "WARNING: the training data changed since the checkpoint (600 rows" in str(fresh[1].keep_order(0, 64, grown))
    assert "WARNING: the checkpoint does not say in which order epoch 0 began" in str(fresh[2].keep_order(0, 64, {}))
    for s in first + resumed + fresh:
        s.close()


def test_the_partitions_used_divide_the_global_batch() -> None:
    assert effective_partitions(32, 1000, 512) == 32
    assert effective_partitions(32, 1000, 96) == 32 and effective_partitions(32, 1000, 20) == 20
    assert effective_partitions(32, 1000, 4) == 4  # B < P: each step takes one row from each of 4
    assert effective_partitions(32, 12, 512) == 8  # at most the row groups
    assert effective_partitions(32, 1000, 97) == 1  # a prime batch: one partition
    assert effective_partitions(32, 6, None) == 6


@pytest.mark.parametrize("global_batch", [4, 12, 16])
def test_a_batch_below_the_partitions_still_reads_each_row_group_once(tmp_path: Path, global_batch: int) -> None:
    """40 row groups of 16 rows, partitions=32 asked, W = 1: the partitions used divide B (4, 12 -> 4 and 12,
    16), so every partition gives rows every step and its window stays loaded until it is used up; with 32
    partitions and B = 4 a window would come back every 8 steps, long after it was dropped (13x the reads)."""
    write_regression_parquet(tmp_path / "data", 640, files=2, row_group=16)
    index = ParquetSource(tmp_path / "data").index(("x", "y"), None, global_batch)
    assert index.partitions == {4: 4, 12: 12, 16: 16}[global_batch]
    source = ParquetSteps(
        index,
        seed=0,
        plan=plan_batch(global_batch, 4, 1),
        rank=0,
        device=torch.device("cpu"),
        drop_last=False,
        epochs=1,
    )
    seen, position = [], 0
    while (step := source.next_step(0, position)) is not None:
        seen += step.ids.tolist()
        position += global_batch
    assert sorted(seen) == list(range(640))
    assert source.stats.rows_loaded == 640
    assert len(source._order(0)._permutations) <= index.partitions + MAX_WINDOWS_AHEAD + 1  # shuffles go with windows
    source.close()


def test_the_driver_says_why_partitions_and_reads_are_what_they_are(tmp_path: Path) -> None:
    write_regression_parquet(tmp_path / "data", 640, files=2, row_group=16)
    index = ParquetSource(tmp_path / "data", partitions=32).index(("x", "y"), None, 40)
    lines = describe_reads(index, 32, 40, replicas=32)
    assert (
        lines[0].startswith("training data: 2 Parquet file(s), 40 row groups, 640 rows")
        and "20 partition(s)" in lines[0]
    )
    assert lines[1] == (
        "partitions: 20, not 32: the largest number <= 32 that divides the global batch 40, so that every step "
        "takes 2 row(s) from each partition and each rank reads the same partitions step after step"
    )
    assert lines[2] == (
        "note: up to 32 data-parallel replicas share 20 partition(s), so an epoch reads each row group up to 2 "
        "times; a global batch with more small divisors (e.g. a power of two) allows up to 32"
    )
    assert len(describe_reads(ParquetSource(tmp_path / "data").index(("x", "y"), None, 32), 32, 32, 4)) == 1


def test_bad_sources_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        ParquetSource(tmp_path / "missing").resolve()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no \*\.parquet file"):
        ParquetSource(tmp_path / "empty").resolve()
    with pytest.raises(ConfigError, match="shuffle_window must be an int >= 1"):
        ParquetSource(tmp_path, shuffle_window=0)
    with pytest.raises(ConfigError, match=r"partitions must be an int >= 1 \(canonical partitions\), got 0"):
        ParquetSource(tmp_path, partitions=0)
    write_regression_parquet(tmp_path / "data", 10, files=1)
    with pytest.raises(ConfigError, match=r"no column\(s\) \['label'\]"):
        ParquetSource(tmp_path / "data").index(("x", "label"), None)
    every = ParquetSource(tmp_path / "data").index((), "id").columns  # no required_columns: every column, id too
    assert set(every) >= {"x", "y", "id"} and ParquetSource(tmp_path / "data").index(("x",), "id").columns == (
        "x",
        "id",
    )
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
