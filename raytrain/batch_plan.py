"""The batch plan: how one fixed global batch is split over a world of W workers.

The user fixes the global (effective) batch B. For the world size that exists right now, `plan_batch` finds the
smallest number of accumulation steps k such that no micro-batch exceeds the per-worker cap m, and tells every rank
how many samples it processes in every micro-step. The sum over ranks and micro-steps is exactly B for every W in
[1, B], not only for divisors of B.

Loss-weight contract (used by the worker loop):
    every rank sums its per-sample losses over all its micro-steps and multiplies by 1/B (never by 1/k, never by
    the micro-batch mean); gradients are then SUMMED across ranks. The result is exactly the gradient of the mean
    loss over the B samples, whatever the split. DDP and FSDP *average* gradients over W, so the loop multiplies the
    local loss by W/B (`BatchPlan.loss_scale`), which turns their average back into the sum.
    Rank r's share of the update is therefore `per_rank_samples[r] / B` (`BatchPlan.loss_weight(r)`).

Within a rank, micro-steps are filled smallest first, so the last micro-step (the one that synchronises gradients)
always holds at least one sample. A rank may get 0 samples in an early micro-step when B is small relative to W*k;
it still runs that micro-step (FSDP's collectives need every rank), on an empty batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from raytrain.errors import ConfigError


def _even_split(total: int, parts: int) -> list[int]:
    """Split `total` into `parts` integers that differ by at most one, smaller ones first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i >= parts - extra else 0) for i in range(parts)]


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step of `global_batch` samples is split over `world_size` ranks.

    `micro_batches[r][j]` is the number of samples rank r processes in micro-step j (0 <= j < accumulation_steps).
    """

    global_batch: int
    micro_batch_cap: int
    world_size: int
    accumulation_steps: int
    micro_batches: tuple[tuple[int, ...], ...]

    @property
    def per_rank_samples(self) -> tuple[int, ...]:
        """Samples each rank processes per optimizer step (sums to `global_batch`)."""
        return tuple(sum(row) for row in self.micro_batches)

    @property
    def max_micro_batch(self) -> int:
        """The largest micro-batch any rank runs (never above `micro_batch_cap`)."""
        return max(max(row) for row in self.micro_batches)

    @property
    def loss_scale(self) -> float:
        """Factor for the summed per-sample loss of a rank when gradients are averaged over W (DDP/FSDP): W/B."""
        return self.world_size / self.global_batch

    def loss_weight(self, rank: int) -> float:
        """Rank `rank`'s share of the update: its samples divided by the global batch."""
        return self.per_rank_samples[rank] / self.global_batch

    def rank_offset(self, rank: int) -> int:
        """Index of rank `rank`'s first sample within the step's global batch (ranks take contiguous slices)."""
        return sum(self.per_rank_samples[:rank])

    def describe(self) -> str:
        """One line for logs, e.g. ``world 3: accumulation 2, samples/rank [32,32,32], global batch 96``."""
        samples = ",".join(str(n) for n in self.per_rank_samples)
        return (
            f"world {self.world_size}: accumulation {self.accumulation_steps}, samples/rank [{samples}], "
            f"largest micro-batch {self.max_micro_batch}, global batch {self.global_batch}"
        )

    def to_dict(self) -> dict[str, object]:
        """The plan as the JSON object `raytrain plan --json` prints for one world size."""
        return {
            "world_size": self.world_size,
            "accumulation_steps": self.accumulation_steps,
            "per_rank_samples": list(self.per_rank_samples),
            "max_micro_batch": self.max_micro_batch,
            "global_batch": self.global_batch,
        }


def _require_int(field: str, value: object, low: int, high: int | None = None) -> int:
    valid = f">= {low}" if high is None else f"in [{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        raise ConfigError(f"{field} must be an integer {valid}, got {value!r}")
    return value


def plan_batch(global_batch: int, micro_batch_cap: int, world_size: int) -> BatchPlan:
    """Split `global_batch` samples over `world_size` ranks with micro-batches of at most `micro_batch_cap`.

    Returns the plan with the smallest accumulation k = ceil(B / (m * W)). Every rank gets B // W or B // W + 1
    samples per step, spread over its k micro-steps as evenly as possible, so ranks differ by at most one sample
    in any micro-step. Raises `ConfigError` for B < 1, m < 1, or W outside [1, B] (a rank with no sample at all
    would have nothing to synchronise).
    """
    _require_int("global_batch", global_batch, 1)
    _require_int("micro_batch", micro_batch_cap, 1)
    if isinstance(world_size, int) and not isinstance(world_size, bool) and world_size > global_batch:
        raise ConfigError(
            f"world_size must be an integer in [1, global_batch={global_batch}], got {world_size}: "
            f"with more workers than samples some worker would get none"
        )
    _require_int("world_size", world_size, 1, global_batch)
    return split_step(global_batch, micro_batch_cap, world_size)


def split_step(total: int, micro_batch_cap: int, world_size: int) -> BatchPlan:
    """The same split for one step of `total` samples without the W <= B check (some ranks may get none).

    Used for an epoch's final partial step, where the loop normalises by the step's true size `total`.
    """
    steps = max(1, -(-total // (micro_batch_cap * world_size)))
    per_rank = _even_split(total, world_size)
    # Ranks with one extra sample come first, so rank 0 is never the smallest (reads naturally in logs).
    per_rank.reverse()
    micro = tuple(tuple(_even_split(n, steps)) for n in per_rank)
    return BatchPlan(total, micro_batch_cap, world_size, steps, micro)


def parse_worker_range(text: str) -> tuple[int, int]:
    """Parse ``"N"`` or ``"MIN:MAX"`` into (min, max) with 1 <= min <= max; raise `ConfigError` otherwise."""
    parts = text.split(":")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise ConfigError(f"workers must be 'N' or 'MIN:MAX' with integers >= 1, got {text!r}") from None
    if len(values) == 1:
        values = values * 2
    if len(values) != 2 or values[0] < 1 or values[1] < values[0]:
        raise ConfigError(f"workers must be 'N' or 'MIN:MAX' with 1 <= MIN <= MAX, got {text!r}")
    return values[0], values[1]
