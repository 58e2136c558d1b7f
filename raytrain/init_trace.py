"""The recorded construction of a model: every tensor operation `model_fn()` ran without memory, replayable per
tensor (`raytrain.model_init` builds models with it).

`Recorder` is a dispatch mode that runs inside torch's `FakeTensorMode` and logs each operation that creates or
writes (fake) storage: its function, its arguments (fake tensors as `Ref`s, real ones captured by value), which
output positions made new storage, and what it read. `InitTrace.value(name, seed)` replays, on full-size CPU
tensors, only the operations the final value of one tensor depends on.

Random draws:
- a draw from torch's default generator that `model_fn` did not seed replays from a generator seeded by (the run's
  seed, the operation's place in the log): the distribution the model's code asks for, the same at every world
  size and layout, not an eager build's values;
- a draw from a generator `model_fn` controls (it called `torch.manual_seed`, or passed a `torch.Generator` of its
  own) replays exactly: during the recording that draw is also run for real on a stand-in tensor of its size, so
  the generator advances as in an eager build, and the generator's state before the draw is kept with the
  operation (two networks seeded alike start alike; a buffer drawn from a private generator is the same whatever
  the run's seed);
- `torch.nn.init.trunc_normal_`, a rejection sampler whose loop reads the values it draws, is recorded as one
  operation and replayed by calling it.
"""

from __future__ import annotations

import bisect
import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

EMPTY_OPS = frozenset(
    {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided"}
)
# What a replay puts in memory that `torch.empty` made: two different fills show a tensor whose value depends on it
UNSET_FILLS = (float("nan"), 1.0)


def _key(tensor: torch.Tensor) -> int:
    """The identity of `tensor`'s storage: views, `.data` and `nn.Parameter` wrappers of one tensor share it."""
    return tensor.untyped_storage()._cdata


def is_fake(value: Any) -> bool:
    """Whether `value` is a tensor of torch's FakeTensorMode (shape and device, no memory)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)


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


@dataclass(frozen=True)
class PythonOp:
    """A Python function recorded as one operation (its body cannot be recorded op by op): `fn(*args)` writes its
    first argument."""

    name: str
    fn: Callable[..., Any]


def op_name(func: Any) -> str:
    """The name of a recorded operation ("aten::empty", or a `PythonOp`'s)."""
    return func.name if isinstance(func, PythonOp) else func._schema.name


@dataclass
class _Op:
    """One recorded operation that created or wrote (fake) storage."""

    index: int
    func: Any  # an aten OpOverload or a PythonOp
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    creates: list[tuple[int, Ref]]  # (output position, its geometry) of outputs on storage no earlier op made
    reads: list[int]  # storages of every tensor argument (read or written)
    random: bool
    rng_state: torch.Tensor | None = None  # the controlled generator's state before the draw (module docstring)


@dataclass
class InitTrace:
    """The recorded construction of a model: operations, and each tensor's final value by name (parameters,
    buffers and attribute tensors, `raytrain.model_tensors` names)."""

    ops: list[_Op] = field(default_factory=list)
    writers: dict[int, list[int]] = field(default_factory=dict)  # storage -> indices of ops creating/writing it
    tensors: dict[str, Ref] = field(default_factory=dict)  # every tensor name (ties: several names)
    constants: dict[str, torch.Tensor] = field(default_factory=dict)  # names of real (not fake) tensors: values
    untraced: list[str] = field(default_factory=list)  # names whose storage no recorded operation made
    _keep: list[torch.Tensor] = field(default_factory=list)  # fake tensors kept alive: their storage ids stay unique
    _start_state: torch.Tensor | None = None  # the default generator's state when the recording began

    # -- recording -------------------------------------------------------------------------------------------
    def _ref(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            if isinstance(value, torch.device) and value.type == "meta":
                return torch.device("cpu")
            return None if isinstance(value, torch.Generator) else value
        if is_fake(value):
            self._keep.append(value)
            return Ref.of(value)
        with _disable_current_modes():  # a real copy, not a fake one
            return _Const(value.detach().clone())

    def record(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        written: list[torch.Tensor] | None = None,
        rng_state: torch.Tensor | None = None,
    ) -> None:
        """Log `func(*args, **kwargs) -> out` when it creates new (fake) storage or writes existing storage
        (`written`: the tensors a `PythonOp` writes; an aten op's are read from its schema)."""
        if written is None:
            written = []
            for position, argument in enumerate(func._schema.arguments):
                if argument.alias_info is not None and argument.alias_info.is_write:
                    value = kwargs.get(argument.name, args[position] if position < len(args) else None)
                    written += [t for t in tree_flatten(value)[0] if is_fake(t)]
        leaves = tree_flatten(out)[0]
        creates: list[tuple[int, Ref]] = []
        for position, t in enumerate(leaves):  # by position: outputs of one shape are told apart (sort, var_mean)
            if is_fake(t) and _key(t) not in self.writers and all(r.storage != _key(t) for _, r in creates):
                creates.append((position, Ref.of(t)))
        if not creates and not written:
            return  # a view, or an operation whose result is not kept: nothing to replay
        op_args, op_kwargs = tree_map(self._ref, args), tree_map(self._ref, kwargs)
        reads = [r.storage for r in tree_flatten((op_args, op_kwargs))[0] if isinstance(r, Ref)]
        random = isinstance(func, PythonOp) or torch.Tag.nondeterministic_seeded in func.tags
        op = _Op(len(self.ops), func, op_args, op_kwargs, creates, reads, random, rng_state)
        self.ops.append(op)
        for storage in dict.fromkeys([r.storage for _, r in creates] + [_key(t) for t in written]):
            self.writers.setdefault(storage, []).append(op.index)
        self._keep += [t for t in leaves if is_fake(t)]

    def controlled_draw(self, run: Callable[[], Any], generator: torch.Generator | None) -> torch.Tensor | None:
        """For a random operation about to be recorded: when its generator is one `model_fn` controls (`generator`
        given, or the default one seeded since the recording began), its state now, after which `run()` performs
        the draw for real (on stand-in tensors) so the generator advances as it would eagerly; else None."""
        with _disable_current_modes():  # real tensors: the fake mode must not see the states or the draw
            if generator is None:
                assert self._start_state is not None, "the recording's start state is set by `recording`"
                state = torch.random.get_rng_state()
                if torch.equal(state, self._start_state):
                    return None
            else:
                state = generator.get_state()
            run()
        return state

    def name_final(self, name: str, tensor: torch.Tensor) -> None:
        """Record that the model's tensor `name` is `tensor` at the end of `model_fn` (after it returned)."""
        if not is_fake(tensor):
            self.constants[name] = tensor.detach().clone()
        elif _key(tensor) in self.writers:
            self.tensors[name] = Ref.of(tensor)
        else:
            self.untraced.append(name)
        self._keep.append(tensor)

    # -- replay ----------------------------------------------------------------------------------------------
    def closure(self, storage: int) -> list[int]:
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

    def reads_unset_memory(self, name: str) -> bool:
        """Whether the value of `name` is computed from memory that `torch.empty` made (its closure has such an
        operation; `value` then tells, by two fills, whether the value depends on it)."""
        ref = self.tensors[name]
        return any(op_name(self.ops[i].func) in EMPTY_OPS for i in self.closure(ref.storage))

    def value(self, name: str, seed: int, unset: float = UNSET_FILLS[0]) -> torch.Tensor:
        """The full initial value of tensor `name` on the CPU; memory that `torch.empty` made and nothing wrote
        holds `unset` (integers and bools: 0 for NaN, else 1)."""
        if name in self.constants:
            return self.constants[name]
        ref = self.tensors[name]
        real: dict[int, torch.UntypedStorage] = {}
        for index in self.closure(ref.storage):
            self._run(self.ops[index], real, seed, unset)
        return ref.on(real[ref.storage])  # a view: it keeps the replayed storage alive, nothing else

    def _run(self, op: _Op, real: dict[int, torch.UntypedStorage], seed: int, unset: float) -> None:

        def tensor(value: Any) -> Any:
            if isinstance(value, Ref):
                return value.on(real[value.storage])
            return value.value.clone() if isinstance(value, _Const) else value  # a copy: the op may write it

        args, kwargs = tree_map(tensor, op.args), tree_map(tensor, op.kwargs)
        if op.rng_state is not None:
            with torch.random.fork_rng(devices=[]):
                torch.random.set_rng_state(op.rng_state)
                out = _call(op.func, args, kwargs)
        elif op.random:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(op_seed(seed, op.index))
                out = _call(op.func, args, kwargs)
        else:
            out = _call(op.func, args, kwargs)
        leaves = tree_flatten(out)[0]
        if op_name(op.func) in EMPTY_OPS:  # never garbage: deterministic; `unset` shows what nothing wrote
            whole = 0 if math.isnan(unset) else 1  # integers and bools: 0 for the first fill, 1 for the second
            for t in leaves:
                if isinstance(t, torch.Tensor):
                    t.fill_(unset if t.is_floating_point() or t.is_complex() else whole)
        for position, ref in op.creates:
            made = leaves[position] if position < len(leaves) else None
            if not isinstance(made, torch.Tensor) or (
                tuple(made.shape),
                tuple(made.stride()),
                made.storage_offset(),
                made.dtype,
            ) != (ref.size, ref.stride, ref.offset, ref.dtype):
                raise ValueError(f"replaying {op_name(op.func)} gave other outputs than on the meta device")
            real.setdefault(ref.storage, made.untyped_storage())


def _call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return func.fn(*args, **kwargs) if isinstance(func, PythonOp) else func(*args, **kwargs)


def op_seed(seed: int, index: int) -> int:
    """The generator seed of the recorded random operation number `index`: a function of the run's seed and the
    operation's place in the construction log only."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


def _stand_in(value: Any) -> Any:
    """A real zero tensor of a fake one's size, strides and dtype (what a draw writes into; its values do not
    change how far the generator advances)."""
    if is_fake(value):
        return torch.zeros_like(torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cpu"))
    return value


class Recorder(TorchDispatchMode):
    """Logs every operation into `trace` (inside FakeTensorMode: `recording`)."""

    def __init__(self, trace: InitTrace, memo: Any) -> None:
        super().__init__()
        self.trace, self.memo = trace, memo

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        state = None
        if torch.Tag.nondeterministic_seeded in func.tags:
            generator = kwargs.get("generator") or next((a for a in args if isinstance(a, torch.Generator)), None)

            def draw() -> Any:
                return func(*tree_map(_stand_in, args), **tree_map(_stand_in, kwargs))

            state = self.trace.controlled_draw(draw, generator)
        self.trace.record(func, args, kwargs, out, rng_state=state)
        # FakeTensorMode remembers tensors it made by weak reference, and torch refuses to swap a tensor that has
        # one: `module.to(dtype)` in model_fn would fail. The recording never needs those memories.
        self.memo.clear()
        return out


_TRUNC_NORMAL = torch.nn.init._no_grad_trunc_normal_


def _trunc_normal(
    tensor: torch.Tensor, mean: float, std: float, a: float, b: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    return _TRUNC_NORMAL(tensor, mean, std, a, b, generator=generator)


TRUNC_NORMAL = PythonOp("torch.nn.init.trunc_normal_", _trunc_normal)


@contextlib.contextmanager
def recording(trace: InitTrace) -> Iterator[None]:
    """The context `model_fn()` runs in to be recorded into `trace`: FakeTensorMode, the `Recorder`, the default
    generator at a known state (its changes show that `model_fn` seeds it; the caller's RNG is left as it was),
    and `trunc_normal_` recorded whole."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    fake.cache_enabled = False  # its cache holds weak references too (see `Recorder`)
    recorder = Recorder(trace, fake.fake_tensor_converter.meta_converter.tensor_memo)

    def trunc_normal(
        tensor: torch.Tensor, mean: float, std: float, a: float, b: float, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        if not is_fake(tensor):
            return _TRUNC_NORMAL(tensor, mean, std, a, b, generator=generator)

        def draw() -> Any:
            return _TRUNC_NORMAL(_stand_in(tensor), mean, std, a, b, generator=generator)

        state = trace.controlled_draw(draw, generator)
        trace.record(TRUNC_NORMAL, (tensor, mean, std, a, b), {}, None, written=[tensor], rng_state=state)
        return tensor

    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(0x5EED)  # the CPU generator only (fork_rng restores it)
        torch.rand(1)  # a state no `torch.manual_seed(n)` can give: its position in the stream is not the start
        trace._start_state = torch.random.get_rng_state()
        torch.nn.init._no_grad_trunc_normal_ = trunc_normal
        try:
            with fake, recorder, warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")  # nn.Transformer
                yield
        finally:
            torch.nn.init._no_grad_trunc_normal_ = _TRUNC_NORMAL
