"""The sample order of an epoch over a fixed partition of the data: a pure function of (seed, epoch, the chunks'
row counts, window, partitions), never of the number of workers.

The data is a list of chunks (Parquet row groups) in a canonical order, each with its row count. Epoch e:
    1. permutes the chunks with a generator seeded by (seed, e) and deals them to P canonical partitions
       (partition c gets chunks c, c + P, c + 2P, ... of the permutation; P = min(partitions, chunks));
    2. cuts each partition's chunks into windows of `window_chunks` consecutive chunks and shuffles the rows of
       each window with a generator seeded by (seed, e, c, window): partition c's own sequence of rows;
    3. interleaves the P sequences round robin (position p of the epoch is the next row of partition p mod P while
       all partitions have rows; a partition that runs out drops out of the rotation).
A step of B samples is positions [p, p + B). With P dividing B (`effective_partitions` makes it so) every step
takes exactly B / P rows from each partition while all partitions have rows. Its samples are then laid out
partition by partition (`PartitionedOrder.step_items`) and rank r takes the r-th contiguous share of that layout,
so a rank's share covers the same ~P / W partitions step after step and the ranks split the epoch's rows by
partition: each row group is read by one rank (two where a share's boundary falls inside a partition), not by
every rank. Nothing here depends on W: the global batch of every step is the same set of samples, in the same
layout, at every world size and after any restart.

Trade-offs (see docs/architecture.md): a rank holds the current window of each partition in its share, about
P / W windows (more partitions: fewer reads per byte at large W, more memory per rank at small W); rows mix within
a window and every batch mixes P windows; W > P shares a partition between W / P ranks, each reading it.
"""

from __future__ import annotations

import numpy as np


def effective_partitions(requested: int, chunks: int, global_batch: int | None) -> int:
    """The canonical partitions used (pure): the largest P <= min(`requested`, `chunks`) that divides
    `global_batch`, so that every step takes exactly B / P rows from each partition and a rank's share covers the
    same partitions step after step (a P that does not divide B moves the shares' boundaries from step to step,
    and ranks would read each other's partitions); min(requested, chunks) when no global batch is given."""
    most = max(1, min(requested, chunks))
    if global_batch is None:
        return most
    return max(p for p in range(1, most + 1) if global_batch % p == 0)


class PartitionedOrder:
    """The order of epoch `epoch` over chunks with `chunk_rows` rows each (see the module docstring).

    Windows are numbered partition by partition: partition c's windows are `window_base[c]` to
    `window_base[c + 1] - 1`; `windows[w]` lists the chunks of window w in the order its rows are concatenated.
    """

    def __init__(self, chunk_rows: np.ndarray, *, seed: int, epoch: int, window_chunks: int, partitions: int) -> None:
        if window_chunks < 1:
            raise ValueError(f"window_chunks must be >= 1, got {window_chunks}")
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        self.chunk_rows = np.asarray(chunk_rows, dtype=np.int64)
        if len(self.chunk_rows) == 0 or (self.chunk_rows <= 0).any():
            raise ValueError("every chunk must hold at least one row, and there must be one")
        self.seed, self.epoch, self.window_chunks = seed, epoch, window_chunks
        self.partitions = min(partitions, len(self.chunk_rows))
        dealt = np.random.default_rng([seed, epoch]).permutation(len(self.chunk_rows))
        self.windows: list[np.ndarray] = []
        self.window_partition: list[int] = []
        base = [0]
        for c in range(self.partitions):
            members = dealt[c :: self.partitions]
            for i in range(0, len(members), window_chunks):
                self.windows.append(members[i : i + window_chunks])
                self.window_partition.append(c)
            base.append(len(self.windows))
        self.window_base = np.array(base, dtype=np.int64)
        self.window_rows = np.array([self.chunk_rows[w].sum() for w in self.windows], dtype=np.int64)
        # Where each window starts within its partition's sequence (index of its first row there).
        self.window_offset = np.zeros(len(self.windows), dtype=np.int64)
        self.partition_rows = np.zeros(self.partitions, dtype=np.int64)
        for c in range(self.partitions):
            lo, hi = self.window_base[c], self.window_base[c + 1]
            rows = self.window_rows[lo:hi]
            self.window_offset[lo:hi] = np.concatenate([[0], np.cumsum(rows)[:-1]])
            self.partition_rows[c] = rows.sum()
        self.num_rows = int(self.partition_rows.sum())
        # Every window's first row as one sorted key (partition * stride + index within it): `window_of` is then
        # one binary search for all items of a step.
        self._stride = int(self.partition_rows.max()) + 1
        self._window_keys = np.array(self.window_partition, dtype=np.int64) * self._stride + self.window_offset
        # The round robin in phases: in phase k every partition holding more than `level[k-1]` rows gives one row
        # per turn, for rows level[k-1] .. level[k] - 1 of each; phase k starts at epoch position `phase_start[k]`.
        self._levels = np.unique(self.partition_rows)
        self._active = [np.flatnonzero(self.partition_rows >= level) for level in self._levels]
        previous = np.concatenate([[0], self._levels[:-1]])
        lengths = np.array([len(a) for a in self._active], dtype=np.int64) * (self._levels - previous)
        self._previous = previous
        self._phase_start = np.concatenate([[0], np.cumsum(lengths)])
        self._permutations: dict[int, np.ndarray] = {}

    def locate_partition(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(partition, index within the partition's sequence) of each epoch position (0 <= p < num_rows)."""
        positions = np.asarray(positions, dtype=np.int64)
        phase = np.searchsorted(self._phase_start, positions, side="right") - 1
        partition = np.empty(len(positions), dtype=np.int64)
        index = np.empty(len(positions), dtype=np.int64)
        for k in np.unique(phase):
            mask = phase == k
            active = self._active[int(k)]
            offset = positions[mask] - self._phase_start[k]
            partition[mask] = active[offset % len(active)]
            index[mask] = self._previous[k] + offset // len(active)
        return partition, index

    def step_items(self, begin: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """The samples at epoch positions [begin, end) laid out partition by partition (by position within a
        partition): (partition, index within partition) arrays. Rank r's share is a contiguous slice of them."""
        positions = np.arange(begin, end, dtype=np.int64)
        partition, index = self.locate_partition(positions)
        layout = np.lexsort((positions, partition))
        return partition[layout], index[layout]

    def window_of(self, partition: np.ndarray, index: np.ndarray) -> np.ndarray:
        """The window (global number) of each (partition, index within the partition)."""
        keys = np.asarray(partition, dtype=np.int64) * self._stride + np.asarray(index, dtype=np.int64)
        return np.searchsorted(self._window_keys, keys, side="right") - 1

    def permutation(self, window: int) -> np.ndarray:
        """Row shuffle of `window`: local position q -> index into the window's concatenated chunk rows."""
        if window not in self._permutations:
            c = self.window_partition[window]
            rng = np.random.default_rng([self.seed, self.epoch, 1, c, window - int(self.window_base[c])])
            self._permutations[window] = rng.permutation(int(self.window_rows[window]))
            if len(self._permutations) > 2 * self.partitions + 4:  # a bound for callers that never `forget`
                self._permutations.pop(next(iter(self._permutations)))
        return self._permutations[window]

    def forget(self, keep: set[int]) -> None:
        """Drop the row shuffles of windows not in `keep` (a reader calls it as it drops those windows' rows:
        a shuffle costs 8 bytes per row of its window)."""
        for window in [w for w in self._permutations if w not in keep]:
            del self._permutations[window]

    def rows_in_window(self, window: int, index: np.ndarray) -> np.ndarray:
        """For partition indices `index` inside `window`: their row indices in the window's concatenated chunks."""
        return self.permutation(window)[np.asarray(index, dtype=np.int64) - self.window_offset[window]]

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(chunk, row within chunk) of each epoch position, in the canonical chunk numbering."""
        partition, index = self.locate_partition(positions)
        return self.locate_items(partition, index)

    def locate_items(self, partition: np.ndarray, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(chunk, row within chunk) of each (partition, index within the partition)."""
        windows = self.window_of(partition, index)
        chunks = np.empty(len(windows), dtype=np.int64)
        rows = np.empty(len(windows), dtype=np.int64)
        for window in np.unique(windows):
            mask = windows == window
            local = self.rows_in_window(int(window), np.asarray(index)[mask])
            members = self.windows[int(window)]
            starts = np.concatenate([[0], np.cumsum(self.chunk_rows[members])])
            slot = np.searchsorted(starts, local, side="right") - 1
            chunks[mask] = members[slot]
            rows[mask] = local - starts[slot]
        return chunks, rows


def canonical_ids(chunk_rows: np.ndarray, chunks: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Sample ids without an id column: the row's index in the canonical order of all chunks."""
    starts = np.concatenate([[0], np.cumsum(np.asarray(chunk_rows, dtype=np.int64))])
    return starts[chunks] + rows
