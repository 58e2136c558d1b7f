"""Parallelism, applied in one place after the model is built; model code stays untouched.

Strategy mapping (ZeRO stage -> PyTorch mechanism):
    ddp    DistributedDataParallel: everything replicated, gradients all-reduced once per optimizer step.
    zero1  DDP + torch's ZeroRedundancyOptimizer: optimizer state sharded over ranks, parameters and gradients
           replicated; after each step every rank broadcasts its updated parameter shard.
    zero2  FSDP2 `fully_shard(reshard_after_forward=False)`: parameters gathered once per step and kept whole
           until its last backward; gradients and optimizer state sharded.
    zero3  FSDP2 `fully_shard(reshard_after_forward=True)`: parameters sharded too, gathered per unit in every
           forward and backward.

`apply_parallelism` does, in this order (torchtitan's): the pipeline split (each rank keeps its stage,
`raytrain.parallel.pipeline`), tensor parallel over the mesh's "tp" dimension
(`raytrain.parallel.tensor`), activation checkpointing per block, `torch.compile` per block, FSDP units over the
"dp" dimension (each repeated block, then the root, with the mixed-precision policy), materialize the meta model on
the device and initialise it (`raytrain.model_init.materialize`: each rank replays the recorded construction and
keeps its shard; ties stay ties), DDP. With one data-parallel replica
nothing is sharded or wrapped on the dp axis: there is nobody to synchronise with.

With tensor or pipeline parallelism (`ParallelDims.model_parallel`) the dp axis is FSDP2 over `mesh["dp"]` for
zero2/zero3 (2-D with TP, torchtitan's composition), and for ddp one all-reduce of the gradients over the dp group
after the last micro-step (`StepPolicy.dp_group`; DDP itself takes no DTensor parameters). zero1 is refused there:
`ZeroRedundancyOptimizer` takes plain tensors only.

FSDP units: by default one unit per repeated block, i.e. each child of every `nn.ModuleList` / `nn.Sequential`
whose children are two or more modules of one class (a transformer's layers, found generically, so a model from
another library nested as `model.transformer.h[i]` or `model.model.layers[i]` works unchanged); a model without
such blocks gets one unit per direct child that owns parameters. `units_fn(model) -> [modules]` chooses them
instead, in the style of torchtitan's per-model `parallelize`.

Loss normalisation contract (see `raytrain.batch_plan`): DDP, FSDP2 and the by-hand all-reduce average gradients
over the dp replicas; the loop multiplies the summed per-sample loss by dp / B so that the average becomes the sum
over the global batch. The ranks of one TP group compute the same loss on the same samples (one replica).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from raytrain.console import counted
from raytrain.errors import ConfigError
from raytrain.model_init import InitTrace, materialize
from raytrain.model_tensors import tie_aliases, tie_groups
from raytrain.parallel.dims import Coords, ParallelDims
from raytrain.parallel.idle import UnitCalls, ddp_sync, fill_missing_grads
from raytrain.parallel.pipeline import KeptBlocks, Neighbours, PipelineStats, StageTie, keep_stage
from raytrain.parallel.sequence import apply_sequence_parallel, sequence_blocks
from raytrain.parallel.tensor import TPPlan, apply_tensor_parallel, resolve_plan

UnitsFn = Callable[[nn.Module], list[nn.Module]]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class StepPolicy:
    """How one optimizer step's micro-steps synchronise and compute; decided once per (re)start.

    reduce_every_micro_step: the gradients are reduced after every micro-step (FSDP: sharded accumulation; DDP:
        only a benchmark's naive baseline asks for it); otherwise only the last micro-step synchronises.
    keep_params_gathered: FSDP keeps parameters unsharded from the first micro-step to the last (zero2).
    autocast_dtype: compute dtype under `torch.autocast` (mixed precision without FSDP), or None.
    dp_group: the data-parallel process group of a model-parallel layout (None: the default group is the dp axis).
    all_reduce_gradients: after the last micro-step, average the gradients over `dp_group` by hand (ddp with
        tensor or pipeline parallelism).
    counts_loss: this rank's loss sum enters the step's loss (all-reduced over every rank): in a model-parallel
        layout only the last pipeline stage's first tp rank of each replica counts, once per replica.
    pipeline: this rank's neighbours in its replica's pipeline (pp > 1: the step runs `pipeline_step`), else None.
    pp_group: the process group of this rank's pipeline (pp > 1): the stages' gradient norms are summed over it.
    stage_ties: for each parameter tied across pipeline stages that this stage holds: (its name here, the process
        group of the stages holding it, whether this stage counts it in the gradient norm: the first one only).
    pipeline_stats: where a pipeline stage adds its waits and step times (`PipelineStats`; benchmarks), or None.
    sequence_group: with sequence parallel, the tp process group over which the gradients of the parameters it
        left whole inside the blocks are summed (`raytrain.parallel.sequence.sum_sequence_gradients`), else None.
    unit_calls: the FSDP units' call counts, compared over the ranks at every step (`raytrain.parallel.idle`), or
        None.
    """

    reduce_every_micro_step: bool = False
    keep_params_gathered: bool = False
    autocast_dtype: torch.dtype | None = None
    dp_group: Any = None
    all_reduce_gradients: bool = False
    counts_loss: bool = True
    pipeline: Neighbours | None = None
    pp_group: Any = None
    stage_ties: tuple[tuple[str, Any, bool], ...] = ()
    pipeline_stats: PipelineStats | None = None
    sequence_group: Any = None
    unit_calls: UnitCalls | None = None

    def norm_parameters(self, model: nn.Module) -> list[torch.Tensor]:
        """The parameters this rank counts in the global gradient norm: all but the copies of a tie held by an
        earlier stage too."""
        skip = {id(model.get_parameter(name)) for name, _, counts in self.stage_ties if not counts}
        return [p for p in model.parameters() if id(p) not in skip]


SYNC_LAST_MICRO_STEP = StepPolicy()  # the default: gradients sync once per step, full precision


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every repeated block: the children of each `nn.ModuleList` / `nn.Sequential` whose
    children are two or more callable modules of one class that own parameters (one is enough in a pipeline stage's
    list of the blocks it kept). Outermost only: a block's inner lists are part of the block. `nn.Identity` children
    are ignored (a pipeline stage's placeholders for other stages' blocks)."""
    blocks: list[tuple[str, nn.Module]] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in taken):
            continue
        if not isinstance(module, nn.ModuleList | nn.Sequential):
            continue
        children = [(n, child) for n, child in module.named_children() if not isinstance(child, nn.Identity)]
        classes = {type(child) for _, child in children}
        if (
            len(children) >= (1 if isinstance(module, KeptBlocks) else 2)
            and len(classes) == 1
            and has_forward(children[0][1])
            and any(True for _ in children[0][1].parameters())
        ):
            blocks += [(f"{name}.{child_name}" if name else child_name, child) for child_name, child in children]
            taken += [f"{name}.{child_name}" if name else child_name for child_name, _ in children]
    return blocks


def has_forward(module: nn.Module) -> bool:
    """Whether `module` can be called (FSDP shards callable modules only: not an `nn.ModuleDict` or
    `nn.ModuleList`, whose children the root's forward calls directly)."""
    return type(module).forward is not nn.Module.forward


def fsdp_units(
    model: nn.Module, units_fn: UnitsFn | None = None, conditional: Sequence[str] = ()
) -> tuple[list[nn.Module], str]:
    """The modules to shard as FSDP units before the root, and a one-line reason for the log.

    A tied parameter (one parameter under several names) must be managed by one unit: a default unit holding a
    name of a tie whose other names lie outside it is left to the root (and the reason says so); units from
    `units_fn` that split a tie raise `ConfigError` naming the parameter and the units. `conditional` names the
    modules called on some forwards only (`raytrain.parallel.idle.conditional_modules`): a default unit that is
    one or lies inside one is left to its parent, a `units_fn` unit that is one is refused."""
    inside = _inside(conditional)
    if units_fn is not None:
        units = list(units_fn(model))
        called_sometimes = [name for name, _ in _named_units(model, units) if inside(name)]
        if called_sometimes:
            raise ConfigError(
                f"units_fn makes {called_sometimes[0]!r} an FSDP unit, but the model calls it on some forwards only: "
                "its all-gather needs every rank; leave it to its parent unit"
            )
        split = split_ties(model, units)
        if split:
            names, unit_names = split[0]
            raise ConfigError(
                f"units_fn puts the tied parameter {' = '.join(names)} in different FSDP units "
                f"({', '.join(unit_names)}): a parameter shared by several modules must be in one unit (or in none: "
                "the root takes it)"
            )
        return units, f"{len(units)} units from units_fn"
    blocks = [(name, block) for name, block in repeated_blocks(model) if not inside(name)]
    if blocks:
        kind = type(blocks[0][1]).__name__
        units, why = [module for _, module in blocks], f"{len(blocks)} repeated blocks ({kind}) + root"
    else:
        units = [
            child
            for name, child in model.named_children()
            if has_forward(child) and any(True for _ in child.parameters()) and not inside(name)
        ]
        why = f"no repeated blocks: {len(units)} direct children with parameters + root"
    if conditional:
        why += f"; {counted(len(conditional), 'module')} not called alike on every forward left to the parents"
    split = split_ties(model, units)
    if split:
        dropped = {name for _, unit_names in split for name in unit_names}
        units = [unit for name, unit in _named_units(model, units) if name not in dropped]
        left = ", ".join(sorted(dropped - {"<root>"}))
        why += f"; {left} left to the root (they share a tied parameter with other modules)"
    return units, why


def _inside(conditional: Sequence[str]) -> Callable[[str], bool]:
    """Whether a module name is one of `conditional` or lies inside one."""
    return lambda name: any(name == outer or name.startswith(outer + ".") for outer in conditional)


def _named_units(model: nn.Module, units: list[nn.Module]) -> list[tuple[str, nn.Module]]:
    names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    return [(names[id(unit)], unit) for unit in units]


def split_ties(model: nn.Module, units: list[nn.Module]) -> list[tuple[list[str], list[str]]]:
    """Each tied parameter whose names do not all lie in one of `units`: (its names, the units holding them, with
    "<root>" for a name outside every unit). Empty when every tie is inside one unit or outside all of them."""
    named = sorted(_named_units(model, units), key=lambda item: -item[0].count("."))  # innermost first

    def unit_of(name: str) -> str:
        return next((unit for unit, _ in named if name.startswith(unit + ".")), "<root>")

    split = []
    for group in tie_groups(model):
        holders = list(dict.fromkeys(unit_of(name) for name in group))
        if len(holders) > 1:
            split.append((group, holders))
    return split


def _is_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def _checkpoint_blocks(model: nn.Module, tp_plan: Mapping[str, str] | None = None) -> str | None:
    """Activation checkpointing on every repeated block (else every direct child): recompute in backward. Under
    tensor parallelism a unit holding only one side of a colwise -> rowwise pair would start or end its recompute
    inside a region of the tp rank's own random stream (`raytrain.rng`) and recompute other dropout masks: such a
    unit is not checkpointed; returns the line saying which, or None."""
    from torch.distributed._composable import checkpoint

    named = [(name, module) for name, module in repeated_blocks(model)] or list(model.named_children())
    skipped = []
    for name, block in named:
        styles = {s for planned, s in (tp_plan or {}).items() if planned == name or planned.startswith(name + ".")}
        if len(styles) == 1:
            skipped.append(name)
            continue
        checkpoint(block)
    if not skipped:
        return None
    return (
        f"activation checkpointing: {', '.join(skipped)} not checkpointed (each holds one side of a tensor-parallel "
        "colwise -> rowwise pair; recomputing it alone would draw other dropout masks)"
    )


def _compile_blocks(model: nn.Module) -> None:
    blocks = [module for _, module in repeated_blocks(model)] or list(model.children())
    for block in blocks:
        block.compile()


def apply_parallelism(
    model: nn.Module,
    strategy: str,
    device: torch.device,
    dims: ParallelDims | int,
    *,
    mesh: Any = None,
    tp_plan: TPPlan | None = None,
    stage: int = 0,
    pp_chunks: int = 1,
    sequence_parallel: bool = False,
    init: InitTrace | None = None,
    seed: int = 0,
    pretrained: Any = None,
    precision: str = "fp32",
    activation_checkpointing: bool = False,
    compile_blocks: bool = False,
    units_fn: UnitsFn | None = None,
    conditional: Sequence[str] = (),
    log: Callable[[str], None] | None = None,
) -> nn.Module:
    """Apply `strategy` on the dp axis, and tensor parallelism when `dims.tp` > 1, to `model` (built on the meta
    device, or a real one); call once in every worker. `dims` may be a plain world size (dp only).

    A model-parallel layout needs `mesh` (`ParallelDims.build_mesh`); for pp > 1 the rank keeps pipeline stage
    `stage` (`raytrain.parallel.pipeline.keep_stage`; `pp_chunks` model chunks of it under the interleaved
    schedule), for tp > 1 with `sequence_parallel` the activations between the split layers are cut along the
    sequence (`raytrain.parallel.sequence`), and for tp > 1 `tp_plan` (module-name patterns ->
    "colwise" / "rowwise", checked on the whole model by the driver) splits that stage's layers. A meta model
    (`raytrain.model_init.record_build`, whose trace is `init`) is materialized on `device` and initialised from
    `init` and `seed` after sharding, so each rank only ever allocates its shard (plus one tensor's full value
    while initialising); a real model is moved to `device`. With `pretrained` weights
    (`raytrain.pretrained.Pretrained`) every tensor they hold is read from them instead, this rank's part only.
    Requires an initialised default process group when the world has more than one rank. Returns the module to
    train. `conditional`: the modules called on some forwards only, never FSDP units (`fsdp_units`). Parameters
    that sit out a step train at every strategy (`raytrain.parallel.idle`): FSDP reduce-scatters zeros for them,
    DDP's buckets are completed by `micro_step`. `log` receives one line per applied parallelism (tensor
    parallel, FSDP units).
    """
    dims = dims if isinstance(dims, ParallelDims) else ParallelDims.of(dims)
    if strategy not in ("ddp", "zero1", "zero2", "zero3"):
        raise ConfigError(f"strategy must be one of ddp, zero1, zero2, zero3 here, got {strategy!r}")
    if dims.model_parallel and strategy == "zero1":
        raise ConfigError(
            f"strategy 'zero1' cannot be combined with tp/pp ({dims.describe()}): use ddp, zero2 or zero3"
        )
    if dims.model_parallel and mesh is None:
        raise ValueError(f"a model-parallel layout ({dims.describe()}) needs its device mesh")
    # a tied parameter's other names in the whole model: the weights may hold it under a name this stage lacks
    aliases = tie_aliases(model)
    if dims.pp > 1:
        line = keep_stage(model, stage, dims.pp, pp_chunks)
        if log is not None:
            log(line)
    resolved: dict[str, str] = {}
    if dims.tp > 1:
        if not tp_plan:
            raise ValueError("tp > 1 needs a tensor-parallel plan")
        resolved = resolve_plan(model, tp_plan, dims.tp, stage=dims.pp > 1)
        if resolved:
            line = apply_tensor_parallel(model, mesh["tp"], resolved, device, sequence_parallel)
            if log is not None:
                log(line)
    if activation_checkpointing:
        skipped = _checkpoint_blocks(model, resolved)
        if skipped and log is not None:
            log(skipped)
    if sequence_parallel and resolved:  # after checkpointing: a block's recompute replays the sequence split
        line = apply_sequence_parallel(model, resolved, sequence_blocks(model), mesh["tp"].get_group(), device)
        if log is not None:
            log(line)
    if compile_blocks:
        _compile_blocks(model)
    sharded = dims.dp > 1 and strategy in ("zero2", "zero3")
    if sharded:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dtype = DTYPES.get(precision)
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        reshard = strategy == "zero3"
        dp_mesh = mesh["dp"] if dims.model_parallel else None
        units, why = fsdp_units(model, units_fn, conditional)
        for unit in units:
            fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
        reduce_unused = getattr(model, "set_reduce_scatter_unused_params", None)  # torch 2.13 has it; older may not
        if callable(reduce_unused):  # a parameter one rank left unused: a zero gradient, not a mismatched collective
            reduce_unused(True)
        if log is not None:
            largest = max((sum(p.numel() for p in u.parameters()) for u in units), default=0)
            log(f"FSDP units: {why}; largest unit {largest:,} parameters")
    if _is_meta(model):
        if init is None:
            raise ValueError("a model on the meta device needs the trace of its construction (record_build)")
        materialize(model, device, init, seed, pretrained, aliases)
    else:
        model.to(device)
        if pretrained is not None:
            from raytrain.pretrained import load_into

            load_into(model, pretrained, aliases)
    if dims.dp > 1 and not dims.model_parallel and strategy in ("ddp", "zero1"):
        device_ids = [device.index] if device.type == "cuda" else None
        # The gradients become views of DDP's buckets at the first sync and stay so (`idle.zero_grads` zeroes them
        # in place): no second copy, 16 bytes per parameter with AdamW, not 20.
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
    return model


def step_policy(
    strategy: str,
    dims: ParallelDims | int,
    precision: str,
    grad_accumulation: str,
    mesh: Any = None,
    coords: Coords | None = None,
    ties: Sequence[StageTie] = (),
    pp_schedule: str = "gpipe",
    pp_chunks: int = 1,
    sequence_parallel: bool = False,
    model: nn.Module | None = None,
) -> StepPolicy:
    """The micro-step policy for a resolved layout (`grad_accumulation` already "unsharded" or "sharded");
    `mesh` is the layout's device mesh and `coords` this rank's place in it when `dims` is model-parallel; `ties`
    the parameters tied across its pipeline stages (`stage_ties` of the whole model; a collective when not empty:
    one process group per tie and replica, made by every rank in the same order); `pp_schedule` the pipeline's
    schedule (`raytrain.parallel.pipeline.SCHEDULES`) and `pp_chunks` the model chunks per stage it runs;
    `sequence_parallel` as `apply_parallelism` was given it. With the wrapped `model` of a data-parallel
    zero2/zero3 layout the policy counts its FSDP units' calls (`StepPolicy.unit_calls`)."""
    dims = dims if isinstance(dims, ParallelDims) else ParallelDims.of(dims)
    sharded = dims.dp > 1 and strategy in ("zero2", "zero3")
    unit_calls = None
    if sharded and not dims.model_parallel and model is not None:  # stages differ in units: dp only
        from torch.distributed.fsdp import FSDPModule

        unit_calls = UnitCalls([m for m in model.modules() if isinstance(m, FSDPModule) and m is not model])
    policy = StepPolicy(
        reduce_every_micro_step=sharded and grad_accumulation == "sharded",
        keep_params_gathered=sharded and strategy == "zero2",
        autocast_dtype=None if sharded else DTYPES.get(precision),
        unit_calls=unit_calls,
    )
    if not dims.model_parallel:
        return policy
    if mesh is None or coords is None:
        raise ValueError(f"a model-parallel layout ({dims.describe()}) needs its mesh and this rank's coordinates")
    pipeline = None
    if dims.pp > 1:
        pipeline = Neighbours(
            ranks=tuple(dims.rank_of(replace(coords, pp=stage)) for stage in range(dims.pp)),
            stage=coords.pp,
            schedule=pp_schedule,
            chunks=pp_chunks,
        )
    return replace(
        policy,
        stage_ties=_tie_groups(ties, dims, coords),
        dp_group=mesh["dp"].get_group(),
        all_reduce_gradients=dims.dp > 1 and strategy == "ddp",
        counts_loss=coords.tp == 0 and coords.pp == dims.pp - 1,
        pipeline=pipeline,
        pp_group=mesh["pp"].get_group() if dims.pp > 1 else None,
        sequence_group=mesh["tp"].get_group() if sequence_parallel and dims.tp > 1 else None,
    )


def _tie_groups(ties: Sequence[StageTie], dims: ParallelDims, coords: Coords) -> tuple[tuple[str, Any, bool], ...]:
    """This rank's `StepPolicy.stage_ties`: for every tie, one process group per (dp, tp) position over the stages
    holding it (`new_group` is collective: every rank creates every group)."""
    import torch.distributed as dist

    mine = []
    for tie in ties:
        for dp in range(dims.dp):
            for tp in range(dims.tp):
                ranks = [dims.rank_of(Coords(dp=dp, tp=tp, pp=stage)) for stage in tie.names]
                group = dist.new_group(ranks)
                if (dp, tp) == (coords.dp, coords.tp) and coords.pp in tie.names:
                    mine.append((tie.names[coords.pp], group, coords.pp == min(tie.names)))
    return tuple(mine)


def tied_gradients(model: nn.Module, policy: StepPolicy) -> None:
    """Sum the gradient of every parameter tied across pipeline stages over the stages holding it (after the
    backward; a collective over each tie's stages), so that every copy holds the whole parameter's gradient."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    for name, group, _ in policy.stage_ties:
        parameter = model.get_parameter(name)
        if not parameter.requires_grad:
            continue
        if parameter.grad is None:  # this stage's copy was not used: it adds nothing
            parameter.grad = torch.zeros_like(parameter)
        grad = parameter.grad
        dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=group)


def all_reduce_gradients(parameters: Iterable[torch.Tensor], group: Any, replicas: int) -> None:
    """Average the gradients over the data-parallel `group` of `replicas` ranks: one all-reduce per dtype over
    the flattened local gradients (a DTensor's local shard: its TP sharding is the same on every replica).

    Replicas may leave different parameters without a gradient (a branch their samples did not take): those get
    a zero one first (`raytrain.parallel.idle`'s convention), so every replica reduces the same parameters in the
    same order."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    trainable = [p for p in parameters if p.requires_grad]
    fill_missing_grads(trainable)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in trainable:
        assert p.grad is not None
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        by_dtype.setdefault(local.dtype, []).append(local)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat.div_(replicas)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def backward_sync(model: nn.Module, policy: StepPolicy) -> Callable[[bool], contextlib.AbstractContextManager[None]]:
    """For a pipeline schedule, whose backwards run apart from their forwards: `sync(last)` sets FSDP's gradient
    sync and resharding for one backward as `micro_step` does for a micro-step (nothing for other wrappers)."""

    @contextlib.contextmanager
    def sync(last: bool) -> Iterator[None]:
        set_sync = getattr(model, "set_requires_gradient_sync", None)
        if set_sync is not None:
            set_sync(last or policy.reduce_every_micro_step)
            model.set_reshard_after_backward(last or not policy.keep_params_gathered)  # type: ignore[operator]
        yield

    return sync


@contextlib.contextmanager
def micro_step(model: nn.Module, *, last: bool, policy: StepPolicy) -> Iterator[None]:
    """Context for one micro-step's forward and backward. Gradient sync on the last micro-step only (DDP
    `no_sync`, FSDP2 `set_requires_gradient_sync`), or on every one with `reduce_every_micro_step`; zero2's
    parameters stay gathered until the last backward; autocast when the policy asks for it."""
    autocast = (
        torch.autocast(device_type=_device_type(model), dtype=policy.autocast_dtype)
        if policy.autocast_dtype is not None
        else contextlib.nullcontext()
    )
    if isinstance(model, nn.parallel.DistributedDataParallel):
        sync = last or policy.reduce_every_micro_step
        with ddp_sync(model) if sync else model.no_sync(), autocast:
            yield
        return
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    if set_sync is not None:
        set_sync(last or policy.reduce_every_micro_step)
        model.set_reshard_after_backward(last or not policy.keep_params_gathered)  # type: ignore[operator]
    with autocast:
        yield


def _device_type(model: nn.Module) -> str:
    parameter = next(model.parameters(), None)
    return parameter.device.type if parameter is not None else "cpu"


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """`micro_step` with the default policy: sync only when `enabled` (the last micro-step)."""
    with micro_step(model, last=enabled, policy=SYNC_LAST_MICRO_STEP):
        yield


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper (FSDP2 modifies the module in place, so it is returned as is)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
