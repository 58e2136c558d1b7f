"""The few small collectives the loop needs, each an identity when there is no process group.

Every rank must call them in the same order (they are collectives). Their tensors live on the process group's
device (`collective_device`): NCCL, which Ray Train picks with `use_gpu=True`, takes CUDA tensors only; gloo takes
CPU tensors. Whenever a process group exists they run, at world size 1 too, so a one-GPU run exercises the rule.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

# Backends whose collectives take CUDA tensors only (NCCL, and its AMD twin RCCL reports itself as "nccl").
CUDA_ONLY_BACKENDS = ("nccl",)


def device_for_backend(backend: str, cuda_device: int | None = None) -> torch.device:
    """The device a collective's tensors must be on for `backend`: the current (or given) CUDA device for nccl,
    the CPU for gloo and anything else. Pure: never touches the process group."""
    if backend.lower() in CUDA_ONLY_BACKENDS:
        return torch.device("cuda", torch.cuda.current_device() if cuda_device is None else cuda_device)
    return torch.device("cpu")


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def collective_device() -> torch.device:
    """The device for the default process group's collectives (the CPU when there is none)."""
    return device_for_backend(str(dist.get_backend())) if _active() else torch.device("cpu")


def all_reduce_sum(value: float, group: Any = None) -> float:
    """`value` summed over the ranks of `group` (None: every rank), in float64."""
    tensor = torch.tensor([value], dtype=torch.float64, device=collective_device())
    if _active():
        dist.all_reduce(tensor, group=group)
    return float(tensor.item())


def all_reduce_min(value: int) -> int:
    """The smallest `value` over ranks."""
    tensor = torch.tensor([value], dtype=torch.int64, device=collective_device())
    if _active():
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def all_reduce_sum_and_max(value: float, maxed: list[float]) -> tuple[float, list[float]]:
    """`value` summed over every rank and `maxed` (the same length on every rank) element-wise maxed, in ONE
    collective: an all-gather of 1 + len(maxed) float64 per rank, reduced locally in rank order (so every rank gets
    bit-identical results)."""
    if not _active():
        return value, list(maxed)
    tensor = torch.tensor([value, *maxed], dtype=torch.float64, device=collective_device())
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor)
    rows = torch.stack(out).cpu()
    return float(rows[:, 0].sum()), [float(v) for v in rows[:, 1:].max(dim=0).values.tolist()]


def all_gather_ints(values: list[int]) -> list[list[int]]:
    """Every rank's list of ints (all of the same length), in rank order."""
    if not _active():
        return [values]
    tensor = torch.tensor(values, dtype=torch.int64, device=collective_device())
    out = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor)
    return [t.tolist() for t in out]


def all_gather_objects(value: Any) -> list[Any]:
    """Every rank's picklable `value`, in rank order. (torch serialises objects through tensors on the current
    CUDA device for nccl itself; the loop sets that device from the local rank before any collective.)"""
    if not _active():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def broadcast_object(value: Any, src: int = 0) -> Any:
    """Rank `src`'s picklable `value` on every rank (`value` on the others is ignored); one copy travels, not W."""
    if not _active():
        return value
    box = [value if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]
