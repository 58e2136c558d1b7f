"""The few small collectives the loop needs, each an identity when there is no process group (world size 1).

Every rank must call them in the same order (they are collectives).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(value: float) -> float:
    """`value` summed over ranks (in float64)."""
    tensor = torch.tensor([value], dtype=torch.float64)
    if _distributed():
        dist.all_reduce(tensor)
    return float(tensor.item())


def all_gather_ints(values: list[int]) -> list[list[int]]:
    """Every rank's list of ints (all of the same length), in rank order."""
    if not _distributed():
        return [values]
    tensor = torch.tensor(values, dtype=torch.int64)
    out = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor)
    return [t.tolist() for t in out]


def all_gather_objects(value: Any) -> list[Any]:
    """Every rank's picklable `value`, in rank order."""
    if not _distributed():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered
