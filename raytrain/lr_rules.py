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
"""

from __future__ import annotations

import math
from typing import Literal, get_args

from raytrain.errors import ConfigError

LRRule = Literal["linear", "sqrt", "none"]
LR_RULES: tuple[str, ...] = get_args(LRRule)
LRSchedule = Literal["constant", "cosine", "linear"]
LR_SCHEDULES: tuple[str, ...] = get_args(LRSchedule)


def validate_lr_rule(rule: str) -> None:
    """Raise `ConfigError` unless `rule` is one of `LR_RULES`."""
    if rule not in LR_RULES:
        raise ConfigError(f"lr_rule must be one of {', '.join(LR_RULES)}, got {rule!r}")


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
    step: int,
    *,
    warmup_steps: int,
    schedule: str = "constant",
    total_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> float:
    """The LR of optimizer step `step` (0-based) as a fraction of the peak: warmup, then `schedule` (module doc).

    `total_steps` (the run's length) is needed by the decaying schedules; steps past it stay at `min_lr_ratio`.
    """
    _require_int("warmup_steps", warmup_steps, 0)
    _require_int("step", step, 0)
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
