"""Every tensor a model holds, by name: parameters, buffers, tensors kept in attributes, and ties.

A module holds tensors in three places: its parameters, its buffers, and plain attributes (a rotary embedding's
`inv_freq` kept as `self._cos_cached`, a list of masks, a dict of constants), possibly inside lists, tuples and dicts
and plain objects a few levels down. The builds (`raytrain.model_init`), pretrained loading and the export name
them all the same way:

    parameters and buffers   their `named_parameters` / `named_buffers` names (a tie under each of its names)
    attribute tensors        "<module>.<attribute>" and, inside containers, ".<index>" / ".<key>" per level

A parameter shared by several modules (GPT-2's `lm_head.weight = wte.weight`) is a *tie*: one tensor under several
names (`tie_groups`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

# nn.Module's own bookkeeping in vars(module): the registered tensors are named through named_parameters/buffers
_REGISTERED = frozenset({"_parameters", "_buffers", "_modules"})
MAX_DEPTH = 4  # containers and plain objects below a module attribute: how many levels are searched for tensors

TensorMap = Callable[[str, torch.Tensor], torch.Tensor]


def named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer by every name (a tied parameter under each of its names)."""
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def unique_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer once, under its first name."""
    seen: set[int] = set()
    for name, tensor in named_tensors(model):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor


def map_attribute_tensors(model: nn.Module, fn: TensorMap) -> None:
    """Replace every tensor kept in a module attribute (not a parameter or buffer), at any name, `_` included, and
    inside lists, tuples (named ones too), dicts and plain objects up to `MAX_DEPTH` levels down, by `fn(name,
    tensor)` (module docstring for the names). Lists and dicts are changed in place, tuples rebuilt; returning
    the tensor itself leaves it (a walk). torch's own objects (an FSDP module's state) are not entered."""
    for module_name, module in model.named_modules():
        for attr, value in list(vars(module).items()):
            if attr in _REGISTERED or isinstance(value, nn.Module):
                continue
            name = f"{module_name}.{attr}" if module_name else attr
            new = _map(value, name, fn, 0, set())
            if new is not value:
                object.__setattr__(module, attr, new)


def attribute_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor `map_attribute_tensors` reaches, in its order."""
    found: list[tuple[str, torch.Tensor]] = []

    def note(name: str, tensor: torch.Tensor) -> torch.Tensor:
        found.append((name, tensor))
        return tensor

    map_attribute_tensors(model, note)
    return found


def _map(value: Any, name: str, fn: TensorMap, depth: int, seen: set[int]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(name, value)
    if depth >= MAX_DEPTH or id(value) in seen or isinstance(value, nn.Module | str | bytes | int | float | type):
        return value
    seen.add(id(value))
    if isinstance(value, list):
        for i, item in enumerate(value):
            new = _map(item, f"{name}.{i}", fn, depth + 1, seen)
            if new is not item:
                value[i] = new
        return value
    if isinstance(value, dict):
        for key, item in list(value.items()):
            new = _map(item, f"{name}.{key}", fn, depth + 1, seen)
            if new is not item:
                value[key] = new
        return value
    if isinstance(value, tuple):
        items = [_map(item, f"{name}.{i}", fn, depth + 1, seen) for i, item in enumerate(value)]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if type(value).__module__.split(".")[0] == "torch" or not hasattr(value, "__dict__"):
        return value
    try:
        attributes = list(vars(value).items())
    except TypeError:
        return value
    for attr, item in attributes:
        new = _map(item, f"{name}.{attr}", fn, depth + 1, seen)
        if new is not item:
            setattr(value, attr, new)
    return value


def tie_groups(model: nn.Module) -> list[list[str]]:
    """The names of each parameter that several modules share (first name first, in `named_parameters` order)."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def tie_aliases(model: nn.Module) -> dict[str, list[str]]:
    """{name of a tied parameter: its other names} over `model`'s ties (`tie_groups`): where a state stored under
    one name must be found by another (a pipeline stage holds a tie under one name only)."""
    return {name: [other for other in group if other != name] for group in tie_groups(model) for name in group}


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_name, _, attr = name.rpartition(".")
    return model.get_submodule(module_name), attr


def retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Make each group's names one parameter again (the first name's), e.g. after `to_empty`, which gives every
    module a new tensor of its own."""
    for first, *others in groups:
        owner, attr = _owner(model, first)
        parameter = owner._parameters[attr]
        for name in others:
            module, attr = _owner(model, name)
            module._parameters[attr] = parameter


@torch.no_grad()
def fill(model: nn.Module, local_value: Callable[[str, torch.Tensor], torch.Tensor | None]) -> list[str]:
    """Copy into each parameter and buffer of `model` (possibly sharded DTensors) `local_value(name, tensor)`, this
    rank's part of its initial value (None: leave it). A tied parameter is filled once, from the first of its names
    that gives a value. Returns the first name of every tensor left unfilled."""
    by_id: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, tensor in named_tensors(model):
        by_id.setdefault(id(tensor), (tensor, []))[1].append(name)
    skipped = []
    for tensor, names in by_id.values():
        local = next((v for v in (local_value(name, tensor) for name in names) if v is not None), None)
        if local is None:
            skipped.append(names[0])
            continue
        target = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        target.copy_(local.to(device=target.device, dtype=target.dtype))
    return skipped


def local_slice(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full` for `target`: the DTensor shard when `target` is one (every rank holds the same
    full tensor, so no communication), else `full` itself."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        return distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
    return full


def uninitialized(model: nn.Module) -> list[str]:
    """The names of `model`'s parameters and buffers whose shape is not known yet (a lazy module's, such as
    `nn.LazyLinear` before its first forward)."""
    from torch.nn.parameter import is_lazy

    return [name for name, tensor in named_tensors(model) if is_lazy(tensor)]
