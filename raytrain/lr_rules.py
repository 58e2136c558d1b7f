"""Learning-rate rules: the LR is a function of the global batch and the step, never of the world size.

The user states a base LR that is right at a base global batch. For the configured global batch B the peak LR is

    linear:  base_lr * B / base_batch        (Goyal et al. 2017, SGD)
    sqrt:    base_lr * sqrt(B / base_batch)  (Krizhevsky 2014; common for Adam)
    none:    base_lr

and the LR ramps linearly from peak/warmup_steps to the peak over the first `warmup_steps` optimizer steps
(step 0 trains at peak/warmup_steps, never at 0). Because W does not appear anywhere, a resize never changes
the LR; only a change of the *global batch* by the user does, and `lr_change_on_resume` describes it.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

from raytrain.errors import ConfigError

LRRule = Literal["linear", "sqrt", "none"]
LR_RULES: tuple[str, ...] = get_args(LRRule)


def validate_lr_rule(rule: str) -> None:
    """Raise `ConfigError` unless `rule` is one of `LR_RULES`."""
    if rule not in LR_RULES:
        raise ConfigError(f"lr_rule must be one of {', '.join(LR_RULES)}, got {rule!r}")


def peak_lr(base_lr: float, base_batch: int, global_batch: int, rule: str) -> float:
    """The LR fitted to `global_batch` by `rule`, given `base_lr` is right at `base_batch`."""
    validate_lr_rule(rule)
    if not base_lr > 0:
        raise ConfigError(f"base_lr must be > 0, got {base_lr!r}")
    for field, value in (("base_batch", base_batch), ("global_batch", global_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{field} must be an integer >= 1, got {value!r}")
    ratio = global_batch / base_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    return base_lr


def lr_at_step(step: int, peak: float, warmup_steps: int) -> float:
    """LR for optimizer step `step` (0-based): linear warmup to `peak` over `warmup_steps`, then constant."""
    if warmup_steps < 0:
        raise ConfigError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
    if step < 0:
        raise ConfigError(f"step must be >= 0, got {step!r}")
    if warmup_steps == 0 or step >= warmup_steps:
        return peak
    return peak * (step + 1) / warmup_steps


def lr_change_on_resume(
    base_lr: float, base_batch: int, rule: str, old_global_batch: int, new_global_batch: int
) -> str | None:
    """A warning sentence when a resumed run's global batch differs from its checkpoint's, else None."""
    if old_global_batch == new_global_batch:
        return None
    old = peak_lr(base_lr, base_batch, old_global_batch, rule)
    new = peak_lr(base_lr, base_batch, new_global_batch, rule)
    return (
        f"global batch changed on resume: {old_global_batch} -> {new_global_batch}; "
        f"peak lr rescaled by the '{rule}' rule: {old:.3e} -> {new:.3e}"
    )
