"""Streaming mode (`LoopConfig.deterministic=False`): data of any size through `get_dataset_shard`, every sample
exactly once per epoch, also across restarts and resizes.

Per epoch each rank iterates its Ray Data shard (`ExactSplitConfig`: a streaming split that never drops rows)
with a local shuffle buffer seeded from (seed, epoch, rank). Ranks run dry unevenly near the end of an epoch, so
every optimizer step is agreed collectively (`take_counts`): each rank offers what it has buffered; a shortfall
is covered by ranks that still have rows; only when every shard is exhausted is the epoch's final step smaller
than B (and normalised by its true size). Sample order is NOT reproducible across world sizes or restarts here;
exactly-once is: the ids consumed in the current epoch are part of every checkpoint (as ranges of consecutive ids,
`raytrain.data.id_ranges`) and filtered out after a restart, so committed samples are not replayed and samples after
the checkpoint are (the model was rolled back).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from ray.train import DataConfig

from raytrain.batch_plan import BatchPlan, _even_split
from raytrain.collectives import all_gather_ints, all_gather_objects
from raytrain.data.id_ranges import IdRanges
from raytrain.data.materialized import as_column


class ExactSplitConfig(DataConfig):
    """Ray Train's `DataConfig`, but the "train" split is `streaming_split(equal=False)`: with equal=True Ray Data
    may drop up to W-1 rows per epoch to even out the shards, which would break exactly-once."""

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        """Split "train" without dropping rows; other datasets get a full iterator on every worker."""
        output: list[dict[str, Any]] = [{} for _ in range(world_size)]
        for name, dataset in datasets.items():
            if name == "train":
                splits = dataset.streaming_split(world_size, equal=False, locality_hints=worker_node_ids)
                for rank, split in enumerate(splits):
                    output[rank][name] = split
            else:
                for rank in range(world_size):
                    output[rank][name] = dataset.iterator()
        return output


def take_counts(need: list[int], available: list[int], global_batch: int) -> list[int]:
    """How many buffered samples each rank uses this step: its planned share where it has it, a shortfall covered
    by the ranks with surplus in rank order. Pure and identical on every rank (all inputs were all-gathered)."""
    take = [min(n, a) for n, a in zip(need, available, strict=True)]
    deficit = global_batch - sum(take)
    for rank, have in enumerate(available):
        if deficit <= 0:
            break
        extra = min(have - take[rank], deficit)
        take[rank] += extra
        deficit -= extra
    return take


def micro_split(take: list[int], micro_batch_cap: int) -> tuple[tuple[int, ...], ...]:
    """Per-rank micro-batch sizes for counts `take`: the fewest accumulation steps with no micro-batch above the cap."""
    steps = max(1, max(-(-t // micro_batch_cap) for t in take))
    return tuple(tuple(_even_split(t, steps)) for t in take)


class StreamingShard:
    """One rank's view of its shard for one epoch: a buffer of rows refilled from the Ray Data iterator, with the
    ids already consumed this epoch filtered out."""

    def __init__(
        self,
        iterator: Any,
        *,
        id_column: str,
        consumed: IdRanges,
        seed: int,
        epoch: int,
        rank: int,
        shuffle_buffer: int,
        read_batch: int,
        empty: dict[str, np.ndarray],
    ) -> None:
        self.id_column = id_column
        self.empty = empty  # zero-row columns: what a rank with nothing left trains on (FSDP needs every rank)
        self.consumed = consumed
        self._batches: Iterator[dict[str, np.ndarray]] = iter(
            iterator.iter_batches(
                batch_size=read_batch,
                batch_format="numpy",
                local_shuffle_buffer_size=shuffle_buffer,
                local_shuffle_seed=int(np.random.default_rng([seed, epoch, rank]).integers(2**31)),
            )
        )
        self._chunks: list[dict[str, np.ndarray]] = []
        self.buffered = 0
        self.exhausted = False

    def fill(self, target: int) -> None:
        """Read from the shard until `target` rows are buffered or the shard is exhausted."""
        while self.buffered < target and not self.exhausted:
            try:
                chunk = next(self._batches)
            except StopIteration:
                self.exhausted = True
                break
            # Arrow list columns arrive as object arrays of arrays: stacked into 2-D arrays (numeric ones as they are)
            chunk = {name: as_column([c]) if c.dtype == object else c for name, c in chunk.items()}
            if len(self.consumed.ranges):
                keep = ~self.consumed.contains(chunk[self.id_column])
                chunk = {k: v[keep] for k, v in chunk.items()}
            n = len(chunk[self.id_column])
            if n:
                self._chunks.append(chunk)
                self.buffered += n

    def take(self, count: int) -> dict[str, np.ndarray]:
        """Remove and return the first `count` buffered rows as numpy columns."""
        if count == 0:
            return dict(self.empty)
        merged = {k: np.concatenate([c[k] for c in self._chunks]) for k in self._chunks[0]}
        taken = {k: v[:count] for k, v in merged.items()}
        rest = {k: v[count:] for k, v in merged.items()}
        self._chunks = [rest] if len(rest[self.id_column]) else []
        self.buffered -= count
        return taken


def agree_step(shard: StreamingShard, need: list[int], rank: int, global_batch: int) -> list[int]:
    """Fill buffers and agree on this step's per-rank counts (collective). Returns `take` for every rank; a sum of 0
    means the epoch is over, a sum below B that this is its final partial step."""
    target = need[rank]
    while True:
        shard.fill(target)
        rows = all_gather_ints([shard.buffered, int(shard.exhausted)])
        available = [r[0] for r in rows]
        take = take_counts(need, available, global_batch)
        short = global_batch - sum(take)
        if short == 0 or all(r[1] for r in rows):
            return take
        target = shard.buffered + short  # everyone still reading pulls enough to cover the shortfall alone


def step_plan_from_take(take: list[int], micro_batch_cap: int, global_batch: int) -> BatchPlan:
    """The `BatchPlan` of one agreed streaming step (per-rank counts may differ by more than one near the end)."""
    micro = micro_split(take, micro_batch_cap)
    return BatchPlan(sum(take), micro_batch_cap, len(take), len(micro[0]), micro)


class StreamingSteps:
    """Streaming mode's step source over `ray.train.get_dataset_shard("train")`; see the module docstring."""

    def __init__(
        self,
        *,
        id_column: str,
        seed: int,
        plan: BatchPlan,
        rank: int,
        device: Any,
        shuffle_buffer: int,
        consumed: IdRanges,
        drop_last: bool,
        empty: dict[str, np.ndarray],
    ) -> None:
        self.empty = empty  # zero-row columns of the dataset
        self.id_column, self.seed, self.plan, self.rank, self.device = id_column, seed, plan, rank, device
        self.shuffle_buffer, self.drop_last = shuffle_buffer, drop_last
        self.consumed_before = consumed  # the epoch's ids of all ranks up to the latest checkpoint
        self.consumed_now: list[np.ndarray] = []  # this rank's ids since then
        self._epoch: int | None = None
        self._shard: StreamingShard | None = None

    def _open(self, epoch: int) -> StreamingShard:
        import ray.train

        if self._epoch is not None and epoch != self._epoch:
            self.consumed_before, self.consumed_now = IdRanges(), []
        self._epoch = epoch
        return StreamingShard(
            ray.train.get_dataset_shard("train"),
            id_column=self.id_column,
            consumed=self.consumed_before,
            seed=self.seed,
            epoch=epoch,
            rank=self.rank,
            shuffle_buffer=self.shuffle_buffer,
            read_batch=max(self.plan.micro_batch_cap, 32),
            empty=self.empty,
        )

    def next_step(self, epoch: int, sample_in_epoch: int) -> Any:
        """This rank's data for the next step of `epoch` (collective), or None when the epoch is used up.

        The position within the epoch is the set of consumed ids, not `sample_in_epoch` (kept for the same
        signature as deterministic mode). When the epoch is used up its ids are forgotten: a checkpoint taken
        after that holds the next epoch's (empty) set, so a run extended with more epochs trains all of them."""
        from raytrain.data.materialized import StepData, to_tensors

        if self._shard is None or epoch != self._epoch:
            self._shard = self._open(epoch)
        take = agree_step(self._shard, list(self.plan.per_rank_samples), self.rank, self.plan.global_batch)
        total = sum(take)
        if total == 0 or (self.drop_last and total < self.plan.global_batch):
            self._shard.fill(2**62)  # drain, so the split's epoch completes on every rank
            self._shard = None
            self.consumed_before, self.consumed_now = IdRanges(), []
            return None
        plan = step_plan_from_take(take, self.plan.micro_batch_cap, self.plan.global_batch)
        rows = self._shard.take(take[self.rank])
        self.consumed_now.append(rows[self.id_column])
        batches, start = [], 0
        for size in plan.micro_batches[self.rank]:
            batches.append(to_tensors({k: v[start : start + size] for k, v in rows.items()}, self.device))
            start += size
        return StepData(batches, plan, rows[self.id_column])

    def global_ids(self, step: Any) -> np.ndarray:
        """All ids of `step` in rank order (collective)."""
        return np.concatenate(all_gather_objects(np.asarray(step.ids, dtype=np.int64)))

    def consumed_ids(self) -> IdRanges:
        """The ids consumed so far in the current epoch by all ranks (collective); saved in checkpoints.

        Only the ids consumed since the previous call travel (an all-gather of one checkpoint interval's ids, not
        of the whole epoch's); every rank merges them into the ranges it keeps."""
        local = np.concatenate(self.consumed_now) if self.consumed_now else np.zeros(0, dtype=np.int64)
        new = np.concatenate(all_gather_objects(local.astype(np.int64)))
        self.consumed_before = self.consumed_before.union(new)
        self.consumed_now = []
        return self.consumed_before
