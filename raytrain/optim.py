"""The optimizer: built from the user's factory with its parameter groups, sharded for zero1 without losing them,
its LR set per group from the schedule, and gradients clipped on the norm of the whole global batch's gradient.

The user's factory takes either the parameters or the model (for groups that need parameter names):

    def optimizer_fn(params, lr):                      # groups by shape need only the parameters
        params = list(params)
        return torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}], lr=lr)

    def optimizer_fn(model, lr):                       # first parameter named `model`: the module itself
        embed = [p for n, p in model.named_parameters() if n.startswith("embed")]
        ...

`lr` is the peak LR the rule gives for the global batch. Groups may set their own `lr` (e.g. `0.1 * lr` for
embeddings); raytrain keeps each group's ratio to `lr` and multiplies it by the schedule at every step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from raytrain.errors import ConfigError

OptimizerFactory = Callable[..., torch.optim.Optimizer]


def wants_model(optimizer_fn: OptimizerFactory) -> bool:
    """True when `optimizer_fn`'s first parameter is named `model`: it is then called with the module."""
    try:
        parameters = list(inspect.signature(optimizer_fn).parameters)
    except (TypeError, ValueError):  # builtins and some C callables have no signature: the parameters form
        return False
    return bool(parameters) and parameters[0] == "model"


def call_optimizer_fn(optimizer_fn: OptimizerFactory, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """`optimizer_fn(model, lr=lr)` when it asks for the model (see `wants_model`), else
    `optimizer_fn(model.parameters(), lr=lr)`. `model` is the user's module (inside any DDP wrapper: its parameters
    and names are the user's own). Raises `ConfigError` unless a torch optimizer comes back."""
    optimizer = optimizer_fn(model if wants_model(optimizer_fn) else model.parameters(), lr=lr)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optimizer_fn must return a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return optimizer


def _constructor_kwargs(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its class's constructor accepts (torch 2.13's AdamW keeps
    `decoupled_weight_decay` in its defaults but does not take it as an argument)."""
    parameters = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in parameters and k != "params"}


def _groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Copies of the parameter groups: their parameters and every option, as the user set them."""
    return [{**group, "params": list(group["params"])} for group in optimizer.param_groups]


def check_shardable(optimizer: torch.optim.Optimizer) -> None:
    """Raise `ConfigError` unless zero1 can rebuild `optimizer` shard by shard: its class must accept its own
    parameter groups and constructor defaults (what `ZeroRedundancyOptimizer` does on every rank). Needs no
    process group; called on the driver before any worker starts, and again in `shard_optimizer`."""
    cls = type(optimizer)
    try:
        cls(_groups(optimizer), **_constructor_kwargs(optimizer))
    except Exception as err:
        raise ConfigError(
            f"strategy 'zero1' cannot shard optimizer {cls.__module__}.{cls.__name__}: rebuilding it from its "
            f"parameter groups failed ({type(err).__name__}: {err}); use ddp, zero2 or zero3 with this optimizer"
        ) from None


def shard_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """zero1: a `ZeroRedundancyOptimizer` over the same parameter groups (each keeps its options; each rank's local
    optimizer holds its share of every group). Needs the default process group (any size, also 1)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    check_shardable(optimizer)
    return ZeroRedundancyOptimizer(
        _groups(optimizer), optimizer_class=type(optimizer), **_constructor_kwargs(optimizer)
    )


def build_optimizer(
    model: nn.Module, optimizer_fn: OptimizerFactory, lr: float, strategy: str
) -> torch.optim.Optimizer:
    """The user's optimizer for the (wrapped) `model` at LR `lr`; for zero1 its state is sharded over the ranks.

    Call in every worker after `apply_parallelism`. For zero1 this needs the default process group: also at
    W = 1, so a zero1 checkpoint always holds the consolidated optimizer state and loads at any W. Otherwise
    parameter groups that hold no parameter are dropped (a pipeline stage holds only some of the model's
    parameters, so some of the user's groups are empty there; they change nothing, and DCP's per-parameter
    optimizer state cannot store them). zero1 keeps them: its checkpoint is the optimizer's own state dict.
    """
    from raytrain.parallel.apply import unwrap

    optimizer = call_optimizer_fn(optimizer_fn, unwrap(model), lr)
    if strategy != "zero1":
        optimizer.param_groups = [group for group in optimizer.param_groups if group["params"]]
    return shard_optimizer(optimizer) if strategy == "zero1" else optimizer


def lr_ratios(optimizer: torch.optim.Optimizer, lr: float) -> list[float]:
    """Each group's LR relative to `lr`, the LR the optimizer was built with (1.0 for groups that kept it)."""
    return [group["lr"] / lr for group in optimizer.param_groups]


def set_lr(optimizer: torch.optim.Optimizer, ratios: list[float], lr: float) -> None:
    """Set every group's LR to its ratio times `lr` (zero1 passes them on to its local optimizer at `step`)."""
    if len(ratios) != len(optimizer.param_groups):
        raise ValueError(f"{len(ratios)} LR ratios for {len(optimizer.param_groups)} parameter groups")
    for group, ratio in zip(optimizer.param_groups, ratios, strict=True):
        group["lr"] = ratio * lr


def _by_mesh(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` grouped so that one group's tensors can share a foreach kernel: plain tensors together, DTensors
    by device mesh (torch refuses to mix them, and a tensor-parallel model under FSDP has two meshes)."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values())


def global_grad_norm(parameters: Iterable[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of the whole global batch's gradient, the same on every rank (a collective for DTensors).

    Call after the synchronising micro-step. DDP and zero1 hold the full, identical gradient on every rank; FSDP2
    and tensor parallelism hold DTensor shards, whose norm is reduced over their mesh first (plain tensors next to
    them, such as the norms of a tensor-parallel model, are whole and identical on every rank).
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norms = []
    for group in _by_mesh(grads):
        norm = torch.nn.utils.get_total_norm(group, 2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1:
        return norms[0]
    return torch.stack([n.double().cpu() ** 2 for n in norms]).sum().sqrt().to(norms[0].dtype)


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm: torch.Tensor | None = None) -> float:
    """Scale the gradients so that their global 2-norm is at most `max_norm`, as one process on one big batch
    would; return the norm before clipping. `norm` is `global_grad_norm(parameters)` when already computed."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    total = global_grad_norm(params) if norm is None else norm
    for group in _by_mesh(params):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.to(params[0].device))
    return float(total)
