"""Pipeline parallel across nodes: the model cut into `pp` stages, raytrain's micro-batches flowing through them.

Stages. A model is cut between *units* (`pipeline_units`), in forward order:
- an `nn.Sequential` (nested `nn.Sequential`s of repeated blocks are expanded): each child is a unit;
- any other model by its *split* (`split_of`; torchtitan's per-family split hook): its list of repeated blocks,
  the modules the forward runs before them (embeddings: first stage) and after them (final norm and head: last
  stage). The split comes from the model's own `pipeline_split()` method, a transformers model's
  `base_model_pp_plan` (Llama, Mistral, Qwen, ...), or a family raytrain knows by name (GPT-2). Each block is a
  unit, the modules before and after joined to the first and last block's.
`cut_stages` takes `pp` contiguous runs of units with balanced parameter counts (`stage_bounds`, pure), or the
cut the split gives. Each rank keeps its stage (`keep_stage`, in place): the other units are dropped under their
own names, so module names, and with them the initial weights (seeded by module name) and the checkpoint's keys,
are the model's own; a pipeline run starts from the weights of a single-process run and its checkpoints load at any
dp.

Boundaries. Every stage runs the user's `loss_fn(model, batch)` on the same micro-batch with the model's own
forward (`run_stage`): a forward hook on the stage's last block carries its output out (stages before the last),
a pre-hook on its first block replaces that block's input by the activation received from the previous stage
(stages after the first; the dropped embeddings stand in with that activation's shape). So the forward computes
its masks and positions from the batch on every stage, and `loss_fn` keeps the contract of every other layout:
call the model once, return one loss per sample.

Schedules (`schedule_order`, pure) over raytrain's own accumulation micro-batches (the batch plan's exact, possibly
uneven sizes: torch's `PipelineStage` infers one activation shape for every micro-batch, so raytrain runs the
schedule itself, with point-to-point sends that carry their shape): GPipe (all forwards, then all backwards),
1F1B (a forward and a backward in turn once the pipeline is full) and interleaved 1F1B (each rank holds
`chunks` non-adjacent chunks of the model, virtual stages dealt round-robin, the last rank sending back to the
first; a chunk's forward runs only its own blocks: `KeptBlocks`). Each stage receives in the order its neighbour
sent (`sent_messages`), so two messages sharing one link never cross.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from raytrain.errors import ConfigError

Batch = dict[str, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]
HEADER = 10  # ndim, dtype code, up to 8 sizes
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool]


@dataclass(frozen=True)
class Unit:
    """A piece the pipeline is cut between: the modules it holds (`paths` in the model, in forward order) and its
    `anchor`, the module at a stage boundary: a stage starting with this unit feeds the anchor the previous stage's
    output instead of its own input, a stage ending with it sends the anchor's output on."""

    paths: tuple[str, ...]
    anchor: str


@dataclass(frozen=True)
class PipelineSplit:
    """How a model that is not an `nn.Sequential` is cut: `blocks` names its list of repeated blocks (an
    `nn.ModuleList` or `nn.Sequential` of modules each called once per forward, in order), `first` the modules the
    forward runs before the blocks (kept on the first stage: embeddings), `last` those after them (kept on the last
    stage: the final norm and head). Modules without parameters (dropout, a rotary embedding) stay on every stage.
    `starts`: a user-given cut, the index of the block each stage after the first starts with (empty: balanced by
    parameters). `source` names where the split came from, for the log and errors."""

    blocks: str
    first: tuple[str, ...]
    last: tuple[str, ...]
    starts: tuple[int, ...] = ()
    source: str = ""


# Model families whose split raytrain knows by name (Hugging Face models that declare `base_model_pp_plan` are
# split from that plan, `hf_split`): (family, blocks, first, last).
KNOWN_SPLITS = (("GPT-2", "transformer.h", ("transformer.wte", "transformer.wpe"), ("transformer.ln_f", "lm_head")),)


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def hf_split(model: nn.Module) -> PipelineSplit | None:
    """The split of a transformers model from its config's `base_model_pp_plan` (the base model's modules in
    forward order: those before the module list of layers go first, those after it last) and the head model's
    `_pp_plan` (e.g. `lm_head`, last); None when the model declares no such plan."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_pp_plan", None)
    base = getattr(model, "base_model", None)
    if not plan or not isinstance(base, nn.Module):
        return None
    prefix = "" if base is model else f"{model.base_model_prefix}."
    names = [name for name in plan if _has(base, name)]
    lists = [name for name in names if isinstance(base.get_submodule(name), nn.ModuleList | nn.Sequential)]
    if len(lists) != 1:
        return None
    at = names.index(lists[0])
    head = [  # the head model's own entries (transformers lists the base model's there too, under the prefix)
        name
        for name in (getattr(model, "_pp_plan", None) or {})
        if base is not model and not name.startswith(prefix) and _has(model, name)
    ]
    return PipelineSplit(
        blocks=prefix + lists[0],
        first=tuple(prefix + name for name in names[:at]),
        last=tuple(prefix + name for name in names[at + 1 :]) + tuple(head),
        source=f"{type(model).__name__}'s base_model_pp_plan",
    )


def split_of(model: nn.Module) -> PipelineSplit | None:
    """How a model that is not an `nn.Sequential` is cut into stages, or None when raytrain does not know: the
    model's own `pipeline_split()` method (returning {"blocks": path, "first": [paths], "last": [paths]} and
    optionally "starts": [the block index each stage after the first starts with; pp x pp_chunks - 1 of them under
    the interleaved schedule]), a transformers model's `base_model_pp_plan`,
    or a known family by its module names (`KNOWN_SPLITS`)."""
    hook = getattr(model, "pipeline_split", None)
    if callable(hook):
        spec = hook()
        where = f"{type(model).__name__}.pipeline_split()"
        if not isinstance(spec, dict) or not isinstance(spec.get("blocks"), str):
            raise ConfigError(f"{where} must return a dict with 'blocks' (a module path), got {spec!r}")
        unknown = set(spec) - {"blocks", "first", "last", "starts"}
        if unknown:
            raise ConfigError(f"{where} returned unknown keys {sorted(unknown)}: valid are blocks, first, last, starts")
        return PipelineSplit(
            spec["blocks"],
            tuple(spec.get("first", ())),
            tuple(spec.get("last", ())),
            tuple(spec.get("starts", ())),
            where,
        )
    split = hf_split(model)
    if split is not None:
        return split
    for family, blocks, first, last in KNOWN_SPLITS:
        if all(_has(model, path) for path in (blocks, *first, *last)):
            return PipelineSplit(blocks, first, last, source=f"the {family} split")
    return None


def _split_units(model: nn.Module, split: PipelineSplit) -> list[Unit]:
    """The units of a split model: one per block, the `first` modules joined to the first block's unit and the
    `last` ones to the last block's (a stage boundary always lies between two blocks). Raises `ConfigError` naming
    a missing module, blocks that are not called, or a parameter the split leaves on no stage."""
    where = split.source or "the pipeline split"
    for path in (split.blocks, *split.first, *split.last):
        if not _has(model, path):
            raise ConfigError(f"{where} names {path!r}, which {type(model).__name__} does not have")
    container = model.get_submodule(split.blocks)
    if not isinstance(container, nn.ModuleList | nn.Sequential) or len(container) < 2:
        raise ConfigError(
            f"{where}: blocks {split.blocks!r} must be an nn.ModuleList or nn.Sequential of at least 2 blocks, got "
            f"{type(container).__name__} of {len(list(container.children()))}"
        )
    from raytrain.parallel.apply import has_forward

    names = [f"{split.blocks}.{name}" for name, _ in container.named_children()]
    uncalled = [
        (name, child) for name, child in zip(names, container.children(), strict=True) if not has_forward(child)
    ]
    if uncalled:
        name, child = uncalled[0]
        raise ConfigError(
            f"{where}: the blocks must be modules the forward calls (a stage's boundary is a block's input and "
            f"output), {name} is a {type(child).__name__}, whose entries the forward uses one by one"
        )
    units = [Unit((name,), name) for name in names]
    units[0] = Unit((*split.first, names[0]), names[0])
    units[-1] = Unit((*units[-1].paths, *split.last), names[-1])
    covered = [path for unit in units for path in unit.paths]
    for name, _ in model.named_parameters():
        if not any(name.startswith(path + ".") for path in covered):
            raise ConfigError(
                f"{where}: parameter {name!r} lies in none of blocks {split.blocks!r}, first {list(split.first)} or "
                f"last {list(split.last)}: add its module to first (used before the blocks) or last (after them)"
            )
    return units


def _required_split(model: nn.Module) -> PipelineSplit:
    """`split_of(model)`, or `ConfigError` naming what to add when raytrain cannot split `model`."""
    split = split_of(model)
    if split is None:
        raise ConfigError(
            f"pipeline parallel (pp > 1) cannot split {type(model).__name__}: it is not an nn.Sequential, has no "
            "pipeline_split() method and is not a known family (a transformers model with base_model_pp_plan, "
            f"{', '.join(f[0] for f in KNOWN_SPLITS)}): define {type(model).__name__}.pipeline_split() returning "
            "{'blocks': 'path.of.the.block.list', 'first': [modules before the blocks], 'last': [modules after]}"
        )
    return split


def pipeline_units(model: nn.Module) -> list[Unit]:
    """The units a pipeline is cut between, in forward order. An `nn.Sequential` model: each child, a child that is
    itself an `nn.Sequential` expanded. Any other model: its blocks with the modules before and after them
    (`split_of`). Raises `ConfigError` naming what is missing for a model raytrain cannot split."""
    if not isinstance(model, nn.Sequential):
        return _split_units(model, _required_split(model))
    units: list[Unit] = []

    def visit(container: nn.Sequential, prefix: str) -> None:
        for name, child in container.named_children():
            if isinstance(child, nn.Sequential):
                visit(child, f"{prefix}{name}.")
            else:
                units.append(Unit((f"{prefix}{name}",), f"{prefix}{name}"))

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
            f"{stages} pipeline stages (pp x pp_chunks) need at least {stages} pipeline units with parameters, the "
            f"model has {len(owners)}"
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


def given_bounds(starts: tuple[int, ...], units: int, stages: int, where: str) -> list[tuple[int, int]]:
    """Pure: the stages of a user-given cut (`PipelineSplit.starts`: the unit each stage after the first starts
    with), checked: `stages` - 1 increasing starts in 1 .. `units` - 1 (`ConfigError` naming the value otherwise)."""
    ok = len(starts) == stages - 1 and all(isinstance(s, int) and 0 < s < units for s in starts)
    if not ok or any(a >= b for a, b in itertools.pairwise(starts)):
        raise ConfigError(
            f"{where}: starts must be {stages - 1} increasing block indices in 1..{units - 1} (where stages 1..."
            f"{stages - 1} begin), got {list(starts)}"
        )
    bounds = [0, *starts, units]
    return list(itertools.pairwise(bounds))


def _unit_parameters(model: nn.Module, unit: Unit) -> int:
    seen: dict[int, int] = {}
    for path in unit.paths:
        for p in model.get_submodule(path).parameters():
            seen[id(p)] = p.numel()
    return sum(seen.values())


@dataclass(frozen=True)
class StageCut:
    """How a model is cut: its pipeline units (`pipeline_units`), each unit's parameter count, each stage's
    [start, end) over the units, and how the cut was chosen (for the log)."""

    units: list[Unit]
    counts: list[int]
    bounds: list[tuple[int, int]]
    how: str = "balanced by parameters"

    @property
    def sizes(self) -> list[int]:
        """Parameters per (virtual) stage."""
        return [sum(self.counts[a:b]) for a, b in self.bounds]

    def rank_sizes(self, stages: int) -> list[int]:
        """Parameters per pipeline rank when the cut's virtual stages are dealt round-robin to `stages` ranks (the
        interleaved schedule; with one chunk per rank, `sizes`)."""
        return [sum(self.sizes[v] for v in range(s, len(self.bounds), stages)) for s in range(stages)]

    def stage_of(self, name: str) -> int | None:
        """The stage holding parameter or module `name` (None: on every stage, a module without parameters)."""
        for stage, (start, end) in enumerate(self.bounds):
            for unit in self.units[start:end]:
                if any(name == path or name.startswith(path + ".") for path in unit.paths):
                    return stage
        return None


def cut_stages(model: nn.Module, stages: int) -> StageCut:
    """The cut of `model` into `stages` pipeline stages that every rank applies (`keep_stage`): a user-given cut
    (`PipelineSplit.starts`) or stages of balanced parameter counts."""
    split = None if isinstance(model, nn.Sequential) else _required_split(model)  # asked once: it may call user code
    units = pipeline_units(model) if split is None else _split_units(model, split)
    counts = [_unit_parameters(model, unit) for unit in units]
    if split is not None and split.starts:
        return StageCut(units, counts, given_bounds(split.starts, len(units), stages, split.source), "given")
    return StageCut(units, counts, stage_bounds(counts, stages))


@dataclass(frozen=True)
class StageTie:
    """A parameter tied across pipeline stages (GPT-2's embedding and head): one name of it on each stage that
    holds it, by stage. Every such stage keeps a copy; the copies start equal (one recorded tensor, or one seeded
    build), their gradients are summed over those stages after every backward (`tied_gradients`) and they are
    counted once in the gradient norm, so they stay equal: one parameter, as in a single process."""

    names: dict[int, str]


def stage_ties(model: nn.Module, stages: int, chunks: int = 1) -> list[StageTie]:
    """The tied parameters of the whole `model` whose names fall into different pipeline stages (in
    `tie_groups` order, the same on every rank); `chunks` model chunks per stage as `keep_stage` cuts them."""
    from raytrain.model_tensors import tie_groups

    cut = cut_stages(model, stages * chunks)
    ties = []
    for group in tie_groups(model):
        names: dict[int, str] = {}
        for name in group:
            virtual = cut.stage_of(name)
            if virtual is None:  # a parameter of the root itself: on every stage
                break
            names.setdefault(virtual % stages, name)
        else:
            if len(names) > 1:
                ties.append(StageTie(dict(sorted(names.items()))))
    return ties


class StageEnds:
    """Where a stage model's parts of the forward begin and end, per chunk (module paths; None at the pipeline's
    ends: `entries[c]` / `exits[c]` for this rank's chunk c, virtual stage `stage + c * stages`), the chunk whose
    forward is running (`active`, set by `run_stage`; None: all) and the activation received for the micro-batch in
    flight."""

    def __init__(self, stage: int, stages: int, entries: list[str | None], exits: list[str | None]) -> None:
        self.stage, self.stages, self.entries, self.exits = stage, stages, entries, exits
        self.active: int | None = None
        self.received: torch.Tensor | None = None

    @property
    def chunks(self) -> int:
        """Model chunks this rank holds (1 but for the interleaved schedule)."""
        return len(self.entries)

    def virtual(self, chunk: int) -> int:
        """The virtual stage of this rank's chunk `chunk` (its place in the chain of all `stages * chunks`)."""
        return self.stage + chunk * self.stages


_ENDS: weakref.WeakKeyDictionary[nn.Module, StageEnds] = weakref.WeakKeyDictionary()


class _FromPreviousStage(nn.Module):
    """Stands in for a module that runs before the blocks (an embedding) on a later stage: returns the activation
    received from the previous stage (detached; the stage's first block is fed the received tensor itself), so the
    forward's shapes and dtypes hold up to the boundary."""

    def __init__(self, ends: StageEnds, path: str) -> None:
        super().__init__()
        self.ends, self.path = ends, path

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.ends.received is None:
            raise RuntimeError(
                f"{self.path} is on pipeline stage 0, not this one ({self.ends.stage}): run the stage model through "
                "raytrain's pipeline step"
            )
        return self.ends.received.detach()


class _OnLaterStage(nn.Module):
    """Stands in for a module that runs after the blocks (final norm, head) on an earlier stage: the forward stops
    at the stage's last block, so it is never called."""

    def __init__(self, path: str, stage: int) -> None:
        super().__init__()
        self.path, self.stage = path, stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.path} is on the last pipeline stage, not this one ({self.stage})")


def keep_stage(model: nn.Module, stage: int, stages: int, chunks: int = 1) -> str:
    """Keep only stage `stage` of `stages` of `model` (in place, on the meta or real model): the other stages'
    units are dropped under their own names (a block of an `nn.Sequential` becomes `nn.Identity`, one of an
    `nn.ModuleList` is removed from it, an embedding or head is replaced by a stand-in without parameters), so the
    parameters left keep the names they have in the whole model. With `chunks` > 1 (the interleaved schedule) the
    model is cut into `stages * chunks` virtual stages and the rank keeps `stage`, `stage + stages`, ...; a
    forward runs one chunk's blocks at a time (`run_stage`). Records where each chunk's forward begins and ends
    (`stage_ends`). Returns one line for the log naming the stage's units."""
    virtual = stages * chunks
    cut = cut_stages(model, virtual)
    mine = [stage + c * stages for c in range(chunks)]
    ends = StageEnds(
        stage,
        stages,
        [cut.units[cut.bounds[v][0]].anchor if v > 0 else None for v in mine],
        [cut.units[cut.bounds[v][1] - 1].anchor if v < virtual - 1 else None for v in mine],
    )
    chunk_of = {position: c for c, v in enumerate(mine) for position in range(*cut.bounds[v])}
    first_kept = cut.bounds[mine[0]][0]
    for position, unit in enumerate(cut.units):
        for path in unit.paths:
            parent_path, _, attr = path.rpartition(".")
            parent = model.get_submodule(parent_path)
            blocks = isinstance(parent, nn.Sequential | nn.ModuleList)
            if position in chunk_of:
                if chunks > 1 and blocks:
                    _mark_chunk(parent, attr, chunk_of[position], ends)
                continue
            if isinstance(parent, nn.Sequential):
                parent._modules[attr] = nn.Identity()
            elif isinstance(parent, nn.ModuleList):
                del parent._modules[attr]
                _mark_chunk(parent, None, 0, ends)
            elif path == unit.anchor:
                raise ConfigError(f"pipeline block {path} must sit in an nn.ModuleList or nn.Sequential")
            elif position < first_kept:
                setattr(parent, attr, _FromPreviousStage(ends, path))
            else:
                setattr(parent, attr, _OnLaterStage(path, stage))
    _ENDS[model] = ends
    ends_of = [(cut.units[cut.bounds[v][0]].anchor, cut.units[cut.bounds[v][1] - 1].anchor) for v in mine]
    runs = [first if first == last else f"{first}..{last}" for first, last in ends_of]
    sizes = cut.rank_sizes(stages)
    interleaved = f" in {chunks} chunks" if chunks > 1 else ""
    return (
        f"pipeline stage {stage} of {stages}{interleaved}: units {', '.join(runs)} ({sizes[stage]:,} parameters;"
        f" stages {', '.join(f'{n:,}' for n in sizes)}, {cut.how})"
    )


class KeptBlocks:
    """Mixed into a stage's `nn.ModuleList` or `nn.Sequential` of blocks, which holds only the stage's blocks
    under their names in the whole model ("2", "3"): iteration, an integer index and `len` count the kept blocks
    of the chunk whose forward runs (all kept blocks outside `run_stage`, or with one chunk): a forward reading
    `self.layers[0]`, as `nn.TransformerEncoder` does for its settings, gets the running chunk's first block. The
    module tree (`children()`, `state_dict()`) keeps every block, so FSDP, checkpoints and the optimizer see them
    all."""

    _chunk_of: dict[str, int]
    _stage_ends: StageEnds

    def _running(self) -> list[nn.Module]:
        items = self._modules.items()  # type: ignore[attr-defined]
        active = self._stage_ends.active
        return [m for key, m in items if active is None or self._chunk_of.get(key, active) == active]

    def __iter__(self) -> Any:
        return iter(self._running())

    def __len__(self) -> int:
        return len(self._running())

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, int):
            return self._running()[index]
        if isinstance(index, slice):
            running = self._running()[index]
            return nn.Sequential(*running) if isinstance(self, nn.Sequential) else nn.ModuleList(running)
        return super().__getitem__(index)  # type: ignore[misc]


_KEPT_CLASSES: dict[type, type] = {}


def _mark_chunk(blocks: nn.Module, key: str | None, chunk: int, ends: StageEnds) -> None:
    """Make `blocks` a `KeptBlocks` container of `ends`' stage and record that its entry `key` (None: none)
    belongs to chunk `chunk`."""
    cls = type(blocks)
    if not issubclass(cls, KeptBlocks):
        if cls not in _KEPT_CLASSES:
            _KEPT_CLASSES[cls] = type(f"Stage{cls.__name__}", (KeptBlocks, cls), {})
        blocks.__class__ = _KEPT_CLASSES[cls]
        object.__setattr__(blocks, "_chunk_of", {})
        object.__setattr__(blocks, "_stage_ends", ends)
    if key is not None:
        cast(KeptBlocks, blocks)._chunk_of[key] = chunk


def stage_ends(model: nn.Module) -> StageEnds:
    """Where `model`'s stage begins and ends (recorded by `keep_stage`); `ValueError` for a model it did not cut."""
    ends = _ENDS.get(model)
    if ends is None:
        raise ValueError(f"{type(model).__name__} is not a pipeline stage (keep_stage was not applied to it)")
    return ends


def stage_models(build: Callable[[], nn.Module], stages: int, chunks: int = 1) -> list[nn.Module]:
    """Every stage as a worker holds it: `build()` (e.g. on the meta device) with `keep_stage` applied, per stage
    (for the driver's checks)."""
    models = []
    for stage in range(stages):
        model = build()
        keep_stage(model, stage, stages, chunks)
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


class _StageOutput(BaseException):
    """Carries a stage's output out of the forward at its last block (a BaseException: a `loss_fn` catching
    `Exception` does not swallow it)."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__("pipeline stage output")
        self.output = output


def _first_tensor(value: Any) -> torch.Tensor:
    """A block's output: the tensor itself, or the first element of a tuple (older transformers layers)."""
    return value[0] if isinstance(value, tuple | list) else value


def run_stage(
    model: nn.Module, loss_fn: LossFn, batch: Batch, received: torch.Tensor | None, chunk: int = 0
) -> torch.Tensor:
    """One micro-batch through this rank's stage (its chunk `chunk` under the interleaved schedule):
    `loss_fn(model, batch)` as in any other layout, with the chunk's first block fed `received` (the previous
    virtual stage's output; None on the first) and, unless the chunk ends the pipeline, the forward stopped after
    its last block. Returns the per-sample losses on the last virtual stage, else the activation to send on. Every
    stage reads the same micro-batch, so the model's own forward computes its masks and positions on each stage."""
    ends = stage_ends(model)
    entry_path, exit_path = ends.entries[chunk], ends.exits[chunk]
    last = exit_path is None
    handles = []
    if received is not None:
        if entry_path is None:
            raise ValueError("the first pipeline stage receives no activation")

        def feed(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if args:
                return (received, *args[1:]), kwargs
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": received}
            raise ValueError(f"pipeline block {entry_path} was called without a positional input or hidden_states")

        entry = model.get_submodule(entry_path)
        handles.append(entry.register_forward_pre_hook(_eager(feed), prepend=True, with_kwargs=True))
    # the modules whose forward the stop interrupts: the exit block's ancestors, innermost first (the root last)
    interrupted: list[str] = []
    called: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
    if exit_path is not None:
        parts = exit_path.split(".")
        interrupted = [".".join(parts[:n]) for n in range(len(parts) - 1, 0, -1)] + [""]

        def stop(_module: nn.Module, _args: Any, output: Any) -> None:
            raise _StageOutput(_first_tensor(output))

        handles.append(model.get_submodule(exit_path).register_forward_hook(_eager(stop)))
        for path in interrupted:

            def record(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], path: str = path) -> None:
                called[path] = (args, kwargs)

            handles.append(model.get_submodule(path).register_forward_pre_hook(_eager(record), with_kwargs=True))
    ends.received = received
    ends.active = chunk if ends.chunks > 1 else None
    try:
        losses = loss_fn(model, batch)
    except _StageOutput as stopped:
        output = stopped.output
        for path in interrupted:
            if path in called:
                output = _finish_forward(model.get_submodule(path), *called[path], output)
        return output
    finally:
        ends.received = ends.active = None
        for handle in handles:
            handle.remove()
    if not last:
        raise ValueError(
            f"loss_fn returned without the forward reaching {exit_path}, the last block of pipeline stage "
            f"{ends.virtual(chunk)}: loss_fn must call the model once"
        )
    return losses


def _finish_forward(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: torch.Tensor) -> Any:
    """The stage's forward was stopped at its last block inside `model`'s forward: run `model`'s forward hooks that
    the stop skipped, with the stage's output, as a completed forward would (all of them: torch runs `always_call`
    hooks on an `Exception` only, and the stop is a `BaseException`). An FSDP2 unit's post-forward is one: it
    reshards the unit's parameters and hooks the output so that its backward gathers them again (else a later
    micro-batch's backward would find them freed); a random-stream region's exit is another."""
    for key, hook in list(model._forward_hooks.items()):
        if model._forward_hooks_with_kwargs.get(key, False):
            result = hook(model, args, kwargs, output)
        else:
            result = hook(model, args, output)
        if result is not None:
            output = result
    return output


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """A hook that runs eagerly inside a compiled block (it swaps tensors and stops the forward)."""
    return torch.compiler.disable(hook)


def chain_stages(models: list[nn.Module], loss_fn: LossFn, batch: Batch) -> torch.Tensor:
    """Pure torch, one process: `batch` through the stage models (`stage_models`) one virtual stage after another,
    as the pipeline runs them; the per-sample losses of the last stage (the driver's check that a split computes
    the whole model's losses)."""
    received: torch.Tensor | None = None
    chunks = stage_ends(models[0]).chunks
    for virtual in range(len(models) * chunks):
        received = run_stage(models[virtual % len(models)], loss_fn, batch, received, virtual // len(models))
    assert received is not None
    return received


@dataclass(frozen=True)
class Neighbours:
    """A stage's place in its replica's pipeline: the global ranks of the replica's stages in order (`ranks`), its
    index among them, the schedule the pipeline runs (`SCHEDULES`) and the model chunks each stage holds (> 1 for
    the interleaved schedule, whose last stage sends to the first)."""

    ranks: tuple[int, ...]
    stage: int = 0
    schedule: str = "gpipe"
    chunks: int = 1

    @property
    def stages(self) -> int:
        """Stages of the pipeline (pp)."""
        return len(self.ranks)


SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
Op = tuple[str, int, int]  # ("F" forward | "B" backward, micro-batch, chunk)


def _rounds(micro: int, stages: int) -> list[range]:
    """Pure: the interleaved schedule's rounds, consecutive micro-batches that pass through one chunk before the
    next chunk starts: max(1, micro // stages) rounds of near-equal size, each at least `stages` long when there
    are that many micro-batches, so a micro-batch's activation is back at the first stage for the next chunk when
    that chunk starts it."""
    count = max(1, micro // stages)
    sizes = [micro // count + (1 if r < micro % count else 0) for r in range(count)]
    starts = list(itertools.accumulate(sizes, initial=0))
    return [range(a, b) for a, b in itertools.pairwise(starts)]


def schedule_order(schedule: str, stage: int, stages: int, micro: int, chunks: int = 1) -> list[Op]:
    """Pure: the order in which stage `stage` of `stages` runs the forwards ("F", j, c) and backwards ("B", j, c) of
    `micro` micro-batches through its `chunks` model chunks. "gpipe": every forward, then every backward (last
    first): all `micro` micro-batches' activations are held at once. "1f1b": `stages - stage - 1` forwards fill the
    pipeline, then a forward and a backward in turn, then the remaining backwards: at most `stages - stage`
    micro-batches are in flight on a stage, whatever `micro` is (the same bubble as GPipe, less memory).
    "interleaved_1f1b" (Megatron's): each stage holds `chunks` >= 2 chunks (virtual stages `stage`, `stage +
    stages`, ...); forwards go round by round (`_rounds`) through chunk 0, 1, ..., backwards through the chunks in
    reverse, with `2 (stages - stage - 1) + (chunks - 1) * round` forwards before the first backward: the bubble
    shrinks by about `chunks`, for more activations in flight. `ValueError` for another schedule or a chunk count
    the schedule does not take (1 but for the interleaved schedule)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    interleaved = schedule == "interleaved_1f1b"
    if (chunks >= 2) != interleaved:
        runs = ">= 2 chunks" if interleaved else "1 chunk"
        raise ValueError(f"the {schedule} schedule runs {runs} per stage, got {chunks}")
    if schedule == "gpipe":
        return [("F", j, 0) for j in range(micro)] + [("B", j, 0) for j in reversed(range(micro))]
    rounds = _rounds(micro, stages)
    forwards = [("F", j, c) for r in rounds for c in range(chunks) for j in r]
    backwards = [("B", j, c) for r in rounds for c in reversed(range(chunks)) for j in r]
    warmup = 2 * (stages - stage - 1) + (chunks - 1) * len(rounds[0]) if interleaved else stages - stage - 1
    warmup = min(warmup, len(forwards))
    order = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards, strict=False):
        order += [forward, backward]
    return order + backwards[len(forwards) - warmup :]


def sent_messages(orders: list[list[Op]], stages: int, chunks: int, src: int, dst: int) -> list[tuple[str, int, int]]:
    """Pure: the messages stage `src` sends stage `dst`, in the order it sends them, when every stage runs its
    order in `orders`: ("F", v, j) the output of virtual stage v for micro-batch j, ("B", v, j) the gradient of
    v's input. (Two stages exchange activations one way and gradients the other; with 2 stages, or the interleaved
    schedule's wrap from the last stage to the first, both kinds share one way, in the sender's order.)"""
    virtual, sent = stages * chunks, []
    for kind, j, c in orders[src]:
        v = src + c * stages
        to = v + 1 if kind == "F" else v - 1
        if 0 <= to < virtual and to % stages == dst:
            sent.append((kind, v, j))
    return sent


@dataclass
class PipelineStats:
    """What one stage measured over the steps it ran (`pipeline_step(stats=...)`): seconds blocked waiting for a
    neighbour's activation or gradient (the stage's share of the bubble), seconds in the step, and the most
    micro-batches whose activations it held at once."""

    wait_s: float = 0.0
    step_s: float = 0.0
    most_in_flight: int = 0


def _send(tensor: torch.Tensor, dst: int) -> list[Any]:
    """Start sending `tensor` (header with its shape and dtype, then the data) to rank `dst`; returns the pending
    sends with the buffers they read (wait on them before the buffers may change or go)."""
    import torch.distributed as dist

    if tensor.dim() > HEADER - 2 or tensor.dtype not in DTYPES:
        raise ValueError(
            f"a pipeline stage's output must have at most {HEADER - 2} dimensions and one of the dtypes {DTYPES}, "
            f"got shape {tuple(tensor.shape)} and {tensor.dtype}"
        )
    header = torch.zeros(HEADER, dtype=torch.int64)
    header[0], header[1] = tensor.dim(), DTYPES.index(tensor.dtype)
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    header, data = header.to(tensor.device), tensor.contiguous()
    return [(dist.isend(header, dst), header), (dist.isend(data, dst), data)]


def _recv(src: int, device: torch.device, stats: PipelineStats | None = None) -> torch.Tensor:
    import torch.distributed as dist

    started = time.perf_counter()
    header = torch.zeros(HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src)
    ndim, code = int(header[0]), int(header[1])
    tensor = torch.empty(tuple(int(s) for s in header[2 : 2 + ndim]), dtype=DTYPES[code], device=device)
    dist.recv(tensor, src)
    if stats is not None:
        stats.wait_s += time.perf_counter() - started
    return tensor


class _Inbox:
    """This stage's receives: messages arrive from each neighbour in the order it sent them (`sent_messages`), so
    one asked for ahead of its turn is received after those sent before it, which wait here until asked for (NCCL
    matches sends and receives between two ranks in order, whatever their tags)."""

    def __init__(self, expected: dict[int, list[tuple[str, int, int]]], device: torch.device, stats: Any) -> None:
        self.expected = {src: iter(keys) for src, keys in expected.items()}
        self.device, self.stats = device, stats
        self.waiting: dict[tuple[str, int, int], torch.Tensor] = {}

    def take(self, src: int, rank: int, key: tuple[str, int, int]) -> torch.Tensor:
        """The message `key` from stage `src` (global rank `rank`)."""
        while key not in self.waiting:
            following = next(self.expected[src], None)
            if following is None:
                raise RuntimeError(f"pipeline stage {src} sends no message {key}: the stages' schedules disagree")
            self.waiting[following] = _recv(rank, self.device, self.stats)
        return self.waiting.pop(key)


def pipeline_step(
    stage: nn.Module,
    micro_batches: list[Batch],
    loss_fn: LossFn,
    scale: float,
    neighbours: Neighbours,
    device: torch.device,
    sync: Callable[[bool], contextlib.AbstractContextManager[None]] | None = None,
    backward: bool = True,
    autocast_dtype: torch.dtype | None = None,
    seeds: Callable[[int, int], None] | None = None,
    stats: PipelineStats | None = None,
) -> float:
    """Run this stage's part of one optimizer step's micro-batches through the pipeline in the order of its
    schedule (`neighbours.schedule`, `schedule_order`; collective over the replica's stages: each must call it with
    the same micro-batch count). The last virtual stage computes `loss_fn(model, batch)`, sums it and
    backpropagates sum x `scale`; every stage accumulates its gradients. Returns the summed per-sample loss on the
    last stage, 0.0 elsewhere.
    `sync(last)` is entered around each backward (`last`: the step's final backward, where gradients
    synchronise). `backward=False`: forwards only (evaluation). `autocast_dtype`: forwards (and the
    loss) under `torch.autocast` in that dtype (bf16 without FSDP). `seeds(j, v)`: called before micro-batch j's
    forward through virtual stage v (`raytrain.rng.MicroBatchSeeds`). `stats`: adds this step's waits and time
    (`PipelineStats`). Sends do not block (only receives wait), so a stage never waits on a neighbour that waits on
    it."""
    started = time.perf_counter()
    stages, here, chunks = neighbours.stages, neighbours.stage, neighbours.chunks
    virtual, micro = stages * chunks, len(micro_batches)
    if backward:
        orders = [schedule_order(neighbours.schedule, s, stages, micro, chunks) for s in range(stages)]
    else:
        forwards = [("F", j, c) for r in _rounds(micro, stages) for c in range(chunks) for j in r]
        orders = [forwards] * stages
    before, after = (here - 1) % stages, (here + 1) % stages
    inbox = _Inbox(
        {src: sent_messages(orders, stages, chunks, src, here) for src in {before, after} if src != here},
        device,
        stats,
    )
    # the step's last backward syncs: FSDP2's final callback then reduces every unit, also another chunk's whose
    # last backward ran before
    final = next(((j, c) for kind, j, c in reversed(orders[here]) if kind == "B"), None)
    stored: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    sends: list[Any] = []
    local_sum = 0.0
    for kind, j, c in orders[here]:
        v = here + c * stages
        if kind == "F":
            batch = micro_batches[j]
            if seeds is not None:
                seeds(j, v)
            inputs = None
            if v > 0:
                inputs = inbox.take(before, neighbours.ranks[before], ("F", v - 1, j))
                if backward and inputs.is_floating_point():
                    inputs.requires_grad_(True)
            autocast = (
                torch.autocast(device_type=device.type, dtype=autocast_dtype)
                if autocast_dtype is not None
                else contextlib.nullcontext()
            )
            with autocast:
                result = run_stage(stage, loss_fn, batch, inputs, c)
            if v == virtual - 1:
                check_losses(result, batch)
                local_sum += float(result.detach().float().sum())
                result = widen(result).sum() * scale
            else:
                sends += _send(result.detach(), neighbours.ranks[after])
            if backward:
                stored[j, c] = (inputs, result)
                if stats is not None:
                    stats.most_in_flight = max(stats.most_in_flight, len(stored))
            continue
        received, result = stored.pop((j, c))
        with sync((j, c) == final) if sync is not None else contextlib.nullcontext():
            if v == virtual - 1:
                result.backward()
            else:
                result.backward(inbox.take(after, neighbours.ranks[after], ("B", v + 1, j)))
        if received is not None:
            grad = received.grad if received.grad is not None else torch.zeros_like(received)
            sends += _send(grad, neighbours.ranks[before])
    for work, _buffer in sends:
        work.wait()
    if stats is not None:
        stats.step_s += time.perf_counter() - started
    return local_sum
