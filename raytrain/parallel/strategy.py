"""Choosing the layout at every (re)start: the strategy for `strategy="auto"` and, for zero2/zero3 with
accumulation, how gradients accumulate for `grad_accumulation="auto"`. Both follow the accounting of what raytrain's
loop really holds (`raytrain.memory_plan.loop_memory`) against the workers' memory, identically on every rank, and
say why in one line.

`auto` tries ddp, zero2, zero3 in that order (least communication first) and takes the first whose peak fits 80 %
of the smallest worker's memory (the rest is left for activations). zero1 is never chosen: zero2 holds less in
raytrain's implementation (FSDP2 keeps only shards between steps). Nothing fitting is an error: the model does not
fit with the strategies raytrain implements.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from raytrain.collectives import all_reduce_min
from raytrain.console import counted
from raytrain.errors import ConfigError
from raytrain.memory_plan import GB, loop_memory
from raytrain.parallel.apply import UnitsFn, fsdp_units

RESERVE_FRACTION = 0.2  # of a worker's memory kept for activations and temporaries


@dataclass(frozen=True)
class Layout:
    """The resolved layout of one start: the strategy, how gradients accumulate, and why (for the log)."""

    strategy: str
    grad_accumulation: str  # "unsharded" or "sharded"
    reason: str


def device_memory_bytes(device: torch.device, local_workers: int = 1) -> int:
    """Memory one worker may use: the GPU's total memory, or on CPU the host's RAM divided by the local workers."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total // max(1, local_workers))


def unit_params(model: nn.Module, units: list[nn.Module]) -> list[int]:
    """Parameters each FSDP unit gathers at once: a unit's own, without those of units nested in it; the root
    (last) holds what no unit claims."""
    claimed: set[int] = set()
    sizes = []
    for unit in sorted(units, key=lambda u: sum(1 for _ in u.modules())):  # innermost first
        own = [p for p in unit.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in own)
        sizes.append(sum(p.numel() for p in own))
    sizes.append(sum(p.numel() for p in model.parameters() if id(p) not in claimed))
    return sizes


def _optimizer_bytes(optimizer_kind: str) -> int:
    return {"adam": 8, "adamw": 8, "sgd_momentum": 4, "sgd": 0}.get(optimizer_kind, 8)


def choose_layout(
    strategy: str,
    grad_accumulation: str,
    *,
    num_params: int,
    largest_unit: int,
    world_size: int,
    root_unit: int | None = None,
    accumulation_steps: int,
    precision: str,
    memory_bytes: int,
    optimizer_kind: str = "adam",
) -> Layout:
    """Pure: resolve "auto" strategy and "auto" gradient accumulation for a model of `num_params` parameters
    (largest FSDP unit `largest_unit`) on workers with `memory_bytes` each. Raises `ConfigError` when `auto`
    finds nothing that fits."""
    budget = int(memory_bytes * (1 - RESERVE_FRACTION))
    o = _optimizer_bytes(optimizer_kind)

    def peak(name: str, accumulate: str) -> int:
        return loop_memory(
            num_params,
            name,
            world_size,
            largest_unit_params=largest_unit,
            root_unit_params=root_unit,
            optimizer_bytes_per_param=o,
            accumulation_steps=accumulation_steps,
            grad_accumulation=accumulate,
            precision=precision,
        ).total

    reasons = []
    if strategy == "auto":
        for name in ("ddp", "zero2", "zero3"):
            need = peak(name, "sharded")
            if need <= budget:
                reasons.append(f"strategy auto -> {name}: peak {need / GB:.3g} GB per worker fits {budget / GB:.3g} GB")
                strategy = name
                break
        else:
            raise ConfigError(
                f"strategy 'auto': the model ({num_params:,} parameters) does not fit on "
                f"{counted(world_size, 'worker')} of {memory_bytes / GB:.3g} GB with ddp, zero2 or zero3 "
                f"(zero3 peak {peak('zero3', 'sharded') / GB:.3g} GB > budget {budget / GB:.3g} GB); "
                "add workers or use tensor/pipeline parallelism"
            )
    sharded_fsdp = world_size > 1 and strategy in ("zero2", "zero3")
    if grad_accumulation == "auto":
        if not sharded_fsdp or accumulation_steps == 1:
            grad_accumulation = "unsharded"  # nothing to decide: one sync per step either way
        else:
            need = peak(strategy, "unsharded")
            grad_accumulation = "unsharded" if need <= budget else "sharded"
            reasons.append(
                f"grad_accumulation auto -> {grad_accumulation}: the whole gradient held while accumulating gives a "
                f"peak of {need / GB:.3g} GB, {'within' if need <= budget else 'over'} {budget / GB:.3g} GB"
            )
    return Layout(strategy, grad_accumulation, "; ".join(reasons))


def resolve_layout(
    strategy: str,
    grad_accumulation: str,
    model: nn.Module,
    *,
    world_size: int,
    accumulation_steps: int,
    precision: str,
    device: torch.device,
    local_workers: int = 1,
    units_fn: UnitsFn | None = None,
    stages: int = 1,
    chunks: int = 1,
    conditional: Sequence[str] = (),
) -> Layout:
    """`choose_layout` for `model` (meta or real, whole) on this worker group; a collective when anything is
    "auto" (the smallest worker's memory decides, so every rank resolves the same layout). `world_size` is the dp
    degree. With `stages` > 1 pipeline stages the heaviest stage's parameters are counted (`stage_bounds`); a
    tensor-parallel split is not subtracted (layers outside the plan stay whole), and the largest and root FSDP
    units are counted whole: upper bounds, so `auto` never picks a strategy that holds more than it counted."""
    if strategy != "auto" and grad_accumulation != "auto":
        return Layout(strategy, grad_accumulation, "")
    memory = all_reduce_min(device_memory_bytes(device, local_workers))
    units, _ = fsdp_units(model, units_fn, conditional)
    sizes = unit_params(model, units)
    num_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if stages > 1:  # the heaviest stage as the ranks cut it (frozen parameters included: an upper bound)
        from raytrain.parallel.pipeline import cut_stages

        num_params = max(cut_stages(model, stages * chunks).rank_sizes(stages))
    return choose_layout(
        strategy,
        grad_accumulation,
        num_params=num_params,
        largest_unit=max(sizes),
        root_unit=sizes[-1],
        world_size=world_size,
        accumulation_steps=accumulation_steps,
        precision=precision,
        memory_bytes=memory,
    )
