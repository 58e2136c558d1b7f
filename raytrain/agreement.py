"""How often the step loop's ranks agree, and on what (pure; no collective here).

Every rank of raytrain's loop must act on the same step when something only some ranks know happens: a drain
notice for a node of the group (Ray Train's preemption watcher tells each worker on its own), the background
writes of a checkpoint finishing (each rank's own files), and the slowest rank's wait for data (a metric). The
loop agrees on these by maxing a few floats over every rank, in the step's loss collective: an all-gather of
1 + 4 floats instead of the all-reduce of one float a step needs anyway. On gloo (CPU) that all-gather cost
0.3-0.9 ms a step more than the all-reduce on a 2-core machine (median 0.46 ms of a 10 ms step; measurements in
docs/architecture.md, "Recovery"), so the loop agrees
about once every `AGREE_PERIOD_S` seconds of training rather than at every step: a step longer than the period
agrees every time, a short one every few steps (never more than `AGREE_MOST_STEPS` apart). How many steps to the
next agreement follows from the last agreement's values alone (the slowest rank's seconds over the steps since
the one before), so every rank counts the same steps without a word more. While a checkpoint is being written
the loop agrees at every step (`raytrain.worker_loop.begin_step`), so it is reported as soon as every rank's files
are written, as before: what the period delays is the answer to a drain, by at most one period of training
(clouds give 30 s to 2 min of notice), and the slowest data wait, reported per period instead of per step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

AGREE_PERIOD_S = 1.0  # seconds of training between two agreements (every step when a step takes longer)
AGREE_MOST_STEPS = 100  # steps between two agreements at most, however short a step is


def steps_until_agreement(
    seconds: float, steps: int, period_s: float = AGREE_PERIOD_S, most: int = AGREE_MOST_STEPS
) -> int:
    """The number of steps from one agreement to the next (1: the very next step agrees), such that agreements
    come about every `period_s` seconds: the last `steps` steps took `seconds` (the slowest rank's, as agreed, so
    every rank gets the same number). 1 when the steps take longer than the period or nothing is known yet
    (`steps` < 1, `seconds` not a positive finite number); at most `most`."""
    if steps < 1 or not (math.isfinite(seconds) and seconds > 0):
        return 1
    return max(1, min(most, int(period_s * steps / seconds)))


@dataclass
class AgreementClock:
    """One rank's count of steps to the next agreement and what it adds up for it (the data wait, the time)."""

    spacing: int = 1  # steps from the last agreement to the next (1: every step agrees)
    steps: int = 0  # steps trained since the last agreement
    waited_s: float = 0.0  # this rank's wait for data over those steps
    since: float = field(default_factory=time.perf_counter)  # when the last agreement was (this rank's clock)

    @property
    def due(self) -> bool:
        """Whether the step about to be trained ends with an agreement."""
        return self.steps + 1 >= self.spacing

    def values(self, drain_deadline: float, unwritten: bool) -> list[float]:
        """This rank's side of an agreement (each maxed over the ranks): the drain deadline (UNIX seconds, 0 when
        unknown, -1 without a notice), whether this rank's files of the checkpoint in progress are unwritten, its
        wait for data since the last agreement and the seconds since then (the steps' pace)."""
        return [drain_deadline, float(unwritten), self.waited_s, time.perf_counter() - self.since]

    def waited(self, data_wait_s: float) -> None:
        """This rank waited `data_wait_s` for the data of the step about to be trained."""
        self.waited_s += data_wait_s

    def stepped(self, agreed: list[float] | None) -> None:
        """Count a trained step; `agreed` is its agreement's maxed values (`values`' order) when it agreed, else
        None."""
        self.steps += 1
        if agreed is None:
            return
        self.spacing = steps_until_agreement(agreed[3], self.steps)
        self.steps, self.waited_s, self.since = 0, 0.0, time.perf_counter()
