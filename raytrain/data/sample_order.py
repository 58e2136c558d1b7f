"""The sample order of an epoch over a fixed partition of the data: a pure function of (seed, epoch, partition).

The data is a list of chunks (Parquet row groups) in a canonical order, each with its row count. Epoch e visits
them as follows:
    1. the chunks are permuted with a generator seeded by (seed, e);
    2. consecutive runs of `window_chunks` chunks of that permutation form windows;
    3. the rows of each window (its chunks' rows concatenated in permuted order) are shuffled with a generator
       seeded by (seed, e, window).
Global position p of the epoch is the p-th row of the windows laid end to end. Nothing here depends on the
number of workers, so the global batch of every step (positions [p, p + B)) is the same at every world size and
after any restart; a worker needs only the windows its slice of a step touches, so its memory is bounded by a few
windows, not by the data set. The shuffle is two-level (as in Mosaic's StreamingDataset): rows mix freely within
a window and windows come in random order; a bigger window mixes more and costs more memory per worker.
"""

from __future__ import annotations

import numpy as np


class WindowedOrder:
    """The order of epoch `epoch` over chunks with `chunk_rows` rows each (see the module docstring)."""

    def __init__(self, chunk_rows: np.ndarray, *, seed: int, epoch: int, window_chunks: int) -> None:
        if window_chunks < 1:
            raise ValueError(f"window_chunks must be >= 1, got {window_chunks}")
        self.chunk_rows = np.asarray(chunk_rows, dtype=np.int64)
        self.seed, self.epoch, self.window_chunks = seed, epoch, window_chunks
        chunk_order = np.random.default_rng([seed, epoch]).permutation(len(self.chunk_rows))
        self.windows = [chunk_order[i : i + window_chunks] for i in range(0, len(chunk_order), window_chunks)]
        self.window_rows = np.array([self.chunk_rows[w].sum() for w in self.windows], dtype=np.int64)
        self.window_start = np.concatenate([[0], np.cumsum(self.window_rows)]).astype(np.int64)
        self.num_rows = int(self.window_start[-1])
        self._permutations: dict[int, np.ndarray] = {}

    def window_of(self, positions: np.ndarray) -> np.ndarray:
        """The window of each global position (0 <= p < num_rows)."""
        return np.searchsorted(self.window_start, positions, side="right") - 1

    def permutation(self, window: int) -> np.ndarray:
        """Row shuffle of `window`: local position q -> index into the window's concatenated chunk rows."""
        if window not in self._permutations:
            rng = np.random.default_rng([self.seed, self.epoch, 1, window])
            self._permutations[window] = rng.permutation(int(self.window_rows[window]))
            if len(self._permutations) > 4:  # a step touches one or two windows; keep the recent ones
                self._permutations.pop(next(iter(self._permutations)))
        return self._permutations[window]

    def rows_in_window(self, window: int, positions: np.ndarray) -> np.ndarray:
        """For global `positions` inside `window`: their row indices in the window's concatenated chunks."""
        return self.permutation(window)[positions - self.window_start[window]]

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(chunk, row within chunk) of each global position, in the canonical chunk numbering."""
        positions = np.asarray(positions, dtype=np.int64)
        chunks = np.empty(len(positions), dtype=np.int64)
        rows = np.empty(len(positions), dtype=np.int64)
        windows = self.window_of(positions)
        for window in np.unique(windows):
            mask = windows == window
            index = self.rows_in_window(int(window), positions[mask])
            members = self.windows[int(window)]
            starts = np.concatenate([[0], np.cumsum(self.chunk_rows[members])])
            slot = np.searchsorted(starts, index, side="right") - 1
            chunks[mask] = members[slot]
            rows[mask] = index - starts[slot]
        return chunks, rows


def canonical_ids(chunk_rows: np.ndarray, chunks: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Sample ids without an id column: the row's index in the canonical order of all chunks."""
    starts = np.concatenate([[0], np.cumsum(np.asarray(chunk_rows, dtype=np.int64))])
    return starts[chunks] + rows


def windows_between(order: WindowedOrder, begin: int, end: int) -> list[int]:
    """The windows that global positions [begin, end) touch, in order (empty when begin >= end)."""
    if begin >= end:
        return []
    first, last = order.window_of(np.array([begin, end - 1]))
    return list(range(int(first), int(last) + 1))
