"""Fault injection, for the fault-tolerance tests and the demo: a worker kills itself (SIGKILL, as the OOM killer or
a lost node would) at a chosen rank, step and phase, once.

    RAYTRAIN_FAULTS="1:12:backward,0:30:checkpoint"   rank:step:phase, comma-separated
    RAYTRAIN_FAULTS="random:7:5:60"                   5 faults, seeded by 7, at steps 2..60, random ranks and phases

Phases: forward (before a micro-step's forward), backward (between forward and backward), optimizer (after the last
backward, before the update), checkpoint (the checkpoint of the step begun: the shard copied, its files being
written in the background, not yet reported), report (that checkpoint reported, not yet committed; this happens
after a later step). Live mode (`raytrain.live.worker`) has the same phases; its rank and world are the step's
quorum rank and participants; its checkpoint is the quorum's rank 0 about to send a live checkpoint to the run's
log, its report right after the call that sends it (the checkpoint may then be lost with the process); only rank 0
sends checkpoints, so a checkpoint or report fault fires in live mode only for a rank r with r % W = 0. "step" is
the optimizer step being trained (1-based, as in metrics.jsonl), for checkpoint and report the step of the
checkpoint; a fault for rank r fires on rank r % W. Each fault fires once per run: the firing rank records it in
`<run>/faults_fired.jsonl` before it dies, so the replay of that step after the restart goes through. Without the
variable every `fault_point` is a no-op (one dictionary lookup).
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass

import numpy as np

from raytrain.errors import ConfigError

ENV = "RAYTRAIN_FAULTS"
PHASES = ("forward", "backward", "optimizer", "checkpoint", "report")
FIRED_FILE = "faults_fired.jsonl"


@dataclass(frozen=True)
class Fault:
    """Kill rank `rank` % W when it reaches `phase` of optimizer step `step`."""

    rank: int
    step: int
    phase: str


def parse_faults(text: str) -> list[Fault]:
    """The faults `RAYTRAIN_FAULTS` describes (see the module docstring); `ConfigError` naming a bad item."""
    text = text.strip()
    if not text:
        return []
    if text.startswith("random:"):
        try:
            _, seed, count, last = text.split(":")
            rng = np.random.default_rng(int(seed))
            steps = sorted(rng.choice(np.arange(2, int(last) + 1), size=int(count), replace=False).tolist())
        except ValueError as err:
            raise ConfigError(
                f"{ENV} must be 'random:SEED:COUNT:LAST_STEP' with COUNT <= LAST_STEP - 1, got {text!r}: {err}"
            ) from None
        return [Fault(int(rng.integers(0, 1 << 16)), step, PHASES[int(rng.integers(len(PHASES)))]) for step in steps]
    faults = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in PHASES:
            raise ConfigError(
                f"{ENV} items must be RANK:STEP:PHASE with PHASE in {', '.join(PHASES)}, got {item.strip()!r}"
            )
        faults.append(Fault(int(parts[0]), int(parts[1]), parts[2]))
    return faults


class Injector:
    """The faults of this worker process: armed at the start of a worker group, told the step, asked at each
    phase. Not thread-safe; one per process (`arm`)."""

    def __init__(self, faults: list[Fault], run_dir: str, rank: int, world_size: int) -> None:
        self.faults, self.run_dir, self.rank, self.world_size = faults, run_dir, rank, world_size
        self.step = 0
        fired = self._fired()
        self.pending = {i: fault for i, fault in enumerate(faults) if i not in fired}

    def _fired(self) -> set[int]:
        """The faults some process of this run has fired (`FIRED_FILE`)."""
        path = os.path.join(self.run_dir, FIRED_FILE)
        if not os.path.exists(path):
            return set()
        with open(path) as f:
            return {json.loads(line)["fault"] for line in f if line.strip()}

    def check(self, phase: str, step: int | None = None) -> None:
        """SIGKILL this process if a pending fault is due here (at `step`, default the step being trained) and no
        other process of the run fired it since this one was armed (live mode: a survivor redoing the step a
        killed replica died in, now at another rank); record it first."""
        step = self.step if step is None else step
        for index, fault in list(self.pending.items()):
            if fault.step == step and fault.phase == phase and fault.rank % self.world_size == self.rank:
                if index in self._fired():
                    del self.pending[index]
                    continue
                with open(os.path.join(self.run_dir, FIRED_FILE), "a") as f:
                    f.write(json.dumps({"fault": index, "rank": self.rank, "step": step, "phase": phase}) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                os.kill(os.getpid(), signal.SIGKILL)


_injector: dict[str, Injector] = {}


def arm(run_dir: str | None, rank: int, world_size: int) -> None:
    """Read `RAYTRAIN_FAULTS` at the start of a worker group (no-op without it or without a run directory)."""
    _injector.pop("active", None)
    text = os.environ.get(ENV, "")
    if text and run_dir:
        _injector["active"] = Injector(parse_faults(text), run_dir, rank, world_size)


def at_step(step: int, rank: int | None = None, world_size: int | None = None) -> None:
    """The loop is training optimizer step `step` (1-based) now; live mode also passes the step's rank and world
    (its quorum's), which change from step to step."""
    injector = _injector.get("active")
    if injector is not None:
        injector.step = step
        if rank is not None and world_size is not None:
            injector.rank, injector.world_size = rank, world_size


def fault_point(phase: str, step: int | None = None) -> None:
    """A place a fault may strike; a no-op unless `arm` found faults for this run. `step`: the step the phase
    belongs to when it is not the one being trained (a checkpoint reported after a later step than its own)."""
    injector = _injector.get("active")
    if injector is not None:
        injector.check(phase, step)
