"""Building the model without materializing it whole: record `model_fn()` without memory, replay per tensor.

`record_build(model_fn)` runs the user's constructor under torch's FakeTensorMode (tensors with shapes and
devices but no memory, no compute; the model is then handed on with meta tensors) while a recorder logs every
tensor operation that creates or writes a tensor: the layers' own `reset_parameters`, a root-level
`self.apply(self._init_weights)` (nanoGPT, Hugging Face's `post_init`), a parent writing its child's weight, a
buffer computed with `torch.tril(torch.ones(...))`, `torch.tensor(0)` constants, `.to(torch.float64)` at the end.
Nothing is interpreted: the log is the constructor's own computation, whatever code performed it.

`materialize(model, device, trace, seed)` then gives the (possibly sharded) meta model real storage and fills each
parameter and buffer by replaying only the operations its final value depends on (its *closure*: its creation,
every write to it or to a view of it, and recursively the tensors those read), on full-size CPU tensors, keeping
this rank's slice. Peak memory is one tensor's closure (about the largest tensor), never the model. Ties survive:
a parameter shared by two modules (GPT-2's `lm_head.weight = wte.weight`) is one parameter again afterwards.

The contract (tested on torch.nn, nanoGPT-style and transformers models):
- deterministic operations replay exactly: ties, buffers (bool and integer included), constants, zeros, ones and
  anything computed from them equal `model_fn()`'s bit for bit;
- a random operation (`uniform_`, `normal_`, `randn`, ... : torch's `nondeterministic_seeded` tag) replays with the
  same arguments, so it draws from the distribution the model's own init code asks for, from a generator seeded
  by (seed, the operation's place in the log): the values differ from an eager `torch.manual_seed(seed);
  model_fn()` but are the same at every world size, strategy and layout, because every rank records the same log.
- `torch.empty` memory that the constructor never writes is NaN after the replay (garbage in an eager build);
  `check_trace` names such a tensor, and the full build is used instead.

The full build (`torch.manual_seed(seed); model_fn()` on every rank, then sharded) is exact; `ParallelConfig.init`
chooses between the two (`raytrain.parallel.layout.init_mode`).
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

_EMPTY_OPS = frozenset(
    {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided"}
)


def _key(tensor: torch.Tensor) -> int:
    """The identity of `tensor`'s storage: views, `.data` and `nn.Parameter` wrappers of one tensor share it."""
    return tensor.untyped_storage()._cdata


@dataclass(frozen=True)
class Ref:
    """A recorded (fake) tensor: its storage and its geometry over that storage (so views need no replay)."""

    storage: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @staticmethod
    def of(tensor: torch.Tensor) -> Ref:
        shape, stride = tuple(int(n) for n in tensor.shape), tuple(int(n) for n in tensor.stride())
        return Ref(_key(tensor), tensor.dtype, shape, stride, int(tensor.storage_offset()))

    def on(self, storage: torch.UntypedStorage) -> torch.Tensor:
        """This geometry over a real `storage`."""
        return torch.empty(0, dtype=self.dtype).set_(storage, self.offset, self.size, self.stride)


@dataclass(frozen=True)
class _Const:
    """A real (CPU) tensor an operation read, captured by value at that moment."""

    value: torch.Tensor


@dataclass
class _Op:
    """One recorded operation that created or wrote (fake) storage."""

    index: int
    func: Any  # an aten OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    creates: list[Ref]  # outputs on storage no earlier operation made
    reads: list[int]  # storages of every tensor argument (read or written)
    random: bool


@dataclass
class InitTrace:
    """The recorded construction of a model: operations, and each parameter's and buffer's final tensor by name."""

    ops: list[_Op] = field(default_factory=list)
    writers: dict[int, list[int]] = field(default_factory=dict)  # storage -> indices of ops creating/writing it
    tensors: dict[str, Ref] = field(default_factory=dict)  # every parameter/buffer name (ties: several names)
    constants: dict[str, torch.Tensor] = field(default_factory=dict)  # names of real (not fake) tensors: values
    untraced: list[str] = field(default_factory=list)  # names whose storage no recorded operation made
    _keep: list[torch.Tensor] = field(default_factory=list)  # fake tensors kept alive: their storage ids stay unique

    # -- recording -------------------------------------------------------------------------------------------
    def _ref(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            if isinstance(value, torch.device) and value.type == "meta":
                return torch.device("cpu")
            return None if isinstance(value, torch.Generator) else value
        if _is_fake(value):
            self._keep.append(value)
            return Ref.of(value)
        with _disable_current_modes():  # a real copy, not a fake one
            return _Const(value.detach().clone())

    def record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Log `func(*args, **kwargs) -> out` when it creates new (fake) storage or writes existing storage."""
        written: list[torch.Tensor] = []
        for position, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = kwargs.get(argument.name, args[position] if position < len(args) else None)
                written += [t for t in tree_flatten(value)[0] if _is_fake(t)]
        outputs = [t for t in tree_flatten(out)[0] if _is_fake(t)]
        creates = [Ref.of(t) for t in outputs if _key(t) not in self.writers]
        if not creates and not written:
            return  # a view, or an operation whose result is not kept: nothing to replay
        op_args, op_kwargs = tree_map(self._ref, args), tree_map(self._ref, kwargs)
        reads = [r.storage for r in tree_flatten((op_args, op_kwargs))[0] if isinstance(r, Ref)]
        random = torch.Tag.nondeterministic_seeded in func.tags
        op = _Op(len(self.ops), func, op_args, op_kwargs, creates, reads, random)
        self._log(op, [r.storage for r in creates] + [_key(t) for t in written])
        self._keep += outputs

    def _log(self, op: _Op, storages: list[int]) -> None:
        self.ops.append(op)
        for storage in dict.fromkeys(storages):
            self.writers.setdefault(storage, []).append(op.index)

    def finish(self, model: nn.Module) -> None:
        """Name the model's final tensors (after `model_fn` returned): parameters, buffers and plain tensor
        attributes (e.g. a rotary embedding's `original_inv_freq`)."""
        for name, tensor in (*_named_tensors(model), *_tensor_attributes(model)):
            if not _is_fake(tensor):
                self.constants[name] = tensor.detach().clone()
            elif _key(tensor) in self.writers:
                self.tensors[name] = Ref.of(tensor)
            else:
                self.untraced.append(name)
            self._keep.append(tensor)

    # -- replay ----------------------------------------------------------------------------------------------
    def _closure(self, storage: int) -> list[int]:
        """The indices, in log order, of every operation the final value of `storage` depends on."""
        needed: set[int] = set()
        todo = [(storage, len(self.ops))]
        while todo:
            key, before = todo.pop()
            writers = self.writers.get(key, [])
            for index in writers[: bisect.bisect_left(writers, before)]:
                if index not in needed:
                    needed.add(index)
                    todo += [(read, index) for read in self.ops[index].reads]
        return sorted(needed)

    def value(self, name: str, seed: int) -> torch.Tensor:
        """The full initial value of parameter or buffer `name` on the CPU (see the module docstring)."""
        if name in self.constants:
            return self.constants[name]
        ref = self.tensors[name]
        real: dict[int, torch.UntypedStorage] = {}
        for index in self._closure(ref.storage):
            self._run(self.ops[index], real, seed)
        return ref.on(real[ref.storage])  # a view: it keeps the replayed storage alive, nothing else

    def _run(self, op: _Op, real: dict[int, torch.UntypedStorage], seed: int) -> None:

        def tensor(value: Any) -> Any:
            if isinstance(value, Ref):
                return value.on(real[value.storage])
            return value.value.clone() if isinstance(value, _Const) else value  # a copy: the op may write it

        args, kwargs = tree_map(tensor, op.args), tree_map(tensor, op.kwargs)
        if op.random:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(op_seed(seed, op.index))
                out = op.func(*args, **kwargs)
        else:
            out = op.func(*args, **kwargs)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if op.func._schema.name in _EMPTY_OPS:  # never garbage: deterministic, and NaN shows an unset float
            for t in outputs:
                t.fill_(float("nan") if t.is_floating_point() or t.is_complex() else 0)
        for ref in op.creates:
            geometry = (ref.size, ref.stride, ref.offset)
            match = [t for t in outputs if (tuple(t.shape), tuple(t.stride()), t.storage_offset()) == geometry]
            if not match:
                raise ValueError(f"replaying {op.func} gave other shapes or strides than on the meta device")
            real.setdefault(ref.storage, match[0].untyped_storage())


def op_seed(seed: int, index: int) -> int:
    """The generator seed of the recorded random operation number `index`: a function of the run's seed and the
    operation's place in the construction log only."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


def _is_fake(value: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)


def _tensor_attributes(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors kept as plain module attributes (neither parameters nor buffers), by dotted name."""
    for module_name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not attr.startswith("_"):
                yield (f"{module_name}.{attr}" if module_name else attr), value


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer by every name (a tied parameter under each of its names)."""
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


class _Recorder(TorchDispatchMode):
    def __init__(self, trace: InitTrace, memo: Any) -> None:
        super().__init__()
        self.trace, self.memo = trace, memo

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.trace.record(func, args, kwargs, out)
        # FakeTensorMode remembers tensors it made by weak reference, and torch refuses to swap a tensor that has
        # one: `module.to(dtype)` in model_fn would fail. The recording never needs those memories.
        self.memo.clear()
        return out


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
    from torch._subclasses.fake_tensor import FakeTensorMode

    trace = InitTrace()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    fake.cache_enabled = False  # its cache holds weak references too (see `_Recorder`)
    with fake, _Recorder(trace, fake.fake_tensor_converter.meta_converter.tensor_memo), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")  # nn.Transformer's
        model = model_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_fn returned {type(model).__name__}, not a torch.nn.Module")
    trace.finish(model)
    _to_meta(model)
    return MetaBuild(model, trace)


def _to_meta(model: nn.Module) -> None:
    """Replace every fake parameter, buffer and plain tensor attribute of `model` by a meta tensor of its shape
    (one tensor for one fake tensor: ties stay ties)."""
    from torch._subclasses.fake_tensor import FakeTensor

    made: dict[int, torch.Tensor] = {}

    def meta(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in made:
            empty = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
            is_param = isinstance(tensor, nn.Parameter) or getattr(tensor, "_is_param", False)
            made[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if is_param else empty
        return made[id(tensor)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if isinstance(tensor, FakeTensor):
                    table[name] = meta(tensor)  # type: ignore[assignment]
        for name, value in vars(module).items():
            if isinstance(value, FakeTensor):
                setattr(module, name, meta(value))


def check_trace(trace: InitTrace, seed: int) -> str | None:
    """Why the sharded build cannot reproduce the model (None when it can): a tensor no recorded operation made, a
    replay that fails, or a floating-point tensor left (partly) unset by the constructor (NaN after the replay).
    Replays every tensor once, one at a time: the time of the model's init, the memory of its largest tensor."""
    if trace.untraced:
        return f"tensor {trace.untraced[0]!r} is not made by any operation recorded on the meta device"
    done: set[int] = set()
    for name, ref in trace.tensors.items():
        if ref.storage in done:
            continue
        done.add(ref.storage)
        try:
            value = trace.value(name, seed)
        except Exception as err:
            return f"replaying the init of {name!r} failed ({type(err).__name__}: {err})"
        if (value.is_floating_point() or value.is_complex()) and bool(torch.isnan(value).any()):
            return f"{name!r} is created with torch.empty and model_fn leaves (part of) it unset"
    return None


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
    for name, tensor in _named_tensors(model):
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
    naming a tensor the trace does not know."""
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
    """Give the plain tensor attributes recorded in the trace (e.g. a rotary embedding's `original_inv_freq`) their
    values (replicated, on the device of the module's other tensors)."""
    for name, value in _tensor_attributes(model):
        if not value.is_meta:
            continue
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        full = trace.constants[name] if name in trace.constants else trace.value(name, seed)
        device = next((t.device for t in (*module.parameters(), *module.buffers()) if not t.is_meta), "cpu")
        setattr(module, attr, full.to(device))


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
    """
    if mode == "full":
        return InitChoice(False, "init 'full' was asked for")
    if mode == "auto" and not prefer_sharded:  # the size alone decides a small model: no recording needed
        size = _meta_size(model_fn)
        if size is not None and size <= FULL_BUILD_MAX_BYTES:
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
    when it does not build there."""
    try:
        with torch.device("meta"):
            model = model_fn()
    except Exception:
        return None
    if not isinstance(model, nn.Module):
        return None
    return sum(t.numel() * t.element_size() for _, t in _unique_tensors(model))


def _unique_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    for name, tensor in _named_tensors(model):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor
