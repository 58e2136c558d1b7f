"""Learning-rate rules: the LR is a function of the global batch and the step, never of the world size.

The user states a base LR that is right at a base global batch. For the configured global batch B the peak LR is

    linear:  base_lr * B / base_batch        (Goyal et al. 2017, SGD)
    sqrt:    base_lr * sqrt(B / base_batch)  (Krizhevsky 2014; common for Adam)
    none:    base_lr

and the LR of optimizer step s is `peak * lr_factor(s, ...)`: a linear warmup from peak/warmup_steps to the peak
over the first `warmup_steps` steps (step 0 trains at peak/warmup_steps, never at 0), then

    constant: the peak
    cosine:   min + (peak - min) * (1 + cos(pi * p)) / 2      p = (s - warmup) / (total - warmup), clamped to [0, 1]
    linear:   min + (peak - min) * (1 - p)

with min = min_lr_ratio * peak, over `total_steps` (the run's length). The factor multiplies every parameter
group's own LR, so groups keep their ratios. Because W appears nowhere, a resize never changes the LR; only a
change of the *global batch* by the user does, and `describe_lr_on_resume` says how.

A resume can change the run's length in steps (more epochs or another `max_steps`; another global batch: an
epoch of N samples takes N / B steps). The schedule is then continued, not restarted, jumped or stretched:
`ScheduleClock` maps optimizer steps to *schedule steps* x. At the first start x = s and the schedule spans the
run's `total` steps. When a resume finds the run ending at another step, the clock is re-anchored at the resume
step: the warmup still ends at `warmup_steps` (x = s before it), and after it x runs linearly from where it was to
`total` at the new end, so the LR factor at the resume point is the one before it and the decay ends with the run.
With `decay_steps` fixing the schedule's length, nothing is re-anchored (x = s). A user's
`lr_schedule_fn(step, total_steps)` gets the optimizer step and the run's length now, integers: keeping its own
curve continuous across such a resume is its own.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, get_args

from raytrain.errors import ConfigError

LRRule = Literal["linear", "sqrt", "none"]
LR_RULES: tuple[str, ...] = get_args(LRRule)
LRSchedule = Literal["constant", "cosine", "linear"]
LR_SCHEDULES: tuple[str, ...] = get_args(LRSchedule)


def validate_lr_rule(rule: str) -> None:
    """Raise `ConfigError` unless `rule` is one of `LR_RULES`."""
    if rule not in LR_RULES:
        raise ConfigError(f"rule must be one of {', '.join(LR_RULES)}, got {rule!r}")


def validate_schedule(schedule: str) -> None:
    """Raise `ConfigError` unless `schedule` is one of `LR_SCHEDULES`."""
    if schedule not in LR_SCHEDULES:
        raise ConfigError(f"schedule must be one of {', '.join(LR_SCHEDULES)}, got {schedule!r}")


def _require_int(field: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{field} must be an integer >= {low}, got {value!r}")
    return value


def peak_lr(base_lr: float, base_batch: int, global_batch: int, rule: str) -> float:
    """The LR fitted to `global_batch` by `rule`, given `base_lr` is right at `base_batch`."""
    validate_lr_rule(rule)
    if not base_lr > 0:
        raise ConfigError(f"base_lr must be > 0, got {base_lr!r}")
    _require_int("base_batch", base_batch, 1)
    _require_int("global_batch", global_batch, 1)
    ratio = global_batch / base_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    return base_lr


def lr_factor(
    step: float,
    *,
    warmup_steps: int,
    schedule: str = "constant",
    total_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> float:
    """The LR of optimizer step `step` (0-based; a schedule step, possibly fractional, see `ScheduleClock`) as a
    fraction of the peak: warmup, then `schedule` (module doc).

    `total_steps` (the run's length) is needed by the decaying schedules; steps past it stay at `min_lr_ratio`.
    """
    _require_int("warmup_steps", warmup_steps, 0)
    if isinstance(step, bool) or not isinstance(step, int | float) or not step >= 0:
        raise ConfigError(f"step must be a number >= 0, got {step!r}")
    validate_schedule(schedule)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if total_steps is None:
        raise ConfigError(f"schedule {schedule!r} needs the run's total steps, got total_steps=None")
    _require_int("total_steps", total_steps, 1)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    shape = (1.0 + math.cos(math.pi * progress)) / 2 if schedule == "cosine" else 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def describe_lr_on_resume(
    *, rule: str, base_batch: int, old_global_batch: int, new_global_batch: int, old_peak: float, new_peak: float
) -> str | None:
    """The warning for a resumed run whose global batch differs from its checkpoint's (None when it does not).

    States what really happened to the peak LR: rescaled by `rule` (relative to `base_batch`), or unchanged.
    """
    if old_global_batch == new_global_batch:
        return None
    change = f"global batch changed on resume: {old_global_batch} -> {new_global_batch}"
    if math.isclose(old_peak, new_peak, rel_tol=1e-12):
        return f"{change}; peak lr unchanged at {new_peak:.3e} (rule '{rule}')"
    return (
        f"{change}; peak lr rescaled by the '{rule}' rule from base batch {base_batch}: "
        f"{old_peak:.3e} -> {new_peak:.3e}"
    )


@dataclass(frozen=True)
class ScheduleClock:
    """Maps optimizer steps to the schedule steps x that `lr_factor` reads (module docstring): x = s until a
    resume finds the run ending elsewhere. From then on the warmup keeps its steps (x = s below `warmup`) and the
    decay after it runs linearly from where it was at the resume step to `total` at the new end.

    total: the schedule's length in schedule steps (the first start's run length, or `decay_steps`); None when the
        run's length is unknown (streaming without max_steps: only constant schedules run there).
    end: the step at which the run ends now; None when the schedule's length is fixed in steps (`decay_steps`).
    anchor_step, anchor_x: the resume step that re-anchored the clock, and its schedule step.
    warmup: the warmup's length in optimizer steps (0 in a record written before it was kept: such a clock
        stretched the warmup with the rest; `resumed` gives it the configured warmup from that resume on).
    """

    total: int | None
    end: int | None
    anchor_step: int = 0
    anchor_x: float = 0.0
    warmup: int = 0

    def position(self, step: int) -> float:
        """The schedule step of optimizer step `step` (an int while nothing was re-anchored)."""
        if self.total is None or self.end is None or step < self.warmup:
            return step
        start_step, start_x = max(self.anchor_step, self.warmup), max(self.anchor_x, float(self.warmup))
        if self.end <= start_step:
            return step
        x = start_x + (step - start_step) * (self.total - start_x) / (self.end - start_step)
        return int(x) if float(x).is_integer() else x

    def decay_progress(self, step: int) -> float:
        """How far the decay after warmup has gone at optimizer step `step`, 0 to 1 (0 during warmup)."""
        if self.total is None or self.total <= self.warmup:
            return 0.0
        return min(1.0, max(0.0, (self.position(step) - self.warmup) / (self.total - self.warmup)))

    def resumed(self, step: int, fresh: ScheduleClock) -> ScheduleClock:
        """The clock of a resume at `step` given this run's `fresh` clock (as a first start would lay it out now,
        with the warmup configured now): the fresh one when the schedule's length is fixed in steps (either clock
        has no `end`), this one when the run still ends where it did, else this one re-anchored at `step` so that
        the decay continues from its position there and ends at the new end (the warmup ends at its step)."""
        if self.end is None or fresh.end is None:
            return fresh
        if float(self.position(step)) <= fresh.warmup:  # the decay has not begun: it spans the run as now laid out
            return fresh
        if fresh.end == self.end:
            return self if self.warmup == fresh.warmup else replace(self, warmup=fresh.warmup)
        return ScheduleClock(
            total=self.total, end=fresh.end, anchor_step=step, anchor_x=float(self.position(step)), warmup=fresh.warmup
        )

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint's record of the clock."""
        return asdict(self)

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> ScheduleClock:
        """A clock from `to_dict`'s record."""
        return cls(**record)


def describe_schedule_on_resume(
    before: ScheduleClock, after: ScheduleClock, step: int, total_steps: int | None, decaying: bool = True
) -> str | None:
    """The one run-length line of a resume at `step`, after its decisions (the driver says the run's length only at
    a fresh start): where the run ends now (`total_steps`), and, when that moved, where it ended before and, for a
    `decaying` schedule, how far its decay had gone and where the warmup ends. None when the run's length is
    unknown (streaming without max_steps)."""
    if total_steps is None:
        return None
    if before.end is None or after.end is None:  # the schedule's length is fixed in steps (decay_steps)
        return f"run length: resumed at step {step}, the run ends at step {total_steps}"
    if before.end == after.end:
        return f"run length: resumed at step {step}, the run ends at step {total_steps} (as before)"
    line = f"run length: resumed at step {step}, the run now ends at step {after.end} (was {before.end})"
    if not decaying:
        return line
    if step < after.warmup:
        return f"{line}: warmup ends at step {after.warmup} as set, then the LR decays to its end at step {after.end}"
    return (
        f"{line}: the LR decay continues from {before.decay_progress(step):.0%} of its way at step {step} and "
        f"reaches its end at step {after.end}"
    )
