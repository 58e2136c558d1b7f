"""Experiment tracking on rank 0: metrics to TensorBoard, or to any tracker with three methods.

    trainer = ElasticTrainer(..., trackers=[TensorBoard()])      # pip install 'raytrain[tensorboard]'
    tensorboard --logdir raytrain_runs/<run>/tensorboard

A tracker is built on the driver, shipped to the workers with the job, and used on rank 0 only:
`start(run_dir, restored_step)` at every (re)start of the worker group, `log(metrics, step)` once per optimizer
step (the numeric values of the metrics.jsonl line), `finish()` at the end of the worker group's training. Steps
after a restored checkpoint are trained again; TensorBoard drops its records of them (`purge_step`), so each
curve shows one history. To use MLflow, Weights & Biases or anything else, write such a class (see README);
the loop does not change.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from raytrain.errors import ConfigError


@runtime_checkable
class Tracker(Protocol):
    """What raytrain calls on a tracker, on rank 0 only."""

    def start(self, run_dir: str, restored_step: int) -> None:
        """A worker group (re)starts; `restored_step` optimizer steps are already done."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """The numeric metrics of optimizer step `step` (1-based, as in metrics.jsonl)."""

    def finish(self) -> None:
        """The worker group's training ended (flush and close)."""


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite int/float values of a metrics line (lists and strings left out)."""
    return {
        key: float(value)
        for key, value in metrics.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    }


def check_trackers(trackers: list[Any]) -> None:
    """`ConfigError` unless every tracker has `start`, `log` and `finish`, and can start here (e.g. its package
    is installed); called on the driver."""
    for tracker in trackers:
        if not isinstance(tracker, Tracker):
            raise ConfigError(
                f"trackers must have start(run_dir, restored_step), log(metrics, step) and finish(), got {tracker!r}"
            )
        check = getattr(tracker, "check", None)
        if callable(check):
            check()


@dataclass
class TensorBoard:
    """Every numeric metric as a TensorBoard scalar under `<run>/tensorboard` (or `log_dir`), with
    `torch.utils.tensorboard` (needs the `tensorboard` package: `pip install 'raytrain[tensorboard]'`)."""

    log_dir: str | None = None
    _writer: Any = field(default=None, init=False, repr=False)

    def check(self) -> None:
        """`ConfigError` when the tensorboard package is missing."""
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError(
                "the TensorBoard tracker needs the tensorboard package: pip install 'raytrain[tensorboard]'"
            ) from None

    def start(self, run_dir: str, restored_step: int) -> None:
        """Open the event writer; records of steps after `restored_step` (trained again now) are dropped."""
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(self.log_dir or os.path.join(run_dir, "tensorboard"), purge_step=restored_step + 1)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """One scalar per metric at `step`."""
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)

    def finish(self) -> None:
        """Flush and close the writer."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
