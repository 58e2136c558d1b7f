"""Building the model without materializing it whole: on the meta device, then each rank's shard only.

The initial weights are a function of (seed, module name) alone, never of the world size or the strategy:
`init_weights` visits the modules children first (the order in which a constructor initialises them: a parent's
own reset runs after its children's, as `nn.MultiheadAttention` does for its `out_proj`) and, for every module
that owns parameters or buffers, gives them full-size CPU tensors, seeds torch's generator from (seed, module
name), calls the module's own `reset_parameters()`, then copies each rank's slice of the result into the real
(possibly FSDP-sharded) tensor. Peak memory is the largest single module's parameters, not the model.

A model can be built this way when every module that owns parameters or buffers has `reset_parameters()` (or
`_reset_parameters()`): all of torch.nn's layers do. Otherwise `meta_init_blocker` names the first module that
does not, and the loop builds the full model on every rank (`torch.manual_seed(seed); model_fn()`, the same at
every W) and logs why.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import nn

RESET_METHODS = ("reset_parameters", "_reset_parameters")


def build_on_meta(model_fn: Callable[[], nn.Module]) -> nn.Module | None:
    """`model_fn()` with every tensor on the meta device (no memory), or None when `model_fn` cannot build there
    (e.g. it loads weights from a file)."""
    try:
        with torch.device("meta"):
            model = model_fn()
    except Exception:
        return None
    return model if isinstance(model, nn.Module) else None


def _owned(module: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and buffers `module` owns directly (not its children's)."""
    tensors: dict[str, torch.Tensor] = dict(module.named_parameters(recurse=False))
    tensors.update(dict(module.named_buffers(recurse=False)))
    return tensors


def _reset_method(module: nn.Module) -> Callable[[], None] | None:
    for name in RESET_METHODS:
        method = getattr(module, name, None)
        if callable(method):
            return method
    return None


def meta_init_blocker(model: nn.Module) -> str | None:
    """Why `model` cannot be initialised module by module (None when it can): the first module that owns
    parameters or buffers but has no `reset_parameters()`."""
    for name, module in model.named_modules():
        if _owned(module) and _reset_method(module) is None:
            return (
                f"module {name or '<root>'!r} ({type(module).__name__}) owns parameters or buffers but has no "
                "reset_parameters()"
            )
    return None


def _children_first(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield from _children_first(child, f"{prefix}{name}.")
    yield prefix.rstrip("."), module


def module_seed(seed: int, name: str) -> int:
    """The generator seed of module `name`: a function of the run's seed and the module's name only."""
    return int(np.random.SeedSequence([seed, zlib.crc32(name.encode())]).generate_state(1)[0])


def _local_slice(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full` for `target`: the DTensor shard when `target` is one (every rank holds the same
    full tensor, so no communication), else `full` itself."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        return distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
    return full


def _unset_marker(tensor: torch.Tensor) -> torch.Tensor:
    """A full-size CPU tensor filled with a value a reset should overwrite: NaN for floats, the largest value for
    integers (booleans cannot be marked)."""
    full = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    if full.is_floating_point() or full.is_complex():
        full.fill_(float("nan"))
    elif full.dtype != torch.bool:
        full.fill_(torch.iinfo(full.dtype).max)
    return full


def _still_unset(full: torch.Tensor) -> bool:
    if full.numel() == 0 or full.dtype == torch.bool:
        return False
    if full.is_floating_point() or full.is_complex():
        return bool(torch.isnan(full).any())
    return bool((full == torch.iinfo(full.dtype).max).all())


@torch.no_grad()
def reset_module(module: nn.Module, name: str, seed: int) -> dict[str, torch.Tensor]:
    """The full initial values of the tensors `module` owns: its `reset_parameters()` run on full-size CPU tensors
    under the seed of (seed, `name`). The module's own tensors (meta, sharded or real) are left in place.
    Raises `ValueError` when the module has no reset method or its reset leaves one of them unset."""
    reset = _reset_method(module)
    if reset is None:
        raise ValueError(f"module {name or '<root>'!r} ({type(module).__name__}) has no reset_parameters()")
    real = {key: (key in module._parameters, tensor) for key, tensor in _owned(module).items()}
    for key, (is_param, tensor) in real.items():
        full = _unset_marker(tensor)
        if is_param:
            module._parameters[key] = nn.Parameter(full, requires_grad=tensor.requires_grad)
        else:
            module._buffers[key] = full
    try:
        torch.manual_seed(module_seed(seed, name))
        reset()
        values = {key: _owned(module)[key].detach() for key in real}
    finally:
        for key, (is_param, tensor) in real.items():
            (module._parameters if is_param else module._buffers)[key] = tensor  # type: ignore[assignment]
    unset = [key for key, full in values.items() if _still_unset(full)]
    if unset:
        raise ValueError(
            f"module {name or '<root>'!r} ({type(module).__name__}): reset_parameters() leaves {unset} unset"
        )
    return values


def check_init(model: nn.Module, seed: int) -> str | None:
    """Why `model` (e.g. built on meta) cannot be initialised module by module, or None when it can: a module
    without a reset method, or one whose reset leaves a tensor it owns unset. Needs the largest single module's
    tensors in CPU memory, never the model's."""
    blocker = meta_init_blocker(model)
    if blocker is not None:
        return blocker
    for name, module in _children_first(model):
        if _owned(module):
            try:
                reset_module(module, name, seed)
            except ValueError as err:
                return str(err)
    return None


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Initialise every parameter and buffer of a materialized `model` (e.g. after `to_empty`) from
    (seed, module name); see the module docstring. Every rank computes the same full values and keeps its slice.
    Raises `ValueError` where `check_init` would name a module."""
    for name, module in _children_first(model):
        owned = _owned(module)
        if not owned:
            continue
        values = reset_module(module, name, seed)
        for key, tensor in owned.items():
            local = _local_slice(values[key], tensor)
            target = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            target.copy_(local.to(device=target.device, dtype=target.dtype))
