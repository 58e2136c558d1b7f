"""Tensor parallel inside a node: the Megatron split of a block's linear layers, as a plan per model family.

A plan maps module names (fnmatch patterns, e.g. "blocks.*.attn.q") to a style:

    "colwise"   the weight's output features are split over the tp ranks (torch's `ColwiseParallel`): the input is
                replicated, each rank computes its slice of the output (e.g. its attention heads, its MLP columns)
    "rowwise"   the input features are split (`RowwiseParallel`): each rank multiplies its slice, the partial results
                are all-reduced once, the output is replicated

A block is a colwise layer followed by a rowwise one (q, k, v -> out projection; fc -> down projection): one
all-reduce in the forward and one in the backward per pair. Modules outside the plan (embeddings, norms, the head)
stay whole on every rank and see replicated activations; their gradients are the same on every tp rank.

The plan comes from `tp_plan_fn(model)` (the per-model hook, like `units_fn`), else from the model's own
`tp_plan()` method (raytrain's toy GPT has one). The model must size its attention heads from the tensors it
receives (`view(b, t, q.shape[-1] // head_dim, head_dim)`), not from a configured head count: a colwise q
projection gives each rank heads / tp of them (and not `view(b, t, -1, ...)`, which fails on an empty
micro-batch). `check_tp_plan` runs on the driver on the meta model and names every problem before any worker starts.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from raytrain.errors import ConfigError
from raytrain.model_tensors import tie_groups
from raytrain.rng import install_tp_rng

TPStyle = str  # "colwise" or "rowwise"
TPPlan = Mapping[str, TPStyle]
TPPlanFn = Callable[[nn.Module], TPPlan]
STYLES = ("colwise", "rowwise")


def plan_of(model: nn.Module, tp_plan_fn: TPPlanFn | None) -> TPPlan:
    """The tensor-parallel plan of `model`: `tp_plan_fn(model)`, else `model.tp_plan()`. Raises `ConfigError` when
    neither exists (tensor parallelism needs to know which layers pair up)."""
    if tp_plan_fn is not None:
        return dict(tp_plan_fn(model))
    own = getattr(model, "tp_plan", None)
    if callable(own):
        return dict(own())
    raise ConfigError(
        f"tp > 1 needs a tensor-parallel plan for {type(model).__name__}: pass ElasticTrainer(tp_plan_fn=...) "
        "returning {module-name pattern: 'colwise' | 'rowwise'}, or give the model a tp_plan() method "
        "(see raytrain.toy.GPT.tp_plan)"
    )


def resolve_plan(model: nn.Module, plan: TPPlan, tp: int, *, stage: bool = False) -> dict[str, TPStyle]:
    """The plan expanded to module names, checked for `tp` ranks: every pattern matches at least one
    `nn.Linear`, every style is "colwise" or "rowwise", and the split dimension (output features for colwise,
    input features for rowwise) is a multiple of `tp`. Raises `ConfigError` naming the pattern or module.
    `stage`: `model` is one pipeline stage, where patterns of other stages' modules match nothing (checked on the
    whole model by the driver) and the stage may hold no planned layer at all."""
    modules = dict(model.named_modules())
    resolved: dict[str, TPStyle] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ConfigError(f"tp plan {pattern!r}: style must be one of {', '.join(STYLES)}, got {style!r}")
        names = [
            name
            for name in modules
            if name
            and fnmatch.fnmatchcase(name, pattern)
            and not (stage and isinstance(modules[name], nn.Identity))  # another pipeline stage's unit
        ]
        if not names and not stage:
            raise ConfigError(f"tp plan pattern {pattern!r} matches no module of {type(model).__name__}")
        for name in names:
            module = modules[name]
            if not isinstance(module, nn.Linear):
                raise ConfigError(
                    f"tp plan: module {name!r} is a {type(module).__name__}; raytrain splits nn.Linear layers only"
                )
            size, what = (module.out_features, "output") if style == "colwise" else (module.in_features, "input")
            if size % tp:
                raise ConfigError(
                    f"tp plan: {name!r} is {style} but its {what} features ({size}) are not a multiple of tp = {tp}"
                )
            resolved[name] = style
    if not resolved and not stage:
        raise ConfigError(f"the tp plan of {type(model).__name__} is empty: nothing would be split")
    for group in tie_groups(model):
        planned = [name for name in group if name.rpartition(".")[0] in resolved]
        if planned:
            raise ConfigError(
                f"tp plan: {planned[0].rpartition('.')[0]!r} is {resolved[planned[0].rpartition('.')[0]]} but its "
                f"parameter is tied ({' = '.join(group)}): a tied parameter stays whole, leave the module out of the "
                "plan"
            )
    return resolved


def check_tp_plan(
    model: nn.Module, tp_plan_fn: TPPlanFn | None, tp: int, stages: Callable[[], list[nn.Module]] | None = None
) -> dict[str, TPStyle]:
    """Driver-side check (on the meta model): the plan exists and `resolve_plan` accepts it for `tp`, on the whole
    model and, with `stages` (a function building the pipeline stages), on each stage as a worker applies it."""
    plan = plan_of(model, tp_plan_fn)
    resolved = resolve_plan(model, plan, tp)
    for stage in stages() if stages is not None else []:
        resolve_plan(stage, plan, tp, stage=True)
    return resolved


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: Any,
    plan: Mapping[str, TPStyle],
    device: torch.device | None = None,
    sequence_parallel: bool = False,
) -> str:
    """Split `model`'s planned linear layers over `tp_mesh` in place (`parallelize_module`) and give each tp rank
    its own random stream inside the split regions (`raytrain.rng.install_tp_rng`: dropout between a colwise and
    a rowwise layer draws per rank, outside the ranks agree; `device`: the run's, for its generator); returns one
    line for the log. With `sequence_parallel` the rowwise layers reduce-scatter their output over the sequence
    (dimension 1), and `raytrain.parallel.sequence.apply_sequence_parallel` adds the rest (the random streams
    included). Call before FSDP and before materializing a meta model."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def style(name: str) -> Any:
        if name == "colwise":
            return ColwiseParallel()
        return RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()

    parallelize_module(model, tp_mesh, {name: style(s) for name, s in plan.items()})
    names = {style: [name for name, s in plan.items() if s == style] for style in STYLES}
    if sequence_parallel:  # its streams: `raytrain.parallel.sequence`
        drawn = "every random op between the sequence's split and join draws per tp rank"
    else:
        install_tp_rng(model, names["colwise"], names["rowwise"], tp_mesh.get_local_rank(), device)
        drawn = "dropout between them draws per tp rank"
    return (
        f"tensor parallel over {tp_mesh.size()} ranks: {len(names['colwise'])} colwise, {len(names['rowwise'])} "
        f"rowwise ({drawn})"
    )
