"""The data path: stable sample ids, one order per (seed, epoch), exact per-rank slices of every step.

Deterministic mode (`LoopConfig.deterministic=True`, the default)
    The driver materializes the training set once into Ray's object store (`IndexedData.from_dataset`), and
    every worker loads the blocks into memory as numpy columns. The epoch order is a permutation of row
    positions drawn from (seed, epoch) alone; the next optimizer step uses positions `order[p:p+B]`, where p is
    the number of samples of the epoch consumed so far, and rank r takes the contiguous slice the batch plan
    gives it. The order therefore does not depend on the world size, a restart resumes at sample p exactly (also
    with another global batch), and loss curves at different W agree.
    Cost: the whole training set lives in the object store once and in every worker's memory once; it suits
    data sets up to a few GB on a node (the examples use a few MB).

Every epoch ends on purpose: its final partial global batch (N mod B samples) is trained on as one step
normalised by its true size, or dropped with `BatchConfig(drop_last=True)`. Nothing is carried into the next
epoch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from raytrain.data.id_ranges import IdRanges
from raytrain.errors import ConfigError


@dataclass(frozen=True)
class IndexedData:
    """A materialized training set: Arrow block refs in the object store, their row counts and sample ids.

    Built on the driver by `from_dataset`, shipped to workers inside the loop config (refs are borrowed, not
    copied), turned into columns there by `load_columns`.
    """

    block_refs: tuple[Any, ...]
    num_rows: int
    ids: np.ndarray  # int64 sample id of every position, sorted ascending
    columns: tuple[str, ...]
    block_row_of_position: np.ndarray  # position p (id order) -> row index in block order

    @classmethod
    def from_dataset(cls, dataset: Any, id_column: str | None, required_columns: Sequence[str] = ()) -> IndexedData:
        """Materialize `dataset` (a `ray.data.Dataset`) and index it; call on the driver before workers start.

        Raises `ConfigError` when a required or the id column is missing, the set is empty, or ids repeat.
        """
        import ray

        # Keep the row order stable when materializing; raytrain then orders rows by id, so the same ids are
        # at the same positions in every process, whatever order a multi-file read delivers blocks in.
        dataset = dataset.copy(dataset)
        dataset.context.execution_options.preserve_order = True
        materialized = dataset.materialize()
        schema_names = check_columns(materialized, (*required_columns, *([id_column] if id_column else [])))
        refs = tuple(materialized.to_arrow_refs())
        ids = ray.get(ray.remote(num_cpus=0)(_ids_of_blocks).remote(id_column, *refs))
        if ids.size == 0:
            raise ConfigError("training dataset is empty: it must hold at least one row")
        if id_column is None:
            ids = np.arange(ids.size, dtype=np.int64)
        elif np.unique(ids).size != ids.size:
            raise ConfigError(f"id_column {id_column!r} must hold a unique id per row; some ids repeat")
        by_id = np.argsort(ids, kind="stable")
        return cls(refs, int(ids.size), ids[by_id].astype(np.int64), tuple(schema_names), by_id)

    @classmethod
    def from_parquet(cls, fs: Any, files: Sequence[str], required_columns: Sequence[str] = ()) -> IndexedData:
        """Read Parquet `files` (on the pyarrow filesystem `fs`) with pyarrow on the driver, the `required_columns`
        (every column when none is named), into one block in the object store, ids 0..N-1 in file order: a
        validation set, small by nature, without a Ray Data job (its start took 3-7 s of a dry run). `ConfigError`
        naming a missing column or an empty set."""
        import pyarrow.parquet as pq
        import ray

        dataset = pq.ParquetDataset(list(files), filesystem=fs)
        names = list(dataset.schema.names)
        missing = [c for c in required_columns if c not in names]
        if missing:
            raise ConfigError(f"validation dataset has no column(s) {missing}; its columns are {names}")
        table = dataset.read(columns=list(required_columns) or None, use_threads=True)
        if table.num_rows == 0:
            raise ConfigError(f"validation dataset {list(files)[:3]} holds no rows")
        rows = np.arange(table.num_rows, dtype=np.int64)
        return cls((ray.put(table),), int(table.num_rows), rows, tuple(table.column_names), rows)

    def head(self, rows: int) -> dict[str, np.ndarray]:
        """The first `rows` rows of the first block as numpy columns (on the driver, for checks)."""
        import ray
        from ray.data.block import BlockAccessor

        block = BlockAccessor.for_block(ray.get(self.block_refs[0])).to_numpy()
        return {name: as_column([np.asarray(block[name])])[:rows] for name in self.columns}

    def load_columns(self) -> dict[str, np.ndarray]:
        """Fetch every block and return one numpy array per column, rows ordered by id (call in a worker)."""
        import ray
        from ray.data.block import BlockAccessor

        parts: dict[str, list[np.ndarray]] = {name: [] for name in self.columns}
        for table in ray.get(list(self.block_refs)):
            block = BlockAccessor.for_block(table).to_numpy()
            for name in self.columns:
                parts[name].append(np.asarray(block[name]))
        return {name: as_column(chunks)[self.block_row_of_position] for name, chunks in parts.items()}


@dataclass(frozen=True)
class ColumnData:
    """A training set held in memory as numpy columns (a map-style dataset read whole), with the interface of
    `IndexedData` that deterministic mode's `IndexedSteps` uses: rows ordered by sample id."""

    columns_by_id: dict[str, np.ndarray]
    ids: np.ndarray  # int64 sample id of every position, sorted ascending

    @property
    def num_rows(self) -> int:
        """The number of samples."""
        return int(self.ids.size)

    @classmethod
    def from_map_style(cls, dataset: Any, id_column: str | None = None) -> ColumnData:
        """Read every item of a map-style dataset (`len(dataset)`, `dataset[i]` -> a dict of numbers, numpy arrays
        or tensors of one sample) into columns. Ids are `dataset[i][id_column]` (unique integers), else `i`.
        `ConfigError` names what is wrong (an empty set, an item that is not a dict, a missing or repeated id)."""
        import torch

        rows = len(dataset)
        if rows == 0:
            raise ConfigError("training dataset is empty: it must hold at least one item")
        items = [dataset[i] for i in range(rows)]
        if not isinstance(items[0], dict):
            raise ConfigError(
                f"a map-style dataset's items must be dicts of column name -> value, got {type(items[0]).__name__} "
                "for item 0 (return e.g. {'x': features, 'y': label})"
            )
        names = list(items[0])

        def value(item: dict[str, Any], name: str) -> Any:
            v = item[name]
            return v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)

        columns = {name: np.stack([value(item, name) for item in items]) for name in names}
        if id_column is not None:
            if id_column not in columns:
                raise ConfigError(f"id_column {id_column!r} is not a key of the dataset's items {names}")
            ids = columns[id_column].astype(np.int64)
            if np.unique(ids).size != ids.size:
                raise ConfigError(f"id_column {id_column!r} must hold a unique id per item; some ids repeat")
        else:
            ids = np.arange(rows, dtype=np.int64)
        by_id = np.argsort(ids, kind="stable")
        return cls({name: column[by_id] for name, column in columns.items()}, ids[by_id])

    def head(self, rows: int) -> dict[str, np.ndarray]:
        """The first `rows` rows (in id order)."""
        return {name: column[:rows] for name, column in self.columns_by_id.items()}

    def load_columns(self) -> dict[str, np.ndarray]:
        """Every column, rows ordered by id."""
        return self.columns_by_id


def as_column(chunks: list[np.ndarray]) -> np.ndarray:
    """Concatenate column chunks; a column of equal-length arrays (an Arrow list column) becomes a 2-D array."""
    column = np.concatenate(chunks)
    if column.dtype == object and len(column) and isinstance(column[0], np.ndarray):
        with contextlib.suppress(ValueError):  # ragged lists stay an object column (and are not tensors)
            column = np.stack(list(column))
    return column


def check_columns(dataset: Any, required: Sequence[str]) -> list[str]:
    """Return the dataset's column names; raise `ConfigError` naming any of `required` that is missing."""
    names = list(dataset.schema().names)
    missing = [c for c in required if c not in names]
    if missing:
        raise ConfigError(f"training dataset has no column(s) {missing}; its columns are {names}")
    return names


def check_numeric_columns(sample: dict[str, np.ndarray], required: Sequence[str]) -> None:
    """`ConfigError` naming a required column that raytrain cannot hand to `loss_fn` as a tensor: not numeric
    (strings, objects), or lists of different lengths (ragged), judged on `sample` (some real rows)."""
    for name in required:
        column = sample.get(name)
        if column is None or column.dtype.kind in "biuf":
            continue
        if column.dtype == object and len(column) and isinstance(column[0], np.ndarray | list):
            lengths = sorted({len(item) for item in column})
            raise ConfigError(
                f"column {name!r} holds lists of different lengths ({lengths[0]}..{lengths[-1]}): raytrain passes "
                "each column to loss_fn as one tensor; pad the lists to one length"
            )
        raise ConfigError(
            f"column {name!r} is not numeric (dtype {column.dtype}, e.g. {column[:1].tolist()!r}): raytrain passes "
            "only numeric columns to loss_fn; encode it as numbers"
        )


def _ids_of_blocks(id_column: str | None, *tables: Any) -> np.ndarray:
    """Sample ids of all Arrow blocks in order (zeros as placeholders when raytrain numbers rows itself).

    Runs as ONE Ray task over all blocks: a task per block would start a worker process per block.
    """
    parts = [
        np.zeros(t.num_rows, dtype=np.int64)
        if id_column is None
        else np.asarray(t.column(id_column).to_numpy(zero_copy_only=False), dtype=np.int64)
        for t in tables
    ]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def epoch_order(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    """Row positions in the order epoch `epoch` visits them: a permutation drawn from (seed, epoch) only."""
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


def steps_per_epoch(num_rows: int, global_batch: int, drop_last: bool) -> int:
    """Optimizer steps in one epoch: floor(N/B) with `drop_last`, else ceil(N/B) (the last one partial)."""
    steps = num_rows // global_batch if drop_last else -(-num_rows // global_batch)
    if steps == 0:
        raise ConfigError(
            f"global_batch ({global_batch}) is larger than the training set ({num_rows} rows) with drop_last=True: "
            "no step would ever run; lower global_batch or set drop_last=False"
        )
    return steps


def step_position(step: int, num_rows: int, global_batch: int, drop_last: bool) -> tuple[int, int]:
    """Pure: (epoch, sample_in_epoch) of optimizer step `step` (0-based) when every epoch has the same number of
    steps (a step never spans two epochs)."""
    per_epoch = steps_per_epoch(num_rows, global_batch, drop_last)
    return step // per_epoch, (step % per_epoch) * global_batch


def steps_left_in_epoch(num_rows: int, global_batch: int, drop_last: bool, sample_in_epoch: int) -> int:
    """Steps still to run in an epoch whose first `sample_in_epoch` samples are consumed."""
    left = max(0, num_rows - sample_in_epoch)
    return left // global_batch if drop_last else -(-left // global_batch)


def run_total_steps(
    *,
    num_rows: int,
    global_batch: int,
    drop_last: bool,
    epochs: int,
    max_steps: int | None,
    step: int,
    epoch: int,
    sample_in_epoch: int,
) -> int:
    """The run's length in optimizer steps seen from position (step, epoch, sample_in_epoch): the steps done plus
    the steps the remaining epochs take at `global_batch`, capped by `max_steps`. A function of the data and the
    global batch only, never of the world size."""
    left = steps_left_in_epoch(num_rows, global_batch, drop_last, sample_in_epoch) if epoch < epochs else 0
    left += max(0, epochs - epoch - 1) * steps_per_epoch(num_rows, global_batch, drop_last)
    return min(step + left, max_steps) if max_steps is not None else step + left


def describe_run_length(num_rows: int, global_batch: int, drop_last: bool, loop: Any) -> str:
    """Pure: one line saying how long the run is and what ends it, for `loop` (a `LoopConfig`): its epochs, its
    max_steps, or (both given) whichever comes first, and at which step; and, where the global batch does not
    divide the data set, what each epoch's last step holds (`drop_last`)."""
    return _run_length(num_rows, global_batch, drop_last, loop) + _last_step(num_rows, global_batch, drop_last)


def _run_length(num_rows: int, global_batch: int, drop_last: bool, loop: Any) -> str:
    per_epoch = steps_per_epoch(num_rows, global_batch, drop_last)
    if loop.max_steps is None:
        epochs = loop.epoch_limit
        return f"run length: {epochs} epoch(s) of {per_epoch} steps, {epochs * per_epoch} steps"
    if loop.epochs is None:
        return f"run length: max_steps={loop.max_steps} ({loop.max_steps / per_epoch:.3g} epochs of {per_epoch} steps)"
    by_epochs = loop.epochs * per_epoch
    if by_epochs <= loop.max_steps:
        return (
            f"run length: epochs={loop.epochs} ends the run at step {by_epochs} ({per_epoch} steps per epoch), "
            f"before max_steps={loop.max_steps}"
        )
    return (
        f"run length: max_steps={loop.max_steps} ends the run in epoch {(loop.max_steps - 1) // per_epoch} "
        f"(of epochs 0-{loop.epochs - 1}, counted from 0 as the metrics count them; {per_epoch} steps per epoch)"
    )


def _last_step(num_rows: int, global_batch: int, drop_last: bool) -> str:
    left = num_rows % global_batch
    if not left:
        return ""
    if drop_last:
        return f"; each epoch leaves out {left} of its {num_rows} samples (drop_last=True; a reshuffle picks others)"
    return (
        f"; each epoch's last step trains the {left} samples left, not {global_batch}, at the step's LR "
        "(drop_last=False; drop_last=True leaves them out)"
    )


def step_positions(order: np.ndarray, sample_in_epoch: int, global_batch: int) -> np.ndarray:
    """Row positions of the global batch that starts at `sample_in_epoch` (fewer than B only at an epoch's end)."""
    return order[sample_in_epoch : sample_in_epoch + global_batch]


def to_tensors(columns: dict[str, np.ndarray], device: Any) -> dict[str, Any]:
    """Numeric numpy columns as torch tensors on `device` (other columns, e.g. strings, are left out)."""
    import torch

    return {
        name: torch.from_numpy(np.ascontiguousarray(value)).to(device)
        for name, value in columns.items()
        if value.dtype.kind in "biuf"
    }


def rank_micro_batches(
    columns: dict[str, np.ndarray], positions: np.ndarray, plan: Any, rank: int, device: Any
) -> list[dict[str, Any]]:
    """Rank `rank`'s contiguous slice of a step's row `positions`, cut into its planned micro-batches (tensors)."""
    start = plan.rank_offset(rank)
    batches = []
    for size in plan.micro_batches[rank]:
        picked = positions[start : start + size]
        batches.append(to_tensors({k: v[picked] for k, v in columns.items()}, device))
        start += size
    return batches


@dataclass
class StepData:
    """What one rank trains on in one optimizer step."""

    micro_batches: list[dict[str, Any]]  # this rank's micro-batches (column tensors)
    plan: Any  # BatchPlan of this step (its global_batch is the step's true size)
    ids: np.ndarray  # sample ids of the whole step in rank order (deterministic mode) or of this rank (streaming)


class IndexedSteps:
    """Deterministic mode's step source: the step at position p of epoch e is `order(seed, e)[p:p+B]`, whatever W
    is."""

    def __init__(
        self, data: IndexedData | ColumnData, *, seed: int, plan: Any, rank: int, device: Any, drop_last: bool
    ) -> None:
        self.data, self.seed, self.plan, self.rank, self.device = data, seed, plan, rank, device
        self.drop_last = drop_last
        self.num_rows = data.num_rows
        self.columns = data.load_columns()
        self._epoch, self._order = -1, np.zeros(0, dtype=np.int64)

    def next_step(self, epoch: int, sample_in_epoch: int) -> StepData | None:
        """The data of the step that starts at sample `sample_in_epoch` of `epoch`'s order, or None when that
        epoch has no more steps (nothing left, or less than a global batch left with `drop_last`)."""
        from raytrain.batch_plan import split_step

        if steps_left_in_epoch(self.data.num_rows, self.plan.global_batch, self.drop_last, sample_in_epoch) == 0:
            return None
        if epoch != self._epoch:
            self._epoch, self._order = epoch, epoch_order(self.data.num_rows, self.seed, epoch)
        positions = step_positions(self._order, sample_in_epoch, self.plan.global_batch)
        plan = self.plan
        if len(positions) != plan.global_batch:
            plan = split_step(len(positions), plan.micro_batch_cap, plan.world_size)
        batches = rank_micro_batches(self.columns, positions, plan, self.rank, self.device)
        return StepData(batches, plan, self.data.ids[positions])

    def set_share(self, plan: Any, rank: int) -> None:
        """Live mode: the plan and this rank's place in it from the next step on (a step's participants change
        when replicas come and go)."""
        self.plan, self.rank = plan, rank

    def global_ids(self, step: StepData) -> np.ndarray:
        """All ids of `step` in rank order (every rank already knows them here)."""
        return step.ids

    def consumed_ids(self) -> IdRanges:
        """Nothing to store: the data position (epoch, sample_in_epoch) determines the consumed ids here."""
        return IdRanges()

    def close(self) -> None:
        """Nothing to stop (no threads: the rows are in memory)."""
