"""A set of sample ids stored as sorted, disjoint ranges: streaming mode's exactly-once bookkeeping.

Streaming mode cannot name its position by a count (its order depends on W and on restarts), so a checkpoint
holds the set of ids consumed in the current epoch. Ray Data reads blocks in order and each rank's shuffle buffer
holds back a few hundred rows, so the consumed set is a few long runs of consecutive ids with holes where rows are
still buffered: as ranges it costs 16 bytes per run, bounded by the layout (workers x shuffle buffer, blocks in
flight), not by how many ids were consumed. Ids in no particular order (hashes) degrade it to 16 bytes per id,
twice a plain array.
"""

from __future__ import annotations

import numpy as np

MAX_ID = np.iinfo(np.int64).max  # exclusive: the end of a range holding id MAX_ID - 1


class IdRanges:
    """A set of int64 ids as half-open ranges [start, end): sorted by start, disjoint and never adjacent (every
    set has exactly one such form). Immutable: `union` returns a new set."""

    __slots__ = ("ranges",)

    def __init__(self, ranges: np.ndarray | None = None) -> None:
        """`ranges`: an (R, 2) int64 array already in the canonical form (as `ranges` of another set, or as
        saved); None: the empty set."""
        self.ranges = np.zeros((0, 2), dtype=np.int64) if ranges is None else np.asarray(ranges, dtype=np.int64)
        if self.ranges.ndim != 2 or self.ranges.shape[1] != 2:
            raise ValueError(f"id ranges must be an (R, 2) array, got shape {self.ranges.shape}")
        starts, ends = self.ranges[:, 0], self.ranges[:, 1]
        if not ((starts < ends).all() and (starts[1:] > ends[:-1]).all()):  # O(R): e.g. a damaged file
            raise ValueError("id ranges must be sorted, non-empty, disjoint and not adjacent")

    @classmethod
    def from_ids(cls, ids: np.ndarray) -> IdRanges:
        """The set of `ids` (integers, any order, repeats allowed; below 2**63 - 1, the end of the last range).
        O(n log n). Raises `ValueError` for ids that are not integers or are out of range."""
        ids = np.asarray(ids)
        if ids.size and ids.dtype.kind not in "iu":
            raise ValueError(f"ids must be integers, got dtype {ids.dtype}")
        if ids.size and ids.dtype.kind == "u" and int(ids.max()) >= MAX_ID:
            raise ValueError(f"ids must be below {MAX_ID}, got {int(ids.max())}")
        ids = np.unique(ids.astype(np.int64))
        if ids.size == 0:
            return cls()
        if ids[-1] >= MAX_ID:
            raise ValueError(f"ids must be below {MAX_ID}, got {int(ids[-1])}")
        breaks = np.flatnonzero(np.diff(ids) != 1) + 1
        starts = ids[np.concatenate(([0], breaks))]
        ends = ids[np.concatenate((breaks - 1, [ids.size - 1]))] + 1
        return cls(np.stack([starts, ends], axis=1))

    def __len__(self) -> int:
        """The number of ids in the set."""
        return int((self.ranges[:, 1] - self.ranges[:, 0]).sum())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, IdRanges) and np.array_equal(self.ranges, other.ranges)

    def __repr__(self) -> str:
        return f"IdRanges({len(self)} ids in {len(self.ranges)} ranges)"

    def contains(self, ids: np.ndarray) -> np.ndarray:
        """Which of `ids` are in the set (a bool array): a binary search over the R ranges per id, O(n log R)."""
        ids = np.asarray(ids, dtype=np.int64)
        if len(self.ranges) == 0:
            return np.zeros(ids.shape, dtype=bool)
        where = np.searchsorted(self.ranges[:, 0], ids, side="right") - 1
        return (where >= 0) & (ids < self.ranges[np.maximum(where, 0), 1])

    def union(self, ids: np.ndarray) -> IdRanges:
        """The set with `ids` added: O((R + n) log(R + n)), independent of how many ids the set already holds."""
        new = IdRanges.from_ids(ids).ranges
        if len(new) == 0:
            return self
        both = np.concatenate([self.ranges, new])
        both = both[np.argsort(both[:, 0], kind="stable")]
        reach = np.maximum.accumulate(both[:, 1])  # the furthest end among the ranges so far
        first = np.concatenate(([True], both[1:, 0] > reach[:-1]))  # a range that starts a merged one
        heads = np.flatnonzero(first)
        return IdRanges(np.stack([both[heads, 0], np.maximum.reduceat(both[:, 1], heads)], axis=1))

    def to_ids(self) -> np.ndarray:
        """Every id of the set, ascending (for tests and small sets: O(ids))."""
        if len(self.ranges) == 0:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(start, end, dtype=np.int64) for start, end in self.ranges])
