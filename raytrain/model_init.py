"""Building the model without materializing it whole: record `model_fn()` without memory, replay per tensor.

`record_build(model_fn)` runs the user's constructor under torch's FakeTensorMode (tensors with shapes and
devices but no memory, no compute; the model is then handed on with meta tensors) while a recorder logs every
tensor operation that creates or writes a tensor (`raytrain.init_trace`): the layers' own `reset_parameters`, a
root-level `self.apply(self._init_weights)` (nanoGPT, Hugging Face's `post_init`), a parent writing its child's
weight, a buffer computed with `torch.tril(torch.ones(...))`, `torch.tensor(0)` constants, `.to(torch.float64)` at
the end. Nothing is interpreted: the log is the constructor's own computation, whatever code performed it.

`materialize(model, device, trace, seed)` then gives the (possibly sharded) meta model real storage and fills each
parameter, buffer and attribute tensor (`raytrain.model_tensors`: `self._mask`, a list of tensors, a dict of
constants) by replaying only the operations its final value depends on (its *closure*), on full-size CPU tensors,
keeping this rank's slice. Peak memory is one tensor's closure (about the largest tensor), never the model. Ties
survive: a parameter shared by two modules (GPT-2's `lm_head.weight = wte.weight`) is one parameter again.

The contract (tested on torch.nn, nanoGPT-style and transformers models):
- deterministic operations replay exactly: ties, buffers (bool and integer included), constants, zeros, ones,
  NaN set on purpose, operations with several outputs (`sort`, `topk`, `var_mean`: each output by its position)
  and anything computed from them equal `model_fn()`'s bit for bit;
- a random operation drawn from a generator the constructor controls (`torch.manual_seed` inside `model_fn`, a
  `torch.Generator` of its own) replays exactly, as eagerly;
- any other random operation (`uniform_`, `normal_`, `trunc_normal_`, `randn`, ...) replays with the same arguments,
  so it draws from the distribution the model's own init code asks for, from a generator seeded by (seed, the
  operation's place in the log): the values differ from an eager `torch.manual_seed(seed); model_fn()` but are
  the same at every world size, strategy and layout, because every rank records the same log.
- `torch.empty` memory that the constructor never writes would be garbage in an eager build: `check_trace` finds
  a tensor whose value depends on it (two replays with different fills differ) and names it; the full build is
  used instead (under "meta": refused).

The full build (`torch.manual_seed(seed); model_fn()` on every rank, then sharded) is exact; `ParallelConfig.init`
chooses between the two (`raytrain.parallel.layout.init_mode`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from raytrain.errors import ConfigError
from raytrain.init_trace import UNSET_FILLS, InitTrace, is_fake, recording
from raytrain.model_tensors import (
    attribute_tensors,
    fill,
    local_slice,
    map_attribute_tensors,
    named_tensors,
    retie,
    tie_groups,
    uninitialized,
    unique_tensors,
)

__all__ = ["InitTrace", "MetaBuild", "check_trace", "choose_init", "materialize", "record_build"]


@dataclass(frozen=True)
class MetaBuild:
    """`model_fn()` on the meta device and the trace of its construction."""

    model: nn.Module
    trace: InitTrace


def record_build(model_fn: Callable[[], nn.Module]) -> MetaBuild:
    """Run `model_fn()` without memory, recording how every tensor is made (module docstring), and return the model
    on the meta device with that trace. Raises what `model_fn` raises there (e.g. it reads a tensor's value with
    `.item()`, or loads a file), or `TypeError` when it returns no `nn.Module`.

    The constructor runs under torch's `FakeTensorMode`, whose tensors report the device an eager build would use:
    code that skips its init on the meta device (transformers' `init_weights`) runs it here as it would eagerly."""
    trace = InitTrace()
    with recording(trace):
        model = model_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_fn returned {type(model).__name__}, not a torch.nn.Module")
    for name, tensor in (*named_tensors(model), *attribute_tensors(model)):
        trace.name_final(name, tensor)
    _to_meta(model)
    return MetaBuild(model, trace)


def _to_meta(model: nn.Module) -> None:
    """Replace every fake parameter, buffer and attribute tensor of `model` by a meta tensor of its shape (one
    tensor for one fake tensor: ties stay ties)."""
    made: dict[int, torch.Tensor] = {}

    def meta(tensor: torch.Tensor) -> torch.Tensor:
        if not is_fake(tensor):
            return tensor
        if id(tensor) not in made:
            empty = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
            is_param = isinstance(tensor, nn.Parameter) or getattr(tensor, "_is_param", False)
            made[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if is_param else empty
        return made[id(tensor)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    table[name] = meta(tensor)  # type: ignore[assignment]
    map_attribute_tensors(model, lambda _, tensor: meta(tensor))


def check_trace(trace: InitTrace, seed: int) -> str | None:
    """Why the sharded build cannot reproduce the model (None when it can): a tensor no recorded operation made, a
    replay that fails, or a tensor whose value depends on memory the constructor left unset (`torch.empty` never
    written: replayed with two fills, it differs). Replays every tensor once (twice where it reads `torch.empty`
    memory), one at a time: the time of the model's init, the memory of its largest tensor."""
    if trace.untraced:
        return f"tensor {trace.untraced[0]!r} is not made by any operation recorded on the meta device"
    done: set[int] = set()
    for name, ref in trace.tensors.items():
        if ref.storage in done:
            continue
        done.add(ref.storage)
        try:
            value = trace.value(name, seed)
            if trace.reads_unset_memory(name) and not _same(value, trace.value(name, seed, unset=UNSET_FILLS[1])):
                return f"{name!r} is created with torch.empty and model_fn leaves (part of) it unset"
        except Exception as err:
            return f"replaying the init of {name!r} failed ({type(err).__name__}: {err})"
    return None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where both are NaN."""
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def materialize(
    model: nn.Module,
    device: torch.device | str,
    trace: InitTrace,
    seed: int,
    pretrained: Any = None,
    aliases: dict[str, list[str]] | None = None,
) -> None:
    """Give a meta `model` (as `record_build` built it, possibly pipeline-cut, tensor-parallel and FSDP-sharded
    since) storage on `device` and its initial values: each tensor that the `pretrained` weights
    (`raytrain.pretrained.Pretrained`) hold is read from them (this rank's part only), every other one replayed
    from the trace on the CPU, keeping this rank's slice (module docstring). Ties are kept; `aliases` names the
    other names of each tied parameter in the whole model, under which the weights may hold it. Raises `KeyError`
    naming a tensor the trace does not know, `ValueError` naming a tensor left on the meta device."""
    groups = tie_groups(model)
    model.to_empty(device=device)
    retie(model, groups)
    by_storage: dict[int, torch.Tensor] = {}

    def value(name: str, target: torch.Tensor) -> torch.Tensor:
        if pretrained is not None:
            from raytrain.pretrained import stored_name

            stored = stored_name(pretrained, name, aliases)
            if stored is not None:
                return pretrained.read_local(stored, target)
        if name in trace.constants:
            return local_slice(trace.constants[name], target)
        if name not in trace.tensors:
            raise KeyError(f"{name!r} is not a tensor of the recorded model_fn()")
        key = trace.tensors[name].storage
        if key not in by_storage:
            by_storage.clear()  # one full tensor at a time
            by_storage[key] = trace.value(name, seed)
        return local_slice(by_storage[key], target)

    fill(model, value)
    _restore_attributes(model, trace, seed)


def _restore_attributes(model: nn.Module, trace: InitTrace, seed: int) -> None:
    """Give the attribute tensors recorded in the trace (`raytrain.model_tensors`: a rotary embedding's
    `original_inv_freq`, `self._mask`, tensors in lists and dicts) their values, replicated, on the device of their
    module's other tensors; one tensor kept under two names stays one. `ValueError` names a meta tensor that
    remains anywhere in the model."""
    devices = {
        name: next((t.device for t in (*module.parameters(), *module.buffers()) if not t.is_meta), torch.device("cpu"))
        for name, module in model.named_modules()
    }
    made: dict[int, torch.Tensor] = {}

    def real(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_meta:
            return tensor
        if id(tensor) not in made:
            if name not in trace.constants and name not in trace.tensors:
                raise ValueError(f"model_fn keeps a tensor at {name!r} that the recording did not see")
            full = trace.constants[name] if name in trace.constants else trace.value(name, seed)
            owner = max((m for m in devices if m == "" or name.startswith(m + ".")), key=len)
            made[id(tensor)] = full.clone().to(devices[owner])
        return made[id(tensor)]

    map_attribute_tensors(model, real)
    left = [name for name, tensor in (*named_tensors(model), *attribute_tensors(model)) if tensor.is_meta]
    if left:
        raise ValueError(f"tensor {left[0]!r} is still on the meta device after the build")


FULL_BUILD_MAX_BYTES = 2**30  # "auto" builds a model of at most this many tensor bytes whole: exact, and cheap


@dataclass(frozen=True)
class InitChoice:
    """How the workers build the model: `sharded` (record on meta, replay per tensor) or whole, and why."""

    sharded: bool
    reason: str


def choose_init(mode: str, model_fn: Callable[[], nn.Module], seed: int, *, prefer_sharded: bool = False) -> InitChoice:
    """Decide `ParallelConfig.init` for `model_fn` on the driver (every worker follows the decision):

    - "full": the full build.
    - "meta": the sharded build; `ValueError` naming the reason when `check_trace` (or the recording) refuses it.
    - "auto": the full build for a model of at most `FULL_BUILD_MAX_BYTES` (exactly what `model_fn` gives; unless
      `prefer_sharded`, e.g. pretrained weights replace the init anyway), else the sharded build when it reproduces
      the model, else the full build with the reason.

    A model with lazy modules (a parameter whose shape its first forward decides) is refused in every mode with
    `ConfigError` naming the parameter: every rank builds and shards the model before it sees any data."""
    size = _meta_size(model_fn)
    if mode == "full":
        return InitChoice(False, "init 'full' was asked for")
    if mode == "auto" and not prefer_sharded and size is not None and size <= FULL_BUILD_MAX_BYTES:
        return InitChoice(
            False,
            f"{size / 2**20:.3g} MiB of parameters and buffers <= {FULL_BUILD_MAX_BYTES / 2**30:g} GiB: "
            "built whole on every rank, exactly as model_fn builds it",
        )
    try:
        built = record_build(model_fn)
    except Exception as err:
        blocker: str | None = f"model_fn cannot be recorded without memory ({type(err).__name__}: {err})"
    else:
        blocker = check_trace(built.trace, seed)
    if blocker is None:
        return InitChoice(True, "recorded on the meta device; each rank replays and keeps only its shard")
    if mode == "meta":
        raise ValueError(blocker)
    return InitChoice(False, f"built whole on every rank: {blocker}")


def _meta_size(model_fn: Callable[[], nn.Module]) -> int | None:
    """The bytes of `model_fn()`'s parameters and buffers, built on the meta device (no memory, no init), or None
    when it does not build there; `ConfigError` for a model with lazy modules (`choose_init`)."""
    try:
        with torch.device("meta"):
            model = model_fn()
    except Exception:
        return None
    if not isinstance(model, nn.Module):
        return None
    refuse_lazy(model)
    return sum(t.numel() * t.element_size() for _, t in unique_tensors(model))


def refuse_lazy(model: nn.Module) -> None:
    """`ConfigError` naming the first parameter of `model` whose shape a lazy module (`nn.LazyLinear`, ...) decides
    at its first forward: raytrain builds and shards the model on every rank before any data."""
    lazy = uninitialized(model)
    if lazy:
        module = model.get_submodule(lazy[0].rpartition(".")[0])
        raise ConfigError(
            f"model_fn builds a lazy module ({type(module).__name__}: {lazy[0]!r} has no shape until its first "
            "forward); raytrain builds and shards the model on every rank before any data: give the layer its "
            "input size, or call the model once on a dummy input at the end of model_fn"
        )
