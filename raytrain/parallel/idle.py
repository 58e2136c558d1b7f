"""Parameters that sit out a step: an expert of a mixture of experts that got no token on this rank, a branch not
taken. raytrain trains such models at every strategy and world size with no setting:

- *The convention.* A trainable parameter that no sample of a step used gets a zero gradient, at every W (W = 1
  included): what DDP gives a parameter unused on one rank, and FSDP, Megatron and DeepSpeed give every idle one.
  AdamW then still decays it and moves it by its momentum, identically at every W (a plain one-process loop leaves
  its gradient None, and AdamW skips it). `fill_missing_grads` applies it before the gradient norm.
- *ddp, zero1.* DDP's reducer all-reduces a bucket once every parameter in it has its gradient, so a parameter
  that this rank's last backward did not reach would leave its bucket waiting while the other ranks all-reduce
  theirs. torch's `find_unused_parameters=True` walks the autograd graph and adds a collective every step (+12 %
  on the overhead benchmark's step, measured). Instead `ddp_sync` notes which parameters the sync micro-step's
  backward reaches (a post-accumulate-grad hook each) and, after it, backpropagates a zero through every other
  one: their buckets complete and every rank's all-reduces match. A model that uses every parameter pays one
  Python call per parameter per backward, nothing more.
- *zero2, zero3.* FSDP2 reduce-scatters a zero for a parameter without a gradient (`set_reduce_scatter_unused_params`,
  set by `raytrain.parallel.apply`), but each FSDP unit's all-gather is a collective every rank must enter: a module
  called on some forwards only must not be a unit. The driver finds such modules by running a few forwards on
  sample rows (`conditional_modules`); the units leave them to their parent. `UnitCalls` counts the units' calls
  on every rank and the step's loss collective compares them, so a unit called on some ranks only (its all-gather
  paired with another unit's) stops the run naming the step before the update, instead of training on the mix.
"""

from __future__ import annotations

import contextlib
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

Batch = dict[str, torch.Tensor]


def fill_missing_grads(parameters: Iterable[torch.Tensor]) -> None:
    """Give every trainable parameter without a gradient a zero one (the convention above)."""
    for p in parameters:
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def zero_grads(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Zero the gradients for a new step: in place under DDP, whose gradients are views of its buckets (set to
    None they would be allocated anew beside the buckets while micro-steps accumulate: 4 bytes per parameter more),
    else set to None."""
    optimizer.zero_grad(set_to_none=not isinstance(model, nn.parallel.DistributedDataParallel))


class _Reached:
    """Which of a DDP model's trainable parameters received a gradient while `armed` (a post-accumulate-grad hook
    each: a gradient's version counter cannot tell, DDP's gradients being views of shared buckets)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params, self.armed, self.hit = params, False, [False] * len(params)
        for index, p in enumerate(params):
            p.register_post_accumulate_grad_hook(self._hook(index))

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def reached(_: torch.Tensor) -> None:
            if self.armed:
                self.hit[index] = True

        return reached


_REACHED: weakref.WeakKeyDictionary[nn.Module, _Reached] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def ddp_sync(model: nn.parallel.DistributedDataParallel) -> Iterator[None]:
    """Around the micro-step whose backward DDP synchronises: afterwards every trainable parameter the backward did
    not reach gets a zero backpropagated through it, so DDP's buckets complete (module docstring). Then DDP's
    one-time rebuild of its buckets (by the order gradients arrived) runs here, before the optimizer's first step
    allocates its state, not at the next forward: the old and new buckets then never sit beside that state."""
    if model not in _REACHED:
        _REACHED[model] = _Reached([p for p in model.parameters() if p.requires_grad])
    reached = _REACHED[model]
    reached.hit, reached.armed = [False] * len(reached.params), True
    try:
        yield
    finally:
        reached.armed = False
    idle = [p for p, hit in zip(reached.params, reached.hit, strict=True) if not hit]
    if idle:
        torch.autograd.backward([(p * 0).sum() for p in idle])
    model.reducer._rebuild_buckets()  # a no-op after the first time


def conditional_modules(
    model: nn.Module, forward: Callable[[nn.Module, Batch], Any], batches: Sequence[Batch]
) -> list[str]:
    """The modules of `model` that could be FSDP units (its direct children, and the children of a list of
    blocks of one class, each callable and owning parameters) that `forward(model, batch)` does not call alike on
    every batch: called a different number of times on two batches (a branch some inputs or steps take), never
    on the sample (it may be later), or one of a list of blocks whose children are not all called equally often
    (experts: a few reached per token). Outermost only. Run on the driver with a few sample rows, one by one and
    together; raises what `forward` raises."""
    calls: dict[str, int] = {}
    counted: list[dict[str, int]] = []
    named = [(name, module) for name, module in model.named_modules() if name]
    handles = [
        module.register_forward_pre_hook(lambda *_, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
        for name, module in named
    ]
    try:
        with torch.no_grad():
            for batch in batches:
                calls.clear()
                forward(model, batch)
                counted.append(dict(calls))
    finally:
        for handle in handles:
            handle.remove()

    def matters(module: nn.Module) -> bool:  # callable (not a ModuleList or ModuleDict), and owns parameters
        return type(module).forward is not nn.Module.forward and any(True for _ in module.parameters())

    def varies(names: list[str]) -> bool:  # not one count for all of them on every batch, or never called
        seen = {c.get(name, 0) for c in counted for name in names}
        return len(seen) > 1 or seen == {0}

    found = [name for name, child in model.named_children() if matters(child) and varies([name])]
    for name, module in named:
        children = [f"{name}.{child}" for child, _ in module.named_children()]
        kinds = {type(child) for child in module.children()}
        blocks = isinstance(module, nn.ModuleList | nn.Sequential) and len(kinds) == 1 and len(children) > 1
        if blocks and matters(next(module.children())) and varies(children):
            found += children  # experts: some reached per token
    found = list(dict.fromkeys(found))
    return [name for name in found if not any(name.startswith(outer + ".") for outer in found)]


def describe_conditional(names: Sequence[str]) -> str:
    """The driver's line for the modules `conditional_modules` found."""
    shown = ", ".join(names[:6]) + (f", ... ({len(names) - 6} more)" if len(names) > 6 else "")
    return (
        f"not called alike on every forward of the sample rows (an expert, a branch): {shown}; with zero2/zero3 "
        "none of them is an "
        "FSDP unit of its own (a unit's all-gather needs every rank); a parameter no sample uses gets a zero gradient"
    )


class UnitCalls:
    """How often each FSDP unit ran its forward since the last `signature` (one forward-pre-hook per unit)."""

    def __init__(self, units: Sequence[nn.Module]) -> None:
        self.counts = [0] * len(units)
        self._handles = [unit.register_forward_pre_hook(self._hook(i), prepend=True) for i, unit in enumerate(units)]

    def _hook(self, index: int) -> Callable[..., None]:
        def count(*_: Any) -> None:
            self.counts[index] += 1

        return count

    def signature(self) -> float:
        """A number equal on two ranks when their units ran equally often since the last call (then reset); a
        float64 integer below 2^31, to ride in the step's all-gather."""
        value = zlib.crc32(",".join(map(str, self.counts)).encode())
        self.counts = [0] * len(self.counts)
        return float(value)
