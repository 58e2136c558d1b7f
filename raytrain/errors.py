"""Errors raytrain raises on purpose."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user-supplied setting is invalid; the message names the field, the value and the valid range."""


class UserCodeError(RuntimeError):
    """The user's code (model, loss, optimizer, schedule) raised the same exception at the same step in two worker
    group attempts: a bug, not a node or worker failure, so raytrain stops instead of retrying. The message names
    the exception, the step and the rank."""


class NonFiniteError(RuntimeError):
    """A step's loss or gradient was NaN or Inf (`LoopConfig(on_nonfinite="stop")`): the run stops at once, before
    the update; the latest checkpoint is the last good state."""

    @classmethod
    def at(cls, step: int, loss: float, grad_norm: float) -> NonFiniteError:
        """The error of optimizer step `step` (1-based) with its mean loss and gradient norm (both loops')."""
        return cls(
            f"step {step}: the loss ({loss:.4g}) or the gradient norm ({grad_norm:.4g}) is not finite; stopped "
            "before the update, the last checkpoint is the last good state (LoopConfig(on_nonfinite='skip') skips "
            "such steps instead)"
        )


class DamagedCheckpointsError(RuntimeError):
    """Every checkpoint the run could resume from is damaged (a file missing or cut short): the run stops at once,
    naming each and why, instead of loading a part or retrying."""


class OutOfMemory(RuntimeError):
    """A worker ran out of memory at a step; the message names the strategy and micro-batch to change. Not retried:
    the same step would need the same memory again."""
