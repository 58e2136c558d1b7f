"""Telling a bug in the user's code from a failure worth a restart.

Ray Train restarts the worker group after any worker error, up to `max_failures` times: right for a lost node or
a killed worker, minutes of identical tracebacks for a `loss_fn` that returns the wrong shape. The worker loop
marks every exception that escapes it with the optimizer step it happened at (`mark`); a controller callback
(`raytrain.ray_hooks.StopRepeatedUserErrors`) compares the marked errors of each failed attempt with those of
the earlier ones, and the first exception seen again at the same step ends the run with `UserCodeError`.
A worker that dies (SIGKILL, a lost node) raises nothing in Python and is never marked: it is always retried.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

import torch

from raytrain import user_frames

STEP_ATTRIBUTE = "raytrain_step"
WHERE_ATTRIBUTE = "raytrain_where"
FATAL_ATTRIBUTE = "raytrain_fatal"
FRAMES_ATTRIBUTE = "raytrain_user_frames"  # `raytrain.user_frames.describe`: a few lines, the user's file and line
TRACEBACK_ATTRIBUTE = "raytrain_traceback"  # the whole traceback, for <run>/raytrain.log


def mark(error: BaseException, step: int, where: str) -> None:
    """Record on `error` the optimizer step (the one being trained or, at start, the one to resume from), the
    phase ("start" or "step") in which it escaped the worker loop, and its traceback rendered here (the user's
    frames, and the whole). Travels with the exception when Ray pickles it."""
    from raytrain.errors import DamagedCheckpointsError, NonFiniteError, OutOfMemory

    setattr(error, STEP_ATTRIBUTE, step)
    setattr(error, WHERE_ATTRIBUTE, where)
    setattr(error, FRAMES_ATTRIBUTE, user_frames.describe(error))
    setattr(error, TRACEBACK_ATTRIBUTE, user_frames.full(error))
    # Deterministic, or the storage's to fix: not worth even one retry.
    fatal = isinstance(error, NonFiniteError | DamagedCheckpointsError | OutOfMemory) or is_storage_error(error)
    setattr(error, FATAL_ATTRIBUTE, fatal)


STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def is_storage_error(error: BaseException) -> bool:
    """A full, read-only or forbidden storage (ENOSPC, EDQUOT, EROFS, EACCES, EPERM), anywhere in the chain."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in STORAGE_ERRNOS:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def out_of_memory(error: BaseException) -> bool:
    """An allocation failure: `MemoryError`, torch's `OutOfMemoryError`, or the CPU allocator's RuntimeError."""
    text = str(error).lower()
    return isinstance(error, MemoryError | torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)
    )


@dataclass(frozen=True)
class Signature:
    """What makes two failures "the same": exception type, the first line of its message, step and phase."""

    kind: str
    message: str
    step: int
    where: str
    fatal: bool = False  # stop at the first occurrence (a NaN or Inf), do not wait for a repeat

    def describe(self, rank: int) -> str:
        """One line for the user: what, and at which step on which rank."""
        return f"{self.kind}: {self.message} ({self.at} on rank {rank})"

    @property
    def at(self) -> str:
        """ "at step N" or "while starting at step N"."""
        return f"at step {self.step}" if self.where == "step" else f"while starting at step {self.step}"


def signature(error: BaseException) -> Signature | None:
    """The failure's signature, or None for an error the worker loop did not mark (not raised by its code)."""
    step = getattr(error, STEP_ATTRIBUTE, None)
    if step is None:
        return None
    lines = str(error).strip().splitlines()
    return Signature(
        type(error).__name__,
        lines[0] if lines else "",
        int(step),
        getattr(error, WHERE_ATTRIBUTE, "step"),
        bool(getattr(error, FATAL_ATTRIBUTE, False)),
    )


def frames_of(error: BaseException | None) -> str:
    """The user's frames the worker rendered for a marked `error` (`mark`), else rendered from its traceback here
    (an exception raised on the driver); empty when none is the user's."""
    if error is None:
        return ""
    rendered = getattr(error, FRAMES_ATTRIBUTE, None)
    return rendered if isinstance(rendered, str) else user_frames.describe(error)


def with_frames(message: str, error: BaseException | None) -> str:
    """`message`, then the user's frames of `error` (`frames_of`) on lines of their own, or `message` alone."""
    frames = frames_of(error)
    return f"{message}\n{frames}" if frames else message


def traceback_of(error: BaseException | None) -> str:
    """The whole traceback the worker rendered for a marked `error`, else its own."""
    if error is None:
        return ""
    rendered = getattr(error, TRACEBACK_ATTRIBUTE, None)
    return rendered if isinstance(rendered, str) else user_frames.full(error)
