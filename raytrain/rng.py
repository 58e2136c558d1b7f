"""The random streams of a training step: dropout and every other random op, the same at every world size.

Each micro-batch is seeded from (run seed, step, its first sample's position in the step's global layout, pipeline
stage), not from the rank that trains it. The global layout of a step does not depend on W (`BatchPlan`: replica r
takes the contiguous share after replicas 0..r-1, cut into micro-batches), so a micro-batch that holds the same
samples at another W draws the same dropout masks: with dropout, the loss curve at dp 1 equals the curve at dp 2
whenever every step is cut into the same micro-batches at both (B = 96, micro 16: sixteens at dp 1, 2, 3 and 6,
but twelves at dp 4). Where the cuts differ the masks differ (an equally valid draw): uneven shares, and with
`drop_last=False` usually an epoch's final partial step.

Inside a tensor-parallel region (from a colwise layer's output to the next rowwise layer's input: the activations
are split over the tp ranks) each tp rank draws from its own stream, as Megatron's model-parallel RNG does: the
attention heads or MLP columns of different ranks get independent masks, not one mask repeated tp times. Outside
regions (replicated activations: residual dropout, embeddings) the tp ranks draw the same values, as they must.
A region's stream is derived from the outside stream at its entry, so activation checkpointing, which restores
the outside state before recomputing a block, recomputes the same masks. Under sequence parallel the activations
between the split layers are cut along the sequence too, so the whole span from the sequence's split to its join
is one region (`install_rank_stream`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

_MASK = (1 << 64) - 1


def _mix(value: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that scatters nearby inputs."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


def stream_seed(*keys: int) -> int:
    """A 63-bit seed that is a function of `keys` (non-negative ints), well spread: different keys give unrelated
    streams (1 us a call; numpy's SeedSequence takes 20)."""
    value = 0
    for key in keys:
        value = _mix(value ^ (key & _MASK))
    return value >> 1


def micro_batch_seed(seed: int, step: int, offset: int, stage: int = 0) -> int:
    """The seed of the micro-batch whose first sample is at `offset` in step `step`'s global layout (0-based
    step index), on pipeline stage `stage`, for the run seeded `seed`."""
    return stream_seed(seed, step, offset, stage)


def cuda_generator(device: torch.device | None) -> torch.Generator | None:
    """The generator of a CUDA `device`, None for any other device."""
    if device is not None and device.type == "cuda":
        return torch.cuda.default_generators[device.index or 0]
    return None


def seed_generators(value: int, device: torch.device | None = None) -> None:
    """Seed the CPU generator and, for a CUDA `device`, that device's generator with `value` (`torch.manual_seed`
    would visit every device type: 90 us here)."""
    torch.default_generator.manual_seed(value)
    cuda = cuda_generator(device)
    if cuda is not None:
        cuda.manual_seed(value)


class MicroBatchSeeds:
    """`seeds(j)` seeds the generators for this rank's micro-batch j of one step (see the module doc): call it
    before the micro-batch's forward. `offset` is this replica's first sample in the step's layout
    (`BatchPlan.rank_offset`), `sizes` its micro-batch sizes (`BatchPlan.micro_batches[replica]`)."""

    def __init__(
        self, seed: int, step: int, offset: int, sizes: Sequence[int], stage: int, device: torch.device | None
    ) -> None:
        self.seed, self.step, self.stage, self.device = seed, step, stage, device
        self.offsets = [offset]
        for size in sizes[:-1]:
            self.offsets.append(self.offsets[-1] + size)

    def __call__(self, j: int, stage: int | None = None) -> None:
        """Seed micro-batch `j` (0-based) on this rank's pipeline stage, or on virtual stage `stage` (the
        interleaved schedule's chunks: each draws its own masks)."""
        stage = self.stage if stage is None else stage
        seed_generators(micro_batch_seed(self.seed, self.step, self.offsets[j], stage), self.device)


class TensorParallelRNG:
    """The tp-rank streams inside tensor-parallel regions of one model (see the module doc), kept by forward hooks:
    a colwise layer's output enters a region, a rowwise layer's input leaves it, the model's (or pipeline stage's)
    forward starts and ends outside. Installed by `install_tp_rng`.

    A region left open without its rowwise layer (a forward that raised, a checkpointed unit recomputed alone, which
    ends inside a region or stops early) is recognised as stale at the next hook: the CPU generator no longer holds
    the region's seed (`initial_seed()`; `MicroBatchSeeds` or checkpointing's RNG restore replaced it), so it is
    dropped without touching the generators, and a colwise output enters a fresh region from the current state."""

    def __init__(self, tp_rank: int, device: torch.device | None) -> None:
        self.tp_rank, self.device = tp_rank, device
        self._outside: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._seed = -1  # the current region's seed, -1 outside
        self.regions = 0  # regions entered so far (tests count them)

    @property
    def inside(self) -> bool:
        """Whether the generators hold a region's stream (not a stale region's: see the class doc)."""
        return self._seed >= 0 and torch.default_generator.initial_seed() == self._seed

    def enter(self, *_: Any) -> None:
        """Switch to this tp rank's stream of the region starting here (a no-op inside a region). The region's seed
        is drawn from the outside stream, identically on every tp rank, then made the rank's own."""
        if self.inside:
            return
        draw = int(torch.randint(0, 2**62, (1,), generator=torch.default_generator).item())
        cuda = cuda_generator(self.device)
        self._outside = (torch.default_generator.get_state(), cuda.get_state() if cuda is not None else None)
        self._seed = stream_seed(draw, self.tp_rank)
        seed_generators(self._seed, self.device)
        self.regions += 1

    def leave(self, *_: Any) -> None:
        """Back to the outside stream, where it was at the region's entry (a no-op outside a region; a stale region
        is only forgotten)."""
        if self.inside:
            assert self._outside is not None
            cpu, cuda_state = self._outside
            torch.default_generator.set_state(cpu)
            cuda = cuda_generator(self.device)
            if cuda is not None and cuda_state is not None:
                cuda.set_state(cuda_state)
        self._outside, self._seed = None, -1


def install_tp_rng(
    model: nn.Module, colwise: Iterable[str], rowwise: Iterable[str], tp_rank: int, device: torch.device | None
) -> TensorParallelRNG:
    """Hook `model`'s colwise modules (named in `colwise`; their outputs enter a region) and rowwise modules (their
    inputs leave it), and `model` itself (its forward starts and ends outside any region); returns the
    `TensorParallelRNG` they share. Call after `parallelize_module`, whose hooks then run first."""
    rng = TensorParallelRNG(tp_rank, device)
    # Run eagerly inside a compiled block (`compile_blocks`): generator state is not something to trace
    enter, leave = torch.compiler.disable(rng.enter), torch.compiler.disable(rng.leave)
    modules = dict(model.named_modules())
    for name in colwise:
        modules[name].register_forward_hook(enter)
    for name in rowwise:
        modules[name].register_forward_pre_hook(leave)
    model.register_forward_pre_hook(leave)
    model.register_forward_hook(leave, always_call=True)  # also when the forward raised
    return rng


def install_rank_stream(model: nn.Module, tp_rank: int, device: torch.device | None) -> TensorParallelRNG:
    """Sequence parallel's random streams: the span from the sequence's split to its join is one region of this tp
    rank's own stream (each rank holds other positions there, so every dropout mask must be its own); its caller
    (`raytrain.parallel.sequence`) enters it at the split (the seed drawn there from the shared stream identically
    on every tp rank) and leaves it at the join. `model`'s forward starts and ends outside it (also when the
    forward raised, or a pipeline stage stopped it: its hooks are then run by the pipeline). Activation
    checkpointing restores a block's entry state, so its recompute draws the same masks. Returns the region
    keeper (`enter`, `leave`)."""
    rng = TensorParallelRNG(tp_rank, device)
    leave = torch.compiler.disable(rng.leave)
    model.register_forward_pre_hook(leave)
    model.register_forward_hook(leave, always_call=True)
    return rng
