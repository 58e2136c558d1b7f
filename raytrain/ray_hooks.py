"""raytrain's hooks into Ray Train's controller: the one module that uses Ray Train's internal (non-public) names.

Ray Train V2 accepts controller and worker-group callbacks through `RunConfig(callbacks=[...])` (its own
comments call this the way to build workarounds on internal callbacks), but their base classes live under
`ray.train.v2._internal`. Everything that depends on those names is here, and `tests/test_ray_hooks.py` fails
loudly if a Ray upgrade renames or reshapes them; `pyproject.toml` pins Ray to the 2.x range tested.

    StopRepeatedUserErrors   end the run when the same marked exception recurs at the same step (a bug)
"""

from __future__ import annotations

from typing import Any

from ray.train.v2._internal.execution.callback import WorkerGroupCallback
from ray.train.v2.api.exceptions import ControllerError

from raytrain.errors import UserCodeError
from raytrain.failures import Signature, signature


class StopRepeatedUserErrors(WorkerGroupCallback):
    """Runs in the Ray Train controller. After every poll of the worker group it reads the workers' errors; the
    first one whose `raytrain.failures.signature` was already seen in an earlier attempt of the worker group
    raises `UserCodeError` (wrapped in Ray's `ControllerError`, which Ray Train does not retry), so a bug costs one
    restart, not `max_failures` of them. Errors without a signature (dead workers, lost nodes) pass untouched."""

    def __init__(self) -> None:
        self._attempt = 0
        self._first_seen: dict[Signature, int] = {}  # signature -> the attempt it was first seen in

    def after_worker_group_start(self, worker_group: Any) -> None:
        """A new attempt of the worker group (first start, restart or resize) has started."""
        self._attempt += 1

    def after_worker_group_poll_status(self, worker_group_status: Any) -> None:
        """Raise for an error seen before at the same step; remember the others."""
        for rank, error in sorted(worker_group_status.errors.items()):
            found = signature(error)
            if found is None:
                continue
            first = self._first_seen.setdefault(found, self._attempt)
            if first != self._attempt:
                raise ControllerError(
                    UserCodeError(
                        f"{found.describe(rank)}, the same in two attempts of the worker group: a bug in the "
                        "training code, not retried (the latest checkpoint is kept; fix the code and run again)"
                    )
                )
