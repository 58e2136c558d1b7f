"""Counting the bytes a process really holds in tensors, on any device (the CPU has no allocator statistics).

`LiveBytes` is a `TorchDispatchMode`: every tensor an operator returns while it is active, from Python or from
C++ (DDP's gradient buckets, FSDP's all-gather buffers, optimizer states), is counted once per storage (the local
tensors inside a DTensor included) until the storage is freed, at its current size. `peak` is the most bytes
alive at any one time; `mark(name)` records the current and peak bytes at named points (e.g. after init, after
each micro-step). Tensors that existed before the mode was entered are not
seen: enter it before building the model.

    tracker = LiveBytes()
    with tracker:
        model = build(); ...; train_step(...)
    print(tracker.peak, tracker.marks)
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Live and peak tensor bytes of this process while the mode is active (see the module docstring).

    A storage's size is read again after every operator, not only when it is created: FSDP2 frees and re-allocates
    its unsharded parameters by resizing their storages in place (`resize_(0)` and back), which no allocation
    event would show.
    """

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, weakref.ref[torch.UntypedStorage]] = {}  # storage identity -> storage
        self.current = 0
        self.peak = 0
        self.marks: dict[str, tuple[int, int]] = {}  # name -> (bytes now, peak since the previous mark)
        self._window_peak = 0

    def _track(self, tensor: Any) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        flatten = getattr(tensor, "__tensor_flatten__", None)
        if flatten is not None:  # a wrapper subclass (DTensor): its inner tensors hold the memory
            for name in flatten()[0]:
                self._track(getattr(tensor, name))
            return
        try:
            storage = tensor.untyped_storage()
            key = storage._cdata  # the storage object itself: a data pointer is reused once resized away
        except (RuntimeError, NotImplementedError):
            return
        if storage.device.type == "meta":  # a fake tensor (it reports another device): no memory behind it
            return
        if key not in self._storages:
            self._storages[key] = weakref.ref(storage, self._forget(key))

    def _forget(self, key: int) -> Any:
        """The callback that drops `key` when its storage is freed."""

        def forget(_: object) -> None:
            self._storages.pop(key, None)

        return forget

    def _measure(self) -> int:
        total = 0
        for ref in list(self._storages.values()):
            storage = ref()
            if storage is not None:
                total += storage.nbytes()
        self.current = total
        self.peak = max(self.peak, total)
        self._window_peak = max(self._window_peak, total)
        return total

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self._measure()  # before: storages resized since the last operator (e.g. FSDP2's re-allocation)
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            self._track(tensor)
        self._measure()
        return out

    def mark(self, name: str) -> None:
        """Record (bytes alive now, the peak since the previous mark) under `name`."""
        now = self._measure()
        self.marks[name] = (now, self._window_peak)
        self._window_peak = now
