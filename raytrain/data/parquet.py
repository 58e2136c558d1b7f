"""The durable data path: training data read straight from Parquet (local, shared or `s3://`), in an exact,
world-size-independent order, with bounded memory per worker.

    datasets={"train": raytrain.ParquetSource("s3://bucket/train/")}    # or a local directory / file list

On the driver, `ParquetSource.index` reads only the files' footers: the canonical chunks are the (file, row group,
rows) with files sorted by path. Every worker then follows `raytrain.data.sample_order.PartitionedOrder` (row groups
dealt to `partitions` canonical partitions per epoch, rows shuffled within windows of `shuffle_window` row groups of
a partition, partitions interleaved): the global batch of a step is the next B positions of the epoch's order, laid
out partition by partition, and rank r takes its contiguous share of that layout. A rank therefore reads the row
groups of about P / W partitions, and each row group of an epoch is read by one rank (two where a share's
boundary cuts a partition), from the files, never from object-store copies that vanish with a node. A background
thread loads the windows of the next steps ahead of time, looking as many steps ahead as a window load takes
(measured), so the loop does not wait on data in steady state; windows behind the position are dropped. The
checkpoint holds the position (epoch, samples consumed in it) only: constant size, and a restart at any world size
resumes exactly.

Memory per worker: the current window of each partition in its share (about P / W windows) plus the windows
loaded ahead, whatever the data set's size. With W > P a partition is shared by about W / P ranks, each reading
it; sample ids are the rows' canonical indices unless `id_column` names a column.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from raytrain.data.id_ranges import IdRanges
from raytrain.data.sample_order import PartitionedOrder, canonical_ids, effective_partitions
from raytrain.errors import ConfigError


@dataclass(frozen=True)
class ParquetSource:
    """Parquet training data read in place by every worker (see the module docstring).

    Attributes:
        paths: a file, a directory (all `*.parquet` files below it) or a list of them; local paths or URIs that
            pyarrow understands (`s3://bucket/prefix`, `gs://...`). Local paths must be visible to every node.
        filesystem: a `pyarrow.fs.FileSystem` to read `paths` with (e.g. `S3FileSystem(endpoint_override=...)`);
            None derives it from the URI (credentials from the environment) or uses the local file system.
        shuffle_window: row groups per shuffle window of a partition (>= 1): rows mix within a window, and
            every batch mixes the current windows of all partitions.
        partitions: canonical partitions P (>= 1). The run uses the largest P' <= P that divides the global
            batch and is at most the number of row groups (`effective_partitions`; logged). Ranks split the
            partitions, so each row group is read by about max(1, W / P') ranks per epoch: keep P' >= the most
            data-parallel replicas you run (a global batch with small divisors, e.g. a power of two, allows it).
            Memory per worker is about P' / W windows (plus the prefetch). Part of the sample
            order (as is `shuffle_window`): a resume with another value ends the current epoch in the stored one.
    """

    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
    filesystem: Any = None
    shuffle_window: int = 1
    partitions: int = 32

    def __post_init__(self) -> None:
        for name in ("shuffle_window", "partitions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                unit = "row groups" if name == "shuffle_window" else "canonical partitions"
                raise ConfigError(f"{name} must be an int >= 1 ({unit}), got {value!r}")
        paths = [self.paths] if isinstance(self.paths, str | os.PathLike) else list(self.paths)
        if not paths:
            raise ConfigError("ParquetSource needs at least one path, got none")

    def resolve(self) -> tuple[Any, list[str]]:
        """(filesystem, sorted Parquet file paths on it); `ConfigError` for a path that does not exist or holds
        no Parquet file."""
        import pyarrow.fs as pafs

        given = [self.paths] if isinstance(self.paths, str | os.PathLike) else list(self.paths)
        files: list[str] = []
        fs = self.filesystem
        for raw in given:
            path = os.fspath(raw)
            if fs is None:
                if "://" in path:
                    fs, path = pafs.FileSystem.from_uri(path)
                else:
                    fs, path = pafs.LocalFileSystem(), os.path.abspath(path)
            elif "://" in path:
                path = path.split("://", 1)[1]
            info = fs.get_file_info(path)
            if info.type == pafs.FileType.NotFound:
                raise ConfigError(f"training data path {os.fspath(raw)!r} does not exist")
            if info.type == pafs.FileType.Directory:
                found = fs.get_file_info(pafs.FileSelector(path, recursive=True))
                files += sorted(f.path for f in found if f.is_file and f.path.endswith(".parquet"))
            else:
                files.append(path)
        if not files:
            raise ConfigError(f"no *.parquet file found under {[os.fspath(p) for p in given]}")
        return fs, sorted(set(files))

    def index(
        self, required_columns: Sequence[str], id_column: str | None, global_batch: int | None = None
    ) -> ParquetIndex:
        """Read every file's footer (on the driver; `FOOTER_THREADS` at a time, as object storage serves each in
        a round trip) and build the canonical chunks, with the partitions `effective_partitions` picks for
        `global_batch`; `ConfigError` naming a missing column, a file whose columns differ from the first's, or
        an empty data set (found as the footers arrive: the reads still queued are cancelled)."""
        import pyarrow.parquet as pq

        fs, files = self.resolve()

        def footer(path: str) -> tuple[list[tuple[int, int]], list[str]]:
            """(rows, uncompressed bytes) of each row group, and the column names: only these few numbers are
            kept, the parsed footer is freed at once (10,000 of them held would cost hundreds of MB)."""
            with fs.open_input_file(path) as handle:
                meta = pq.ParquetFile(handle).metadata
                groups = [
                    (meta.row_group(g).num_rows, meta.row_group(g).total_byte_size) for g in range(meta.num_row_groups)
                ]
                return groups, list(meta.schema.to_arrow_schema().names)

        chunk_file, chunk_group, chunk_rows, chunk_bytes = [], [], [], []
        names: list[str] | None = None
        pool = ThreadPoolExecutor(max_workers=min(FOOTER_THREADS, len(files)))
        try:
            footers = pool.map(footer, files)  # in file order
            for number, (path, (groups, schema_names)) in enumerate(zip(files, footers, strict=True)):
                if names is None:
                    names = schema_names
                elif schema_names != names:
                    raise ConfigError(f"{path} has columns {schema_names}, the first file {files[0]} has {names}")
                for group, (rows, nbytes) in enumerate(groups):
                    if rows:
                        chunk_file.append(number)
                        chunk_group.append(group)
                        chunk_rows.append(rows)
                        chunk_bytes.append(nbytes)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        assert names is not None
        wanted = tuple(dict.fromkeys([*required_columns, *([id_column] if id_column else [])]))
        missing = [c for c in wanted if c not in names]
        if missing:
            raise ConfigError(f"training data has no column(s) {missing}; its columns are {names}")
        if not chunk_rows:
            raise ConfigError(f"training data {files[:3]} holds no rows")
        columns = wanted if required_columns else tuple(names)  # none named: every column (the id one too)
        return ParquetIndex(
            filesystem=fs,
            files=tuple(files),
            chunk_file=np.array(chunk_file, dtype=np.int64),
            chunk_group=np.array(chunk_group, dtype=np.int64),
            chunk_rows=np.array(chunk_rows, dtype=np.int64),
            chunk_bytes=np.array(chunk_bytes, dtype=np.int64),
            columns=columns,
            id_column=id_column,
            window_chunks=self.shuffle_window,
            partitions=effective_partitions(self.partitions, len(chunk_rows), global_batch),
        )


def describe_reads(index: ParquetIndex, requested: int, global_batch: int, replicas: int) -> list[str]:
    """The driver's lines about a Parquet data set and how the ranks split its reads (pure): the data, the
    partitions used and, when fewer than asked, why; a note when more data-parallel `replicas` than partitions
    make ranks share (and each read) partitions, with what would avoid it."""
    chunks, used = len(index.chunk_rows), index.partitions
    lines = [
        f"training data: {len(index.files)} Parquet file(s), {chunks} row groups, {index.num_rows} rows, "
        f"{index.data_bytes / 1e6:.3g} MB; read in place from {used} partition(s) in windows of "
        f"{index.window_chunks} row group(s), each row group by one rank per epoch"
    ]
    if used < min(requested, chunks):
        lines.append(
            f"partitions: {used}, not {min(requested, chunks)}: the largest number <= {min(requested, chunks)} that "
            f"divides the global batch {global_batch}, so that every step takes {global_batch // used} row(s) from "
            f"each partition and each rank reads the same partitions step after step"
        )
    if replicas > used:
        if used == chunks:
            fix = f"the data has only {chunks} row groups: smaller row groups allow more partitions"
        elif used < requested:
            fix = f"a global batch with more small divisors (e.g. a power of two) allows up to {requested}"
        else:
            fix = f"ParquetSource(partitions={replicas}) reads it once"
        lines.append(
            f"note: up to {replicas} data-parallel replicas share {used} partition(s), so an epoch reads each row "
            f"group up to {-(-replicas // used)} times; {fix}"
        )
    return lines


def as_source(dataset: Any) -> Any:
    """`dataset` as given, except a path or URI string (or `os.PathLike`), which becomes a `ParquetSource`."""
    return ParquetSource(dataset) if isinstance(dataset, str | os.PathLike) else dataset


@dataclass(frozen=True)
class ParquetIndex:
    """The canonical partition of a `ParquetSource` (built on the driver, shipped to workers: a few numbers per
    row group, nothing per sample)."""

    filesystem: Any
    files: tuple[str, ...]
    chunk_file: np.ndarray  # file number of each chunk (row group), in canonical order
    chunk_group: np.ndarray  # row group number within its file
    chunk_rows: np.ndarray
    chunk_bytes: np.ndarray  # uncompressed size from the footer
    columns: tuple[str, ...]  # the columns read: the required ones and the id column; every one when none required
    id_column: str | None
    window_chunks: int
    partitions: int  # canonical partitions used (`effective_partitions`: <= the row groups, divides the batch)

    @property
    def num_rows(self) -> int:
        """Rows in the data set."""
        return int(self.chunk_rows.sum())

    @property
    def data_bytes(self) -> int:
        """Uncompressed bytes of the data set (all columns), from the footers."""
        return int(self.chunk_bytes.sum())

    @property
    def window_bytes(self) -> int:
        """Uncompressed bytes of the largest shuffle window (a bound on any epoch's windows, of any partition)."""
        largest = np.sort(self.chunk_bytes)[::-1][: self.window_chunks]
        return int(largest.sum())

    def order_params(self) -> dict[str, int]:
        """What the sample order depends on besides (seed, epoch): stored in every checkpoint (`data_order`)."""
        return {
            "row_groups": len(self.chunk_rows),
            "rows": self.num_rows,
            "partitions": self.partitions,
            "shuffle_window": self.window_chunks,
        }

    def with_order(self, partitions: int, shuffle_window: int) -> ParquetIndex:
        """The same data in the order of other (effective) `partitions` and `shuffle_window`."""
        return replace(self, partitions=min(partitions, len(self.chunk_rows)), window_chunks=shuffle_window)

    def order(self, seed: int, epoch: int) -> PartitionedOrder:
        """The sample order of `epoch`."""
        return PartitionedOrder(
            self.chunk_rows, seed=seed, epoch=epoch, window_chunks=self.window_chunks, partitions=self.partitions
        )

    def read_chunks(
        self, chunks: Sequence[int] | np.ndarray, files: dict[int, Any] | None = None
    ) -> dict[str, np.ndarray]:
        """The rows of `chunks` concatenated in the given order, as numpy columns (plus "__id__" when no id
        column). `files` caches open `ParquetFile`s by file number."""
        import pyarrow as pa
        import pyarrow.parquet as pq
        from ray.data.block import BlockAccessor

        from raytrain.data.materialized import as_column

        files = {} if files is None else files
        tables = []
        for chunk in chunks:
            number = int(self.chunk_file[chunk])
            if number not in files:
                while len(files) >= OPEN_FILES:  # the oldest handle goes: a data set may have many files
                    files.pop(next(iter(files)))
                files[number] = pq.ParquetFile(self.filesystem.open_input_file(self.files[number]))
            tables.append(files[number].read_row_group(int(self.chunk_group[chunk]), columns=list(self.columns)))
        block = BlockAccessor.for_block(pa.concat_tables(tables)).to_numpy()
        out = {name: as_column([np.asarray(block[name])]) for name in self.columns}
        if self.id_column is None:
            out["__id__"] = np.concatenate(
                [
                    canonical_ids(self.chunk_rows, np.full(self.chunk_rows[c], c), np.arange(self.chunk_rows[c]))
                    for c in chunks
                ]
            )
        return out

    def head(self, rows: int) -> dict[str, np.ndarray]:
        """The first `rows` rows of the first row group (on the driver, for checks)."""
        return {k: v[:rows] for k, v in self.read_chunks([0]).items() if k != "__id__"}


FOOTER_THREADS = 32  # footers the driver reads at once when indexing
OPEN_FILES = 16  # Parquet file handles a worker keeps open (their footers are parsed once)
STEPS_AHEAD = 4  # this rank's slices of at most this many next steps are assembled ahead (at least 1)
MAX_WINDOWS_AHEAD = 2  # windows loaded ahead of the current step's: at most this many, or as many as it touches


@dataclass
class _Window:
    columns: dict[str, np.ndarray]
    nbytes: int


@dataclass
class PrefetchStats:
    """What the prefetcher measured (rank-local): window load times, the step interval and the bytes held."""

    load_s: list[float] = field(default_factory=list)  # the latest window loads (seconds)
    rows_loaded: int = 0  # rows read from storage (every window load counted, again when loaded again)
    held_bytes: int = 0
    peak_bytes: int = 0
    lookahead: int = 0
    # CPU seconds (`time.thread_time`) of the two background threads, each written by its own thread only: what
    # reading and assembling cost in CPU, which on a node with few cores is taken from the training compute.
    load_cpu_s: float = 0.0
    assemble_cpu_s: float = 0.0


class ParquetSteps:
    """The step source over a `ParquetIndex`: the step at position p of epoch e is positions [p, p + B) of epoch
    e's order (`index.order(seed, e)`, or the stored one for an epoch begun in another, `keep_order`), whatever W
    is; this rank materializes only the rows of its share."""

    def __init__(
        self,
        index: ParquetIndex,
        *,
        seed: int,
        plan: Any,
        rank: int,
        device: Any,
        drop_last: bool,
        epochs: int,
        log: Callable[[str], None] = lambda _: None,
        replica_ranks: Sequence[int] | None = None,
    ) -> None:
        self.index, self.seed, self.plan, self.rank, self.device = index, seed, plan, rank, device
        self.drop_last, self.epochs, self.log = drop_last, epochs, log
        self.replica_ranks = replica_ranks  # the global rank holding each replica's slice (None: rank r holds r's)
        self.num_rows = index.num_rows
        self.stats = PrefetchStats()
        self._orders: dict[int, PartitionedOrder] = {}
        self._kept: tuple[int, ParquetIndex] | None = None  # (epoch, its index) of an epoch begun in another order
        self._slices: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # by step position
        self._cache: OrderedDict[tuple[int, int], Future[_Window]] = OrderedDict()
        self._lock = threading.Lock()
        self._order_lock = threading.RLock()
        self._read_lock = threading.Lock()
        # Two threads, one job each: the loader reads windows and never waits; the assembler builds the next
        # step's tensors and waits only for the loader (one shared pool could fill with waiting assemblers).
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raytrain-data-load")
        self._assembler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raytrain-data-step")
        self._steps: dict[tuple[int, int], Future[Any]] = {}  # steps being assembled ahead, by position
        self._handed: tuple[int, int] | None = None  # the position of the step handed over last
        self._files: dict[int, Any] = {}
        self._last_call: float | None = None
        self._intervals: list[float] = []  # the latest step intervals (seconds)
        self._calls = 0
        self._told = False
        self._step_windows = 1  # windows the latest step's share touched

    def set_share(self, plan: Any, rank: int) -> None:
        """Live mode: the plan and this rank's place in it from the next step on (a step's participants change
        when replicas come and go). The switch runs in the assembler thread, after what it began for the old
        share; the windows loaded stay (they are the same for every share)."""
        if plan == self.plan and rank == self.rank:
            return
        self._assembler.submit(self._switch, plan, rank).result()

    def _switch(self, plan: Any, rank: int) -> None:
        """(In the assembler thread, the only one that plans, slices and assembles steps: none runs meanwhile, and
        every one queued behind this switch reads the new share.) The new share; the steps queued for the old one
        cancelled, its slices forgotten."""
        with self._lock, self._order_lock:
            self.plan, self.rank = plan, rank
            for future in self._steps.values():
                future.cancel()
            self._steps.clear()
            self._slices.clear()

    def _order(self, epoch: int) -> PartitionedOrder:
        with self._order_lock:
            if epoch not in self._orders:
                self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
                self._orders[epoch] = self._index_of(epoch).order(self.seed, epoch)
            return self._orders[epoch]

    def _index_of(self, epoch: int) -> ParquetIndex:
        return self._kept[1] if self._kept is not None and self._kept[0] == epoch else self.index

    def order_params(self, epoch: int) -> dict[str, int]:
        """The order parameters epoch `epoch` is read in (what a checkpoint stores as `data_order`)."""
        return self._index_of(epoch).order_params()

    def keep_order(self, epoch: int, sample_in_epoch: int, stored: dict[str, int]) -> str | None:
        """After a resume mid-epoch: finish epoch `epoch` in the order it was begun in (`stored`, the checkpoint's
        `data_order`) when the source's `partitions` or `shuffle_window` changed since, so that every sample of
        it is still seen once; later epochs use the new values. Returns the line to log (None: nothing changed),
        a warning when the data itself changed (its rest of the epoch then follows the new data's order)."""
        current = self.index.order_params()
        if sample_in_epoch == 0 or stored == current:
            return None
        if not stored:  # written before the order was stored (raytrain before canonical partitions)
            return (
                f"WARNING: the checkpoint does not say in which order epoch {epoch} began (it predates canonical "
                f"partitions): the rest of the epoch follows today's order, so samples of it may repeat or be missed"
            )
        if (stored.get("row_groups"), stored.get("rows")) != (current["row_groups"], current["rows"]):
            return (
                f"WARNING: the training data changed since the checkpoint ({stored.get('rows')} rows in "
                f"{stored.get('row_groups')} row groups, now {current['rows']} in {current['row_groups']}): the rest "
                f"of epoch {epoch} follows the new data's order, so samples of it may repeat or be missed"
            )
        self._kept = (epoch, self.index.with_order(stored["partitions"], stored["shuffle_window"]))
        self._orders.pop(epoch, None)
        self._slices.clear()
        return (
            f"data order: epoch {epoch} began with partitions={stored['partitions']}, shuffle_window="
            f"{stored['shuffle_window']} and ends in that order (every sample once); epochs from {epoch + 1} use "
            f"partitions={current['partitions']}, shuffle_window={current['shuffle_window']}"
        )

    def _load(self, epoch: int, window: int) -> _Window:
        began, cpu = time.perf_counter(), time.thread_time()
        chunks = self._order(epoch).windows[window]
        with self._read_lock:  # one reader at a time on the cached file handles
            columns = self.index.read_chunks(chunks, self._files)
        self.stats.load_s.append(time.perf_counter() - began)
        self.stats.rows_loaded += int(self.index.chunk_rows[chunks].sum())
        del self.stats.load_s[:-20]
        self.stats.load_cpu_s += time.thread_time() - cpu
        return _Window(columns, sum(v.nbytes for v in columns.values()))

    def _window(self, epoch: int, window: int) -> Future[_Window]:
        key = (epoch, window)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = self._loader.submit(self._load, epoch, window)
            return self._cache[key]

    def _slice(self, epoch: int, begin: int, plan: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This rank's share of the step of `plan` that starts at `begin`: (partition, index within partition,
        window) of each of its samples, in the step's partition-by-partition layout (computed once per step:
        the look-ahead asks for the same steps again every step)."""
        key = (epoch, begin)
        with self._order_lock:
            if key not in self._slices:
                order = self._order(epoch)
                partition, index = order.step_items(begin, begin + plan.global_batch)
                mine = slice(
                    plan.rank_offset(self.rank), plan.rank_offset(self.rank) + plan.per_rank_samples[self.rank]
                )
                self._slices[key] = (partition[mine], index[mine], order.window_of(partition[mine], index[mine]))
                while len(self._slices) > 2 * 64 + 8:  # more than any look-ahead: the oldest go
                    self._slices.pop(next(iter(self._slices)))
            return self._slices[key]

    def _lookahead(self) -> int:
        """Steps to load ahead: as many as loading a step's windows takes at the measured step interval, plus
        one (measured once 5 step intervals are known, then every 10 steps; it never shrinks, as a window loaded
        ahead and then outside a shorter look-ahead would be dropped and read again; memory stays bounded by the
        windows-ahead cap of `_prefetch`). A step's windows roll over together (every partition gives the same
        rows per step), and the one loader thread reads them one after the other. The first measurement is said
        in one line with the numbers that gave it."""
        if len(self._intervals) < 5 or not self.stats.load_s:
            return max(1, self.stats.lookahead)
        if self._calls % 10 and self._told:
            return self.stats.lookahead
        interval = float(np.median(self._intervals[-20:]))
        window = float(np.median(self.stats.load_s[-5:]))
        wanted = int(min(64, np.ceil(window * max(1, self._step_windows) / max(interval, 1e-4)) + 1))
        if not self._told:
            self._told = True
            windows, groups = max(1, self._step_windows), self.index.window_chunks
            self.log(
                f"data prefetch: a window of {groups} row group{'s' if groups != 1 else ''} loads in {window:.3f} s, "
                f"a step reads {windows} window{'s' if windows != 1 else ''} and takes {interval:.3f} s: reading "
                f"{wanted} step(s) ahead"
            )
        return max(self.stats.lookahead, wanted)

    def _prefetch(self, epoch: int, sample_in_epoch: int) -> tuple[set[tuple[int, int]], list[tuple[int, int]]]:
        """Start loading the windows of this rank's shares of the current and the next steps (as many steps as
        `_lookahead` says; beyond the current step's windows, at most as many more as it touches, and at least
        `MAX_WINDOWS_AHEAD`). Returns the windows still needed and the positions of the following steps whose
        windows are all among them."""
        lookahead = self._lookahead()
        self.stats.lookahead = lookahead
        needed: set[tuple[int, int]] = set()
        covered: list[tuple[int, int]] = []
        position: tuple[int, int] | None = (epoch, sample_in_epoch)
        ahead, cap = 0, MAX_WINDOWS_AHEAD  # windows beyond the current step's: memory stays bounded by windows
        for _ in range(lookahead + 1):
            if position is None:
                break
            windows = self._slice(position[0], position[1], self._plan_at(position[1]))[2]
            if position == (epoch, sample_in_epoch):  # a step's windows roll over together: as many may load ahead
                self._step_windows = len(np.unique(windows))
                cap = max(MAX_WINDOWS_AHEAD, self._step_windows)
            for window in dict.fromkeys(windows.tolist()):
                if (position[0], window) not in needed:
                    if position != (epoch, sample_in_epoch):
                        ahead += 1
                    if ahead > cap:
                        return needed, covered[1:]
                    needed.add((position[0], window))
                    self._window(position[0], window)
            covered.append(position)
            position = self._following(*position)
        return needed, covered[1:]

    def _plan_at(self, sample_in_epoch: int) -> Any:
        """The batch plan of the step at `sample_in_epoch`: the run's, or the split of an epoch's partial last."""
        from raytrain.batch_plan import split_step

        total = min(self.plan.global_batch, self.num_rows - sample_in_epoch)
        if total == self.plan.global_batch:
            return self.plan
        return split_step(total, self.plan.micro_batch_cap, self.plan.world_size)

    def _evict(self, keep: set[tuple[int, int]]) -> None:
        """Forget the windows not in `keep` (a load in flight finishes and is then freed; none is cancelled, so a
        step being assembled never loses a window it waits for: it would load it again)."""
        with self._lock:
            for key in [k for k in self._cache if k not in keep]:
                self._cache.pop(key)
            held = sum(f.result().nbytes for f in self._cache.values() if f.done() and f.exception() is None)
        with self._order_lock:
            for epoch, order in self._orders.items():
                order.forget({w for e, w in keep if e == epoch})
        self.stats.held_bytes = held
        self.stats.peak_bytes = max(self.stats.peak_bytes, held)

    def next_step(self, epoch: int, sample_in_epoch: int) -> Any:
        """The data of the step that starts at sample `sample_in_epoch` of `epoch`'s order, or None when that
        epoch has no more steps (nothing left, or less than a global batch left with `drop_last`).

        The step's rows were normally assembled in the background while the previous step trained; this call
        only hands them over and leaves the planning of the next steps to the assembler thread (`_plan_ahead`),
        so the training thread does almost nothing here."""
        from raytrain.data.materialized import steps_left_in_epoch

        now = time.perf_counter()
        if self._last_call is not None:
            self._intervals.append(now - self._last_call)
            del self._intervals[:-40]
            self._calls += 1
        self._last_call = now
        if steps_left_in_epoch(self.num_rows, self.plan.global_batch, self.drop_last, sample_in_epoch) == 0:
            return None
        key = (epoch, sample_in_epoch)
        with self._lock:
            self._handed = key
            future = self._steps.pop(key, None)
            self._steps = {k: f for k, f in self._steps.items() if k > key}
        if future is None:
            future = self._assembler.submit(self._timed, self._assemble, epoch, sample_in_epoch)
        self._assembler.submit(self._timed, self._plan_ahead, epoch, sample_in_epoch)
        step = future.result()
        if self.device.type != "cpu":
            step.micro_batches = [{k: v.to(self.device) for k, v in b.items()} for b in step.micro_batches]
        return step

    def _timed(self, work: Callable[..., Any], *args: Any) -> Any:
        """(In the assembler thread.) `work(*args)`, its CPU time added to `stats.assemble_cpu_s`."""
        cpu = time.thread_time()
        try:
            return work(*args)
        finally:
            self.stats.assemble_cpu_s += time.thread_time() - cpu

    def _plan_ahead(self, epoch: int, sample_in_epoch: int) -> None:
        """(In the assembler thread, after the step at `sample_in_epoch` is handed over.) Start the window loads of
        the next steps, queue the assembly of those whose windows are kept, forget the windows no longer needed."""
        needed, ahead = self._prefetch(epoch, sample_in_epoch)
        for following in ahead[:STEPS_AHEAD]:
            with self._lock:
                if following in self._steps or (self._handed is not None and following <= self._handed):
                    continue
                self._steps[following] = self._assembler.submit(self._timed, self._assemble, *following)
        self._evict(needed)

    def _following(self, epoch: int, sample_in_epoch: int) -> tuple[int, int] | None:
        """The position of the step after the one at (epoch, sample_in_epoch), None after the run's last epoch
        (the epochs of the run: a run that ends earlier, at max_steps, loads at most a few steps too many)."""
        position = sample_in_epoch + self.plan.global_batch
        if position >= self.num_rows or (self.drop_last and self.num_rows - position < self.plan.global_batch):
            return (epoch + 1, 0) if epoch + 1 < self.epochs else None
        return epoch, position

    def _assemble(self, epoch: int, sample_in_epoch: int) -> Any:
        """This rank's rows of the step at (epoch, sample_in_epoch) as CPU tensors (runs in the prefetch pool)."""
        from raytrain.data.materialized import StepData, to_tensors

        plan = self._plan_at(sample_in_epoch)
        _, index, windows = self._slice(epoch, sample_in_epoch, plan)
        rows: dict[str, np.ndarray] = {}
        for window in dict.fromkeys(windows.tolist()):
            data = self._window(epoch, window).result().columns
            mask = windows == window
            with self._order_lock:
                within = self._order(epoch).rows_in_window(window, index[mask])
            for name, column in data.items():
                if name not in rows:
                    rows[name] = np.empty((len(index), *column.shape[1:]), dtype=column.dtype)
                rows[name][mask] = column[within]
        if not rows:  # an empty slice (a rank without samples in a final partial step)
            rows = self.index.head(0)
        ids = rows.pop("__id__", None) if self.index.id_column is None else rows[self.index.id_column]
        ids = np.zeros(0, dtype=np.int64) if ids is None else ids
        batches, offset = [], 0
        for size in plan.micro_batches[self.rank]:
            batches.append(to_tensors({k: v[offset : offset + size] for k, v in rows.items()}, "cpu"))
            offset += size
        return StepData(batches, plan, np.asarray(ids, dtype=np.int64))

    def global_ids(self, step: Any) -> np.ndarray:
        """All ids of `step` in replica order (collective: each rank holds only its own slice's ids; the ranks of
        one model-parallel replica hold the same slice, counted once)."""
        from raytrain.collectives import all_gather_objects

        gathered = all_gather_objects(step.ids)
        if self.replica_ranks is not None:
            gathered = [gathered[r] for r in self.replica_ranks]
        return np.concatenate(gathered)

    def consumed_ids(self) -> IdRanges:
        """Nothing to store: the data position (epoch, sample_in_epoch) determines the consumed ids here."""
        return IdRanges()

    def close(self) -> None:
        """Stop the prefetch threads (pending loads are cancelled)."""
        self._assembler.shutdown(wait=False, cancel_futures=True)
        self._loader.shutdown(wait=False, cancel_futures=True)
