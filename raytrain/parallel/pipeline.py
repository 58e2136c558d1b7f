"""Pipeline parallel across nodes: the model cut into `pp` stages, raytrain's micro-batches flowing through them.

Stages. A model built as `nn.Sequential` (nested `nn.Sequential`s of repeated blocks are expanded: a transformer
trunk's blocks can land on different stages) is cut into `pp` contiguous runs of units with balanced parameter
counts (`stage_bounds`, pure). Each rank keeps its stage's units and replaces every other unit by `nn.Identity`, in
place: module names, and with them the initial weights (seeded by module name) and the checkpoint's keys, are the
model's own, so a pipeline run starts from the weights of a single-process run and its checkpoints load at any dp.

Schedule. GPipe over raytrain's own accumulation micro-batches (the batch plan's exact, possibly uneven sizes:
torch's `PipelineStage` infers one activation shape for every micro-batch, so raytrain runs the schedule itself,
with point-to-point sends that carry their shape). All forwards, first stage to last, then all backwards, last to
first. The first stage feeds the model the tensors `loss_fn` passes to it (`model_inputs`); the last stage calls
`loss_fn(model, batch)` with a stand-in model that returns the pipeline's output, so the loss contract is the one of
every other layout: `loss_fn` must call the model once, on tensors from the batch. Every rank of a replica reads
the same micro-batches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from raytrain.errors import ConfigError

Batch = dict[str, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]
HEADER = 10  # ndim, dtype code, up to 8 sizes
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool]


def pipeline_units(model: nn.Module) -> list[tuple[nn.Sequential, int, str]]:
    """The units a pipeline is cut between, in forward order: (the `nn.Sequential` holding it, its index there, its
    module name). A child that is itself an `nn.Sequential` is expanded. Raises `ConfigError` for a model that is
    not an `nn.Sequential`."""
    if not isinstance(model, nn.Sequential):
        raise ConfigError(
            f"pipeline parallel (pp > 1) cuts nn.Sequential models into stages, got {type(model).__name__}: build "
            "the model as nn.Sequential(embedding, *blocks, head) (nested Sequentials of blocks are expanded)"
        )
    units: list[tuple[nn.Sequential, int, str]] = []

    def visit(container: nn.Sequential, prefix: str) -> None:
        for index, (name, child) in enumerate(container.named_children()):
            if isinstance(child, nn.Sequential):
                visit(child, f"{prefix}{name}.")
            else:
                units.append((container, index, f"{prefix}{name}"))

    visit(model, "")
    return units


def stage_bounds(param_counts: list[int], stages: int) -> list[tuple[int, int]]:
    """Pure: cut units with `param_counts` into `stages` contiguous, non-empty runs [start, end) whose parameter
    counts are balanced (a cut is placed where the running total first reaches s / stages of the total); units
    without parameters stay with the unit before them. Raises `ConfigError` when there are fewer units with
    parameters than stages."""
    owners = [i for i, count in enumerate(param_counts) if count > 0]
    if len(owners) < stages:
        raise ConfigError(
            f"pp = {stages} needs at least {stages} pipeline units with parameters, the model has {len(owners)}"
        )
    total = sum(param_counts)
    starts = [0]
    running = 0
    for position, unit in enumerate(owners):
        left_owners, left_stages = len(owners) - position, stages - len(starts)
        must_cut = left_owners == left_stages and left_stages > 0
        if position > 0 and left_stages > 0 and (must_cut or running >= total * len(starts) / stages):
            starts.append(unit)
        running += param_counts[unit]
    return [(start, end) for start, end in zip(starts, [*starts[1:], len(param_counts)], strict=True)]


@dataclass(frozen=True)
class StageCut:
    """How `stage_bounds` cuts a model: its pipeline units (`pipeline_units`), each unit's parameter count, and each
    stage's [start, end) over the units."""

    units: list[tuple[nn.Sequential, int, str]]
    counts: list[int]
    bounds: list[tuple[int, int]]

    @property
    def sizes(self) -> list[int]:
        """Parameters per stage."""
        return [sum(self.counts[a:b]) for a, b in self.bounds]


def cut_stages(model: nn.Module, stages: int) -> StageCut:
    """The cut of `model` into `stages` pipeline stages that every rank applies (`keep_stage`)."""
    units = pipeline_units(model)
    counts = [sum(p.numel() for p in container[index].parameters()) for container, index, _ in units]
    return StageCut(units, counts, stage_bounds(counts, stages))


@dataclass(frozen=True)
class StageTie:
    """A parameter tied across pipeline stages (GPT-2's embedding and head): one name of it on each stage that
    holds it, by stage. Every such stage keeps a copy; the copies start equal (one recorded tensor, or one seeded
    build), their gradients are summed over those stages after every backward (`tied_gradients`) and they are
    counted once in the gradient norm, so they stay equal: one parameter, as in a single process."""

    names: dict[int, str]


def stage_ties(model: nn.Module, stages: int) -> list[StageTie]:
    """The tied parameters of the whole `model` whose names fall into different pipeline stages (in
    `tie_groups` order, the same on every rank)."""
    from raytrain.model_init import tie_groups

    cut = cut_stages(model, stages)

    def stage_of(name: str) -> int | None:
        for stage, (start, end) in enumerate(cut.bounds):
            if any(name.startswith(unit + ".") for _, _, unit in cut.units[start:end]):
                return stage
        return None  # a parameter of the root itself: on every stage

    ties = []
    for group in tie_groups(model):
        names: dict[int, str] = {}
        for name in group:
            stage = stage_of(name)
            if stage is None:
                break
            names.setdefault(stage, name)
        else:
            if len(names) > 1:
                ties.append(StageTie(dict(sorted(names.items()))))
    return ties


def keep_stage(model: nn.Module, stage: int, stages: int) -> str:
    """Replace every pipeline unit outside stage `stage` of `stages` by `nn.Identity` (in place, on the meta or
    real model); returns one line for the log naming the stage's units."""
    cut = cut_stages(model, stages)
    start, end = cut.bounds[stage]
    for position, (container, index, _) in enumerate(cut.units):
        if not start <= position < end:
            container[index] = nn.Identity()
    names = [name for _, _, name in cut.units[start:end]]
    return (
        f"pipeline stage {stage} of {stages}: units {names[0]}..{names[-1]} ({cut.sizes[stage]:,} parameters;"
        f" stages {', '.join(f'{n:,}' for n in cut.sizes)})"
    )


def stage_models(build: Callable[[], nn.Module], stages: int) -> list[nn.Module]:
    """Every stage as a worker holds it: `build()` (e.g. on the meta device) with `keep_stage` applied, per stage
    (for the driver's checks)."""
    models = []
    for stage in range(stages):
        model = build()
        keep_stage(model, stage, stages)
        models.append(model)
    return models


def check_losses(losses: torch.Tensor, batch: Batch) -> None:
    """`loss_fn`'s result must be one loss per sample of `batch`: a 1-D tensor of its row count (`ValueError`
    naming both shapes otherwise)."""
    rows = len(next(iter(batch.values())))
    if losses.dim() != 1 or losses.shape[0] != rows:
        raise ValueError(f"loss_fn must return one loss per sample (shape [{rows}]), got shape {tuple(losses.shape)}")


def widen(losses: torch.Tensor) -> torch.Tensor:
    """Per-sample losses in at least float32 for summing (bf16/fp16 are widened; float64 stays float64, so a
    float64 model's loss scale is not rounded to float32)."""
    return losses.float() if losses.dtype in (torch.float16, torch.bfloat16) else losses


class _Captured(Exception):
    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("model inputs captured")
        self.args, self.kwargs = args, kwargs


class _Recorder(nn.Module):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(args, kwargs)


class _Output(nn.Module):
    """Stands in for the model on the last stage: returns the pipeline's output for the micro-batch."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.output


def model_inputs(loss_fn: LossFn, batch: Batch) -> torch.Tensor:
    """The tensor `loss_fn` passes to the model for `batch` (its call is interrupted there). Raises `ConfigError`
    unless it calls the model with exactly one tensor."""
    try:
        loss_fn(_Recorder(), batch)
    except _Captured as captured:
        if len(captured.args) == 1 and not captured.kwargs and isinstance(captured.args[0], torch.Tensor):
            return captured.args[0]
        raise ConfigError(
            "with pp > 1, loss_fn must call the model with one tensor (the first stage's input), got "
            f"{len(captured.args)} positional and {len(captured.kwargs)} keyword argument(s)"
        ) from None
    raise ConfigError("with pp > 1, loss_fn must call the model (the pipeline feeds it the tensor it passes)")


@dataclass(frozen=True)
class Neighbours:
    """A stage's place in its replica's pipeline: the global ranks before and after it (None at the ends)."""

    previous: int | None
    next: int | None


def _send(tensor: torch.Tensor, dst: int) -> None:
    import torch.distributed as dist

    if tensor.dim() > HEADER - 2 or tensor.dtype not in DTYPES:
        raise ValueError(
            f"a pipeline stage's output must have at most {HEADER - 2} dimensions and one of the dtypes {DTYPES}, "
            f"got shape {tuple(tensor.shape)} and {tensor.dtype}"
        )
    header = torch.zeros(HEADER, dtype=torch.int64)
    header[0], header[1] = tensor.dim(), DTYPES.index(tensor.dtype)
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    device = tensor.device
    dist.send(header.to(device), dst)
    dist.send(tensor.contiguous(), dst)


def _recv(src: int, device: torch.device) -> torch.Tensor:
    import torch.distributed as dist

    header = torch.zeros(HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src)
    ndim, code = int(header[0]), int(header[1])
    tensor = torch.empty(tuple(int(s) for s in header[2 : 2 + ndim]), dtype=DTYPES[code], device=device)
    dist.recv(tensor, src)
    return tensor


def gpipe_step(
    stage: nn.Module,
    micro_batches: list[Batch],
    loss_fn: LossFn,
    scale: float,
    neighbours: Neighbours,
    device: torch.device,
    sync: Callable[[bool], contextlib.AbstractContextManager[None]] | None = None,
    backward: bool = True,
    autocast_dtype: torch.dtype | None = None,
    seeds: Callable[[int], None] | None = None,
) -> float:
    """Run this stage's part of one optimizer step's micro-batches through the pipeline (collective over the
    replica's stages: each must call it with the same micro-batch count). The last stage computes
    `loss_fn(model, batch)`, sums it and backpropagates sum x `scale`; every stage accumulates its gradients. Returns
    the summed per-sample loss on the last stage, 0.0 elsewhere. `sync(last)` is entered around each backward
    (`last`: the step's final backward, where gradients synchronise). `backward=False`: forward only (evaluation).
    `autocast_dtype`: forwards (and the loss) under `torch.autocast` in that dtype (bf16 without FSDP).
    `seeds(j)`: called before micro-batch j's forward (`raytrain.rng.MicroBatchSeeds`)."""
    first, last = neighbours.previous is None, neighbours.next is None
    stored: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    local_sum = 0.0
    for j, batch in enumerate(micro_batches):
        if seeds is not None:
            seeds(j)
        if first:
            inputs = model_inputs(loss_fn, batch)
        else:
            assert neighbours.previous is not None
            inputs = _recv(neighbours.previous, device)
            if backward and inputs.is_floating_point():
                inputs.requires_grad_(True)
        autocast = (
            torch.autocast(device_type=device.type, dtype=autocast_dtype)
            if autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            output = stage(inputs)
            losses = loss_fn(_Output(output), batch) if last else output
        if last:
            check_losses(losses, batch)
            local_sum += float(losses.detach().float().sum())
            stored.append((None if first else inputs, widen(losses).sum() * scale))
        else:
            assert neighbours.next is not None
            _send(output.detach(), neighbours.next)
            stored.append((None if first else inputs, output))
    if not backward:
        return local_sum
    for j in reversed(range(len(stored))):
        received, result = stored[j]
        with sync(j == 0) if sync is not None else contextlib.nullcontext():
            if last:
                result.backward()
            else:
                assert neighbours.next is not None
                result.backward(_recv(neighbours.next, device))
        if received is not None and neighbours.previous is not None:
            grad = received.grad if received.grad is not None else torch.zeros_like(received)
            _send(grad, neighbours.previous)
    return local_sum
