"""Checks of the user's functions on the driver, before any worker starts: a mistake costs seconds, not restarts.

The model is built on the meta device (no memory, no compute: shapes only), so the check costs nothing for a
model of any size; a `model_fn` that cannot build on meta is built on the CPU instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch
from torch import nn

from raytrain.errors import ConfigError
from raytrain.failures import with_frames
from raytrain.optim import OptimizerFactory, call_optimizer_fn, check_shardable


def _named(role: str, fn: Any) -> str:
    """`role` and the function's name ("loss_fn mean_loss"), or `role` alone where the name is the role's."""
    name = getattr(fn, "__qualname__", None) or getattr(getattr(fn, "func", None), "__qualname__", None) or repr(fn)
    return role if name == role else f"{role} {name}"


def build_model_for_check(model_fn: Callable[[], nn.Module]) -> nn.Module:
    """`model_fn()` on the meta device, else on the CPU; `ConfigError` naming `model_fn` when both fail or the
    result is not an `nn.Module` with parameters."""
    try:
        with torch.device("meta"):
            model = model_fn()
    except Exception:
        try:
            model = model_fn()
        except Exception as err:
            named = _named("model_fn", model_fn)
            raise ConfigError(with_frames(f"{named} raised {type(err).__name__}: {err}", err)) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{_named('model_fn', model_fn)} must return a torch.nn.Module, got {type(model).__name__}")
    if not any(True for _ in model.parameters()):
        raise ConfigError(f"{_named('model_fn', model_fn)} returned a module without parameters: nothing to train")
    return model


def check_optimizer_fn(optimizer_fn: OptimizerFactory, model: nn.Module, lr: float, strategy: str) -> None:
    """`optimizer_fn` builds a torch optimizer for `model`, one that zero1 can shard when `strategy` is zero1;
    `ConfigError` naming the function otherwise."""
    try:
        optimizer = call_optimizer_fn(optimizer_fn, model, lr)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(
            with_frames(f"{_named('optimizer_fn', optimizer_fn)} raised {type(err).__name__}: {err}", err)
        ) from None
    if strategy == "zero1":
        check_shardable(optimizer)


def check_lr_schedule_fn(fn: Callable[[int, int], float], total_steps: int) -> None:
    """`fn(step, total_steps)` returns a finite factor >= 0 at the first, second and last step; `ConfigError`
    naming the step and the value otherwise."""
    for step in sorted({0, min(1, total_steps - 1), total_steps - 1}):
        try:
            value = fn(step, total_steps)
        except Exception as err:
            raise ConfigError(
                with_frames(
                    f"{_named('lr_schedule_fn', fn)}({step}, {total_steps}) raised {type(err).__name__}: {err}", err
                )
            ) from None
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise ConfigError(
                f"{_named('lr_schedule_fn', fn)}({step}, {total_steps}) must return a finite number >= 0 (a factor of "
                f"the peak LR), got {value!r}"
            )


def check_units_fn(units_fn: Callable[[nn.Module], list[nn.Module]], model: nn.Module) -> None:
    """`units_fn(model)` returns a list of distinct submodules of `model` (not the root: raytrain adds it);
    `ConfigError` naming what is wrong otherwise."""
    try:
        units = units_fn(model)
    except Exception as err:
        message = f"{_named('units_fn', units_fn)} raised {type(err).__name__}: {err}"
        raise ConfigError(with_frames(message, err)) from None
    members = {id(m) for m in model.modules() if m is not model}
    if not isinstance(units, list | tuple) or not all(isinstance(u, nn.Module) and id(u) in members for u in units):
        raise ConfigError(
            f"{_named('units_fn', units_fn)} must return a list of submodules of the model (not the model itself), "
            f"got {units!r:.200}"
        )


CPU_CHECK_MAX_PARAMS = 50_000_000  # a real CPU model for the loss check only up to this size (200 MB in fp32)


def check_loss_fn(
    loss_fn: Callable[..., Any],
    model: nn.Module,
    sample: dict[str, np.ndarray],
    build_cpu_model: Callable[[], nn.Module],
    watch: Callable[[nn.Module], AbstractContextManager[Any]] | None = None,
) -> str:
    """Run `loss_fn(model, batch)` on a few real samples, as a worker would, and check it returns one loss per
    sample; `ConfigError` naming the function, what was expected and what came back. `model` may be on the meta
    device (shapes only, no compute); if the call fails there, a real CPU model from `build_cpu_model` (when it
    has at most `CPU_CHECK_MAX_PARAMS` parameters) decides whether the failure is the code's or meta's.
    `watch(m)`, when given, is entered around each forward with the model it runs (e.g.
    `raytrain.parallel.sequence.SequenceProbe.watch`: checks that need the same forward do not run another).
    Returns a note for the log ("" when the check ran)."""
    from raytrain.data.materialized import to_tensors

    rows = len(next(iter(sample.values())))
    columns = sorted(sample)
    on_meta = any(p.is_meta for p in model.parameters())
    try:
        losses = _call_loss(loss_fn, model, to_tensors(sample, "meta" if on_meta else "cpu"), watch)
    except Exception as err:
        size = sum(p.numel() for p in model.parameters())
        if not on_meta or isinstance(err, KeyError):
            raise _loss_error(loss_fn, err, rows, columns) from None
        if size > CPU_CHECK_MAX_PARAMS:
            return (
                f"loss_fn check skipped: it does not run on the meta device ({type(err).__name__}) and the model "
                "is too large for a CPU check"
            )
        try:
            losses = _call_loss(loss_fn, build_cpu_model(), to_tensors(sample, "cpu"), watch)
        except Exception as cpu_err:
            raise _loss_error(loss_fn, cpu_err, rows, columns) from None
    if not isinstance(losses, torch.Tensor) or losses.dim() != 1 or losses.shape[0] != rows:
        got = f"shape {tuple(losses.shape)}" if isinstance(losses, torch.Tensor) else type(losses).__name__
        shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else None
        raise ConfigError(
            f"{_named('loss_fn', loss_fn)} must return one loss per sample, a tensor of shape [{rows}] for {rows} "
            f"samples, got {got} ({loss_shape_hint(shape, rows)})"
        )
    return ""


def loss_shape_hint(shape: tuple[int, ...] | None, rows: int) -> str:
    """Pure: what to change in a loss function that returned a tensor of `shape` (None: not a tensor) for `rows`
    samples instead of one loss per sample."""
    if shape is not None and len(shape) >= 2 and shape[0] == rows:
        hint = (
            "one row per sample holding several numbers, e.g. one per token: reduce each sample's row, e.g. "
            "losses.mean(dim=1), or losses.flatten(1).mean(1) for more dimensions"
        )
        if len(shape) == 2 and shape[1] == rows:
            hint += (
                f"; a [{rows}, {rows}] tensor is also what predictions of shape [{rows}] against targets of shape "
                f"[{rows}, 1] broadcast to: give both the same shape"
            )
        return hint
    return "raytrain sums and normalises them itself: return e.g. F.cross_entropy(..., reduction='none'), not a mean"


def find_conditional_modules(
    loss_fn: Callable[..., Any],
    model: nn.Module,
    sample: dict[str, np.ndarray],
    build_cpu_model: Callable[[], nn.Module],
) -> list[str] | None:
    """The modules `loss_fn`'s forward calls on some inputs only (`raytrain.parallel.idle.conditional_modules`),
    probed with `sample`'s rows together and one by one: on `model` when it runs on the meta device, else on a CPU
    model from `build_cpu_model` up to `CPU_CHECK_MAX_PARAMS` parameters (a router's choice needs real values);
    None when neither runs."""
    from raytrain.data.materialized import to_tensors
    from raytrain.parallel.idle import conditional_modules

    rows = len(next(iter(sample.values())))
    samples = [sample, *({name: column[i : i + 1] for name, column in sample.items()} for i in range(rows))]
    on_meta = any(p.is_meta for p in model.parameters())
    candidates: list[Callable[[], nn.Module]] = [lambda: model]
    if on_meta and sum(p.numel() for p in model.parameters()) <= CPU_CHECK_MAX_PARAMS:
        candidates.append(build_cpu_model)
    for build in candidates:
        try:
            probed = build()
            device = "meta" if any(p.is_meta for p in probed.parameters()) else "cpu"
            return conditional_modules(probed, loss_fn, [to_tensors(rows_, device) for rows_ in samples])
        except Exception:
            continue
    return None


def _call_loss(
    loss_fn: Callable[..., Any],
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    watch: Callable[[nn.Module], AbstractContextManager[Any]] | None = None,
) -> Any:
    with torch.no_grad(), watch(model) if watch is not None else nullcontext():
        return loss_fn(model, batch)


def _loss_error(loss_fn: Callable[..., Any], err: Exception, rows: int, columns: list[str]) -> ConfigError:
    return ConfigError(
        with_frames(
            f"{_named('loss_fn', loss_fn)} raised {type(err).__name__}: {err} on a batch of {rows} samples with "
            f"columns {columns}",
            err,
        )
    )


def check_pipeline(
    model_fn: Callable[[], nn.Module],
    loss_fn: Callable[..., Any],
    sample: dict[str, np.ndarray],
    pp: int,
    build_cpu_model: Callable[[], nn.Module],
    chunks: int = 1,
) -> str:
    """With `pp` > 1: run `sample` through the `pp` stage models (`chunks` chunks each) one after another in this
    process, as the pipeline runs them (`raytrain.parallel.pipeline.chain_stages`), and compare with the whole
    model's losses. On a real CPU model (`build_cpu_model`, in eval mode) when the model has at most
    `CPU_CHECK_MAX_PARAMS` parameters: the values must agree, so a split whose first or last modules are not the
    ones the forward runs before or after the blocks is refused; larger models on the meta device (shapes only).
    `ConfigError` naming the problem. Returns a line for the log."""
    import copy

    from raytrain.data.materialized import to_tensors
    from raytrain.parallel.pipeline import chain_stages, keep_stage

    rows = len(next(iter(sample.values())))
    meta = build_model_for_check(model_fn)
    real = sum(p.numel() for p in meta.parameters()) <= CPU_CHECK_MAX_PARAMS
    whole = build_cpu_model().eval() if real else meta
    batch = to_tensors(sample, "cpu" if real else "meta")
    stages = []
    for stage in range(pp):
        model = copy.deepcopy(whole)
        keep_stage(model, stage, pp, chunks)
        stages.append(model)
    try:
        with torch.no_grad():
            chained = chain_stages(stages, loss_fn, batch)
            expected = loss_fn(whole, batch) if real else None
    except ConfigError:
        raise
    except Exception as err:
        if not real:
            return f"pipeline check skipped: the stages do not run on the meta device ({type(err).__name__})"
        raise ConfigError(
            with_frames(f"the {pp} pipeline stages, chained on {rows} samples, raised {type(err).__name__}: {err}", err)
        ) from None
    if expected is None:
        return f"pipeline check: {pp} stages chained on {rows} samples (meta device: shapes only)"
    difference = float((chained.double() - expected.double()).abs().max()) if chained.shape == expected.shape else None
    if difference is None or not torch.allclose(chained.double(), expected.double(), rtol=1e-4, atol=1e-5):
        raise ConfigError(
            f"the {pp} pipeline stages, chained on {rows} samples, compute other losses than the whole model "
            f"({'shape ' + str(tuple(chained.shape)) if difference is None else f'max difference {difference:.3g}'}):"
            " the split's first and last modules must be exactly those the forward runs before and after the blocks"
        )
    return (
        f"pipeline check: {pp} stages{f' ({chunks} chunks each)' if chunks > 1 else ''} chained on {rows} samples "
        "give the whole model's losses (max difference "
        f"{difference:.1e})"
    )


def check_stage_ties(
    model_fn: Callable[[], nn.Module], optimizer_fn: OptimizerFactory, pp: int, lr: float, chunks: int = 1
) -> list[str]:
    """With `pp` > 1 stages, a parameter tied across stages is a copy on each (`raytrain.parallel.pipeline.
    StageTie`); every copy must get the same optimizer options, or the copies drift apart. `optimizer_fn` sees
    each stage's own names, so a rule by name can put them in different groups: `ConfigError` naming the tie, the
    stages and the option. Returns one line per tie for the log."""
    from raytrain.parallel.pipeline import keep_stage, stage_ties

    ties = stage_ties(build_model_for_check(model_fn), pp, chunks)
    options: dict[tuple[int, int], dict[str, Any]] = {}
    for stage in sorted({stage for tie in ties for stage in tie.names}):
        model = build_model_for_check(model_fn)
        keep_stage(model, stage, pp, chunks)
        optimizer = call_optimizer_fn(optimizer_fn, model, lr)
        for index, tie in enumerate(ties):
            if stage in tie.names:
                parameter = model.get_parameter(tie.names[stage])
                group = next(g for g in optimizer.param_groups if any(p is parameter for p in g["params"]))
                options[index, stage] = {key: value for key, value in group.items() if key != "params"}
    lines = []
    for index, tie in enumerate(ties):
        (first, name), *others = tie.names.items()
        for stage, other in others:
            differ = sorted(
                k for k in options[index, first] if options[index, first][k] != options[index, stage].get(k)
            )
            if differ:
                key = differ[0]
                raise ConfigError(
                    f"{_named('optimizer_fn', optimizer_fn)} gives the tied parameter {name!r} "
                    f"(pipeline stage {first}) "
                    f"{key}={options[index, first][key]!r} but its copy {other!r} (stage {stage}) "
                    f"{key}={options[index, stage].get(key)!r}: choose its group by something both names share "
                    "(e.g. the parameter's shape), as one process would see only the first name"
                )
        lines.append(
            f"pipeline: {' = '.join(tie.names.values())} is tied across stages {', '.join(map(str, tie.names))}: a "
            "copy on each, gradients summed over them"
        )
    return lines
