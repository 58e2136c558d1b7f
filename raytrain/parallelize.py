"""Parallelism, applied in one place after the model is built; model code stays untouched.

Strategy mapping (ZeRO stage -> PyTorch mechanism):
    ddp    DistributedDataParallel: everything replicated, gradients all-reduced once per optimizer step.
    zero1  DDP + torch's ZeroRedundancyOptimizer: optimizer state sharded over ranks, parameters and gradients
           replicated; after each step every rank broadcasts its updated parameter shard.
    zero2  FSDP2 `fully_shard(reshard_after_forward=False)`: parameters stay gathered between forward and
           backward; gradients are reduce-scattered, so gradients and optimizer state are sharded.
    zero3  FSDP2 `fully_shard(reshard_after_forward=True)`: parameters are sharded too and gathered per module.
           (zero2 in FSDP2 also keeps only the parameter shard at rest between steps; the saving over zero3 is
           communication, not memory at rest. `raytrain plan` reports the ZeRO paper's accounting.)

FSDP2 wraps every direct child module that owns parameters, then the root. At world size 1 nothing is wrapped:
there is nobody to synchronise with.

Loss normalisation contract (see `raytrain.batch_plan`): both DDP and FSDP2 average gradients over W; the loop
multiplies the summed per-sample loss by W / B so that the average becomes the sum over the global batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from raytrain.errors import ConfigError


def apply_parallelism(model: nn.Module, strategy: str, device: torch.device, world_size: int) -> nn.Module:
    """Move `model` to `device` and wrap it for `strategy`; call once, after building, in every worker.

    Requires an initialised default process group when `world_size` > 1. Returns the module to train.
    """
    model = model.to(device)
    if world_size == 1:
        return model
    if strategy in ("ddp", "zero1"):
        device_ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    if strategy in ("zero2", "zero3"):
        from torch.distributed.fsdp import fully_shard

        reshard = strategy == "zero3"
        for child in model.children():
            if any(True for _ in child.parameters()):
                fully_shard(child, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        return model
    raise ConfigError(f"strategy must be one of ddp, zero1, zero2, zero3 here, got {strategy!r}")


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Context for one micro-step's forward and backward: with `enabled=False`, gradients are only
    accumulated locally (DDP `no_sync`, FSDP2 `set_requires_gradient_sync(False)`); the last micro-step of an
    optimizer step runs with `enabled=True` and synchronises the accumulated sum once."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        with contextlib.nullcontext() if enabled else model.no_sync():
            yield
        return
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    if set_sync is not None:
        set_sync(enabled)
    yield


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper (FSDP2 modifies the module in place, so it is returned as is)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
