"""The driver of a live run (`ClusterConfig(recovery="live")`): a torchft lighthouse, dp_shard x tp Ray actors per
replica group, a replacement for every group lost, a successor for every group on a drained node, and the fallback
to a restart when live mode cannot go on.

    lighthouse (driver process)         forms each step's quorum of the replica groups alive
    LiveLog actor (driver's node)       writes metrics, samples, events, checkpoints (rank 0 of each step sends)
    LiveWorker actors, dp_shard x tp a group, train (a group of several on one node: a placement group); a lost group
                                        is replaced, the others never stop

What the driver does when a worker is lost (its actor dies: a SIGKILL, an OOM kill, its node gone): it stops the
rest of its group, nothing to the others. Their collective of that step fails, the step is not committed, and the
next quorum (the lighthouse drops the dead group after its heartbeat timeout) redoes the step with the same samples
split over the survivors. The driver starts a replacement group, which heals from a peer (model, optimizer, step:
each rank its shard from the same rank of a healthy group) and takes part from the next quorum on. Ray Train's
controller is not involved: it would restart every worker.

A drain (Ray's `DrainNode`: a spot notice, a scale-down; polled every `DRAIN_POLL_S`) is make before break: a
group with a worker on the draining node gets a successor at once, and leaves at a step boundary (nothing trained
again) once the successor trains, or `DRAIN_MARGIN_S` (or three steps) before the deadline when it cannot be placed.

The fallback: when no group is left, or fewer than `min_workers` are alive and no replacement could be placed
within `REPLACE_PATIENCE_S` (the node is gone, the cluster is full), the driver says why in one line, stops the
groups left, and starts anew from the newest checkpoint (of either recovery mode: one format): the restart path,
with the work since that checkpoint lost. If `min_workers` cannot be placed within `START_TIMEOUT_S` then, the run
stops with `TimeoutError`. Every group lost and every fallback counts against `max_failures` (a drain does not); an
exception from the user's code in a worker stops the run at once (a worker that dies while starting loses its
group, counted, with its cause in the log). Growth needs nothing special: a group that could not be placed (up to
`max_workers`) waits for room and joins live when a node arrives.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from raytrain.checkpoint_files import live_checkpoints, newest_checkpoint
from raytrain.console import append_line, is_quiet, say
from raytrain.live.log import LiveLog, read_train_state
from raytrain.live.replica import LiveReplicaLost
from raytrain.live.worker import LiveOutcome, LiveSettings, LiveWorker
from raytrain.start_watch import REPEAT_S, SAY_AFTER_S, describe_actor_wait
from raytrain.worker_loop import WorkerJob

HEARTBEAT_TIMEOUT_MS = 1000  # the lighthouse drops a replica silent this long: the survivors' pause after a kill
JOIN_TIMEOUT_MS = 500  # a quorum waits this long for replicas that are up but not yet asking
START_TIMEOUT_S = 60.0  # min_workers replicas must be placed and built within this (Ray Train's default)
REPLACE_PATIENCE_S = 30.0  # below min_workers, wait this long for a replacement before falling back
DRAIN_POLL_S = 1.0  # how often the driver asks the GCS for nodes being drained
DRAIN_MARGIN_S = 3.0  # a drained group without a successor leaves this long (or 3 steps) before the deadline
DRAIN_NO_DEADLINE_S = 30.0  # a drain without a deadline: leave within this long when no successor is ready


def get_said(
    ref: Any,
    actor: Any,
    words: str,
    call: str,
    run_dir: str,
    say_after_s: float = SAY_AFTER_S,
    repeat_s: float = REPEAT_S,
) -> Any:
    """`ray.get(ref)` of a call to `actor` (`words` names it, e.g. "raytrain's live log actor"), waited for with a
    word: after `say_after_s`, then every `repeat_s`, one line on what the GCS knows of the actor
    (`describe_actor_wait`), in the run's log and on the console where no log tail prints it. A line that cannot be
    written is skipped (the wait goes on). Returns what the call returned; raises what `ray.get` raises."""
    import ray

    from raytrain.ray_hooks import actor_id, actor_record

    started, next_say = time.monotonic(), say_after_s
    while not ray.wait([ref], timeout=max(0.0, started + next_say - time.monotonic()))[0]:
        waited = time.monotonic() - started
        ident = actor_id(actor)
        record = actor_record(ident) if ident is not None else None
        line = describe_actor_wait(words, call, waited, ident, record, time.time() * 1000, repeat_s)
        try:
            append_line(run_dir, f"[raytrain] {line}")
            if not is_quiet():  # else the run's log tail prints it
                say(line)
        except OSError:  # the run directory gone, a full disk: the run is not this line's to fail
            pass
        next_say = waited + repeat_s
    return ray.get(ref)


def wait_one_until(refs: list[Any], deadline: float) -> list[Any]:
    """The refs of `refs` ready by the `time.monotonic()` deadline, returning as soon as one is: `ray.wait` with
    the time left, never a negative timeout. Ray refuses a negative one with a ValueError, and a loop that checks
    the deadline and then computes the time left gets one: `ray.wait` truncates its timeout to whole milliseconds
    and returns up to 1 ms before the deadline, so the check passes and the time left is below zero."""
    import ray

    return ray.wait(refs, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))[0]


@dataclass
class _Replica:
    """A replica group's actors (one per rank: dp_shard x tp of them) and where it stands: `ready` (each rank's
    `build`) until built, then `running` (each rank's `run`)."""

    index: int
    generation: int
    actors: list[Any]
    ready: dict[Any, int]  # each rank's `build` ref not yet returned -> its rank
    started: float
    built: dict[int, tuple[int, str]] = field(default_factory=dict)  # rank -> (pid, node) once built
    running: dict[Any, int] = field(default_factory=dict)  # each rank's `run` ref not yet returned -> its rank
    launched: bool = False
    leave_by: float | None = None  # a node of its is being drained: leave by this time (monotonic) at the latest
    successor: str | None = None  # the group started to take over from this one (a drain)
    leaving: bool = False  # asked to leave at its next step boundary
    placement: Any = None  # the placement group keeping a group of several workers on one node

    @property
    def pids(self) -> list[int]:
        """Every built rank's process id, in rank order."""
        return [self.built[rank][0] for rank in sorted(self.built)]

    @property
    def nodes(self) -> list[str]:
        """Every built rank's Ray node id, in rank order."""
        return [self.built[rank][1] for rank in sorted(self.built)]

    @property
    def name(self) -> str:
        return f"r{self.index}" if self.generation == 0 else f"r{self.index}.{self.generation}"

    @property
    def pid(self) -> int | None:
        """The process id of its rank 0 (None while it starts); `pids` has every rank's."""
        return self.pids[0] if self.pids else None

    def who(self) -> str:
        """The group for log lines: "replica r1 (pid 123)", "replica r1 (pids 123, 124)", "(starting)"."""
        if not self.pids:
            return f"replica {self.name} (starting)"
        if len(self.pids) == 1:
            return f"replica {self.name} (pid {self.pids[0]})"
        return f"replica {self.name} (pids {', '.join(map(str, self.pids))})"


@dataclass
class LiveResult:
    """What a live run did: every replica's outcome (the survivors'; a lost replica has none), the replicas
    lost (name, pid, step, time), the fallbacks to a restart (why, the step reached, the checkpoint step restored),
    and the newest live checkpoint."""

    outcomes: list[LiveOutcome]
    lost: list[dict[str, Any]] = field(default_factory=list)
    left: list[dict[str, Any]] = field(default_factory=list)  # groups that left ahead of a drain: name, pids, step
    fallbacks: list[dict[str, Any]] = field(default_factory=list)  # reason, at_step, restored_step
    checkpoint: str | None = None

    @property
    def restarts(self) -> int:
        """Fallbacks to a restart (the replicas that survive a loss never restart)."""
        return len(self.fallbacks)


class LiveRun:
    """One live run (see the module docstring). `fit` blocks until the run's last step; `kill_replica` SIGKILLs a
    replica's process (the demo's and the benchmark's kill events)."""

    def __init__(self, job: WorkerJob, run_dir: str) -> None:
        self.job, self.run_dir = job, run_dir
        cluster = job.spec.cluster
        parallel = job.spec.parallel
        self.dp_shard, self.tp = parallel.dp_shard, parallel.degrees[0]
        self.group_size = parallel.live_group  # workers per replica group
        self.min, self.max = cluster.min_workers // self.group_size, cluster.max_workers // self.group_size  # groups
        self.replicas: dict[str, _Replica] = {}  # by name: a drained group and its successor run side by side
        self.result = LiveResult([])
        self._lighthouse: Any = None
        self._log: Any = None
        self.total_steps = 0  # the run's length, as the replicas compute it
        self._group = 0  # groups of replicas started: 1 at the start, one more per fallback
        self._failures = 0  # replicas lost and fallbacks, counted against max_failures
        self._generations: dict[int, int] = {}  # replicas started per index: names r1, r1.1, r1.2, ...
        self._lr_origin: dict[str, Any] | None = None  # the checkpoint the current group started from (`_restore`)

    def _group_words(self) -> str:
        """A replica group's size in words: "dp_shard=2" or "dp_shard=2 x tp=2"."""
        return f"dp_shard={self.dp_shard}" + (f" x tp={self.tp}" if self.tp > 1 else "")

    # -- the actors ---------------------------------------------------------------------------------------------

    def _start_replica(self, index: int, restore: str | None, floor: int) -> _Replica:
        """Start replica group `index`'s next actors, one per rank: from `restore` (a checkpoint directory) at a
        group's start, else healing from a peer; `floor` is the steps the run has committed (a quorum behind it had
        no peer). Rank 0 serves the group's store; every rank's `build` waits for its address (an object ref)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from raytrain.trainer import worker_env

        resources = dict(self.job.spec.cluster.resources_per_worker)
        cpus = resources.pop("CPU", 1.0)
        generation = self._generations.get(index, 0)
        self._generations[index] = generation + 1
        replica_id = f"r{index}" if generation == 0 else f"r{index}.{generation}"
        placement = None
        if self.group_size > 1:  # the group's collectives run in every layer: its workers share a node
            from ray.util.placement_group import placement_group

            placement = placement_group([{"CPU": cpus, **resources}] * self.group_size, strategy="STRICT_PACK")
        actors = []
        for rank in range(self.group_size):
            settings = LiveSettings(
                lighthouse=self._lighthouse.address(),
                replica_id=replica_id,
                group=self._group,
                floor=floor,
                shard_rank=rank,
                dp_shard=self.dp_shard,
                tp=self.tp,
                lr_origin=self._lr_origin,
            )
            actors.append(
                ray.remote(LiveWorker)
                .options(
                    num_cpus=cpus,
                    resources=resources,
                    max_restarts=0,
                    max_concurrency=2,  # `leave` arrives while `run` runs
                    runtime_env={"env_vars": {**worker_env(), "RUST_LOG": os.environ.get("RUST_LOG", "warn")}},
                    scheduling_strategy=None
                    if placement is None
                    else PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=rank),
                )
                .remote(self.job, settings, self._log, restore)
            )
        store = actors[0].address.remote()  # type: ignore[attr-defined]  # a Ray actor handle
        ready = {actor.build.remote(store): rank for rank, actor in enumerate(actors)}  # type: ignore[attr-defined]
        replica = _Replica(index, generation, actors, ready, time.monotonic(), placement=placement)
        self.replicas[replica.name] = replica
        return replica

    def _stop(self, replica: _Replica) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in replica.actors:
            ray.kill(actor, no_restart=True)
        if replica.placement is not None:
            remove_placement_group(replica.placement)

    def _stop_all(self) -> None:
        for replica in self.replicas.values():
            self._stop(replica)
        self.replicas.clear()

    def _newest_running(self) -> _Replica | None:
        """The running (placed and built) replica group with the highest index: what the demo's events hit."""
        replicas = list(self.replicas.values())  # a snapshot: fit()'s thread changes the dict
        running = [r for r in replicas if r.launched and len(r.built) == len(r.actors)]
        return max(running, key=lambda r: r.index) if running else None

    def kill_replica(self) -> str:
        """SIGKILL one process of the running replica group with the highest index (its last rank, as the OOM
        killer or a lost node would); the group is lost with it. Returns what was done."""
        import ray

        target = self._newest_running()
        if target is None:
            return "no running replica to kill"
        pid, node = target.pids[-1], target.nodes[-1]
        if node == ray.get_runtime_context().get_node_id():
            os.kill(pid, signal.SIGKILL)
        else:
            ray.kill(target.actors[-1], no_restart=True)
        rank = f" rank {len(target.pids) - 1}" if len(target.pids) > 1 else ""
        return f"SIGKILL live replica {target.name}{rank} (pid {pid})"

    def event_node(self) -> str | None:
        """The node id that a node event of the demo (removed, drained) hits: that of the running replica group
        `kill_replica` would kill, so that the event lands on a group that trains, never on one still being
        placed or healed (None when no group runs)."""
        target = self._newest_running()
        return target.nodes[-1] if target is not None else None

    # -- the run ------------------------------------------------------------------------------------------------

    def fit(self, tick: Callable[[], None] = lambda: None) -> LiveResult:
        """Run to the last step; `tick` is called about every 0.2 s from this thread. Raises what the user's code
        raised in a replica (once: a bug is never retried), `RuntimeError` after more than `max_failures` failures
        (replicas lost, fallbacks), `TimeoutError` when `min_workers` replicas cannot be placed within
        `START_TIMEOUT_S` at a (re)start, `ConfigError` when the newest live checkpoint was written with another
        global batch, seed, drop_last or data size."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        spec = self.job.spec
        self._log = (
            ray.remote(LiveLog)
            .options(
                num_cpus=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
            )
            .remote(
                self.run_dir,
                audit=spec.loop.audit_samples,
                log_every=spec.loop.log_every,
                keep=spec.checkpoint.keep,
                config=spec.to_dict(),
                num_rows=self._num_rows(),
                data_order=self._data_order(),
            )
        )
        try:
            while self._run_group(tick) is not None:
                pass
        finally:
            self._stop_all()
            if self._lighthouse is not None:
                self._lighthouse.shutdown()
            self._ask_log("close")
            ray.kill(self._log, no_restart=True)
        newest = live_checkpoints(self.run_dir)
        self.result.checkpoint = newest[-1][1] if newest else None
        return self.result

    def _num_rows(self) -> int:
        return int(getattr(self.job.data, "num_rows", 0))

    def _data_order(self) -> dict[str, int]:
        """What the Parquet source's order depends on besides (seed, epoch); {} for data in memory."""
        from raytrain.data.parquet import ParquetIndex

        return self.job.data.order_params() if isinstance(self.job.data, ParquetIndex) else {}

    def _failed(self, cause: str) -> None:
        """Count one failure (a replica lost, a fallback) against `max_failures`; `RuntimeError` past it."""
        self._failures += 1
        limit = self.job.spec.cluster.max_failures
        if 0 <= limit < self._failures:
            raise RuntimeError(
                f"live run: {self._failures} failures (replicas lost and fallbacks), more than "
                f"max_failures={limit}; the last: {cause}"
            )

    def _restore(self) -> tuple[int, str | None]:
        """The newest checkpoint of the run directory, live or the restart path's (one format): (step, its
        directory), or (0, None); `ConfigError` when it was written with settings that would move the data
        position."""
        from raytrain.live.log import check_resumable_with

        damaged: list[tuple[str, str]] = []
        newest = newest_checkpoint(self.run_dir, live_too=True, damaged=damaged)
        for path, why in damaged:  # every group would load it: passed over, as a restart passes over its own
            self._note(
                f"WARNING: checkpoint {os.path.basename(path)} is damaged ({why}); resuming from "
                + (os.path.basename(newest[1]) if newest else "the start")
            )
        self._lr_origin = None
        if newest is None:
            return 0, None
        state = read_train_state(newest[1])
        check_resumable_with(state, self.job.spec.to_dict(), self._num_rows(), self._data_order())
        # the group's LR clock and base batch, for its replacements too (`raytrain.live.worker.group_schedule`)
        self._lr_origin = {"step": state.step, "schedule": state.schedule, "base_batch": state.base_batch}
        return state.step, newest[1]

    def _begin(self, restored: int, ready: list[_Replica]) -> None:
        """The start of a group of `ready` replicas from step `restored`: its line in events.jsonl and the log."""
        from raytrain.batch_plan import plan_batch

        spec = self.job.spec
        dp = len(ready) * self.dp_shard  # data ranks
        plan = plan_batch(spec.batch.global_batch, spec.batch.micro_batch, dp)
        event = {
            "step": restored,
            "world_size": dp * self.tp,
            "layout": {"dp": dp, "dp_replicate": len(ready), "dp_shard": self.dp_shard, "tp": self.tp, "pp": 1},
            "plan": plan.to_dict(),
            "lr": spec.lr.peak_lr(spec.batch.global_batch),
            "strategy": spec.loop.strategy if self.dp_shard > 1 else "ddp",
            "recovery": "live",
            "restored": restored > 0,
            "pids": [pid for r in sorted(ready, key=lambda r: r.index) for pid in r.pids],
            "entered": time.time(),
        }
        self._ask_log("begin", self._group, restored, event, self.total_steps)

    def _ask_log(self, call: str, *args: Any) -> Any:
        """The log actor's answer to `call(*args)`, waited for with a word (`get_said`)."""
        ref = getattr(self._log, call).remote(*args)
        return get_said(ref, self._log, "raytrain's live log actor", f"{call}()", self.run_dir)

    def _note(self, message: str, record: dict[str, Any] | None = None) -> None:
        self._log.note.remote(f"live: {message}")
        if record is not None:
            self._log.membership.remote(record)

    def _run_group(self, tick: Callable[[], None]) -> str | None:
        """One group of replicas from the newest checkpoint to the end (None), or until live mode cannot go on
        (the reason: the caller restarts)."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError
        from torchft.coordination import LighthouseServer

        self._group += 1
        self._ask_log("fence", self._group)  # records of a stopped group count no more
        if self._lighthouse is not None:
            self._lighthouse.shutdown()
        self._lighthouse = LighthouseServer(
            bind="[::]:0",
            min_replicas=self.min,
            join_timeout_ms=JOIN_TIMEOUT_MS,
            quorum_tick_ms=50,
            heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
        )
        restored, restore = self._restore()
        for index in range(self.max):
            self._start_replica(index, restore, floor=restored)
        deadline = time.monotonic() + START_TIMEOUT_S
        while sum(not r.ready for r in self.replicas.values()) < self.min and time.monotonic() < deadline:
            self._settle(wait_one_until(self._ready_refs(), deadline))
        settled = sum(not r.ready for r in self.replicas.values())
        if settled < self.min:
            self._stop_all()
            raise TimeoutError(
                f"live mode: only {settled} of the {self.min} replica group(s) that min_workers="
                f"{self.min * self.group_size} asks for (groups of {self._group_words()}) could be placed and built "
                f"within {START_TIMEOUT_S:.0f} s "
                f"(resources_per_worker={self.job.spec.cluster.resources_per_worker})"
            )
        grace = time.monotonic() + 1.0  # the others that are about ready start with them
        while self._ready_refs() and time.monotonic() < grace:
            self._settle(wait_one_until(self._ready_refs(), grace))
        built = [r for r in self.replicas.values() if not r.ready]
        if not built:
            return self._fall_back(0, "no replica could be started")
        self._begin(restored, built)  # the log knows the group before any replica can commit a step
        for replica in built:
            self._run(replica)
        finished = False
        below_since: float | None = None
        drains_checked = 0.0
        while True:
            tick()
            if time.monotonic() - drains_checked > DRAIN_POLL_S:
                drains_checked = time.monotonic()
                self._watch_drains(finished)
            waiting = self._ready_refs()
            running = {ref: r for r in self.replicas.values() for ref in r.running}
            if not running and (finished or not waiting):
                return None
            done, _ = ray.wait([*waiting, *running], num_returns=1, timeout=0.2)
            if done and done[0] not in running:
                for replica in self._settle(done):
                    if finished:
                        self._stop(replica)
                        del self.replicas[replica.name]
                    else:
                        self._launch(replica)
                done = []
            for ref in done:
                replica = running[ref]
                if self.replicas.get(replica.name) is not replica:
                    continue  # lost with another of its ranks
                try:
                    outcome = ray.get(ref)
                    del replica.running[ref]
                    if outcome.left:
                        if not replica.running:
                            self._left(replica, outcome)
                        continue
                    self.result.outcomes.append(outcome)
                    finished = True
                    if not replica.running:  # its actors and placement group go now, not when the driver exits
                        del self.replicas[replica.name]
                        self._stop(replica)
                except RayActorError:
                    self._lost(replica, replace=not finished, why="its process died")
                except RayTaskError as err:
                    if isinstance(err.cause, LiveReplicaLost) or finished:
                        self._lost(replica, replace=not finished, why=str(err.cause))
                    else:  # the user's code (or a non-finite step with on_nonfinite="stop"): fail once
                        self._stop_all()
                        raise err.as_instanceof_cause() from None
            alive = sum(1 for r in self.replicas.values() if r.launched)
            if alive == 0 and not finished:  # nobody to heal from: a replacement would start from scratch
                return self._fall_back(0, "every replica is lost")
            if alive >= self.min or finished:
                below_since = None
            elif below_since is None:
                below_since = time.monotonic()
            elif time.monotonic() - below_since > REPLACE_PATIENCE_S:
                return self._fall_back(
                    alive,
                    f"{alive} replica group(s) alive, below min_workers={self.min * self.group_size} "
                    f"({self.min} group(s) of {self._group_words()}), and no replacement could be placed "
                    f"within {REPLACE_PATIENCE_S:.0f} s",
                )

    def _fall_back(self, alive: int, why: str) -> str:
        """Stop the replicas left and say why, once: the caller restarts from the newest live checkpoint."""
        newest = newest_checkpoint(self.run_dir, live_too=True)
        restored = newest[0] if newest else 0
        reason = f"live: {why}: falling back to the restart path from " + (
            f"checkpoint step {restored}" if newest else "the start (no checkpoint yet)"
        )
        at = self._ask_log("last_step")
        self.result.fallbacks.append({"reason": reason, "at_step": at, "restored_step": restored})
        self._failed(reason)
        self._log.note.remote(reason)
        self._log.membership.remote({"kind": "fallback", "alive": alive, "reason": reason})
        self._stop_all()
        return reason

    def _watch_drains(self, finished: bool) -> None:
        """Drains (a spot notice, `ray_hooks.drain_node`), make before break: a running group with a worker on a
        node being drained gets a successor at once (placed elsewhere: a draining node takes no new work), and is
        asked to leave at its next step boundary as soon as the successor trains beside it, or when the drain's
        deadline is `drain_margin_s()` away (no room for a successor; it then waits for room). The others never
        pause for a failed step."""
        from ray._private.state import state as ray_state

        now = time.monotonic()
        try:
            draining = {node: deadline_ms for node, deadline_ms in ray_state.get_draining_nodes().items()}
        except Exception:  # an older GCS: no drains known
            draining = {}
        for replica in list(self.replicas.values()):
            nodes = set(draining) & set(replica.nodes)
            if replica.launched and nodes and replica.leave_by is None:
                deadlines = [draining[n] / 1000 - time.time() for n in nodes if draining[n]]
                left_s = min(deadlines) if deadlines else DRAIN_NO_DEADLINE_S
                replica.leave_by = now + left_s - self._drain_margin_s()
                if not finished:
                    step = self._ask_log("last_step")
                    replica.successor = self._start_replica(replica.index, None, floor=step).name
                self._note(
                    f"{replica.who()}: node {', '.join(sorted(n[:8] for n in nodes))} is being drained "
                    f"(deadline in {left_s:.1f} s); "
                    + (f"successor {replica.successor} starting; " if replica.successor else "")
                    + "it leaves once the successor trains, or "
                    f"{max(0.0, replica.leave_by - now):.1f} s from now",
                    {"kind": "draining", "replica": replica.name, "pids": replica.pids, "nodes": sorted(nodes)},
                )
            if replica.leave_by is None or replica.leaving:
                continue
            successor = self.replicas.get(replica.successor or "")
            if (successor is not None and successor.launched) or now >= replica.leave_by:
                replica.leaving = True
                for actor in replica.actors:
                    actor.leave.remote()

    def _drain_margin_s(self) -> float:
        """How long before a drain's deadline a group leaves when no successor is ready: DRAIN_MARGIN_S, or three
        steps when the steps are slower (measured from the log's last committed steps)."""
        pace = self._ask_log("step_interval_s")
        return max(DRAIN_MARGIN_S, 3 * pace) if pace else DRAIN_MARGIN_S

    def _left(self, replica: _Replica, outcome: LiveOutcome) -> None:
        """A group left at a step boundary (a drain): nothing to redo, nothing counted against `max_failures`; its
        successor (started when the drain was noticed) goes on."""
        del self.replicas[replica.name]
        self._stop(replica)
        step = outcome.last_step or 0
        self.result.left.append({"replica": replica.name, "pids": replica.pids, "step": step, "time": time.time()})
        others = sum(1 for r in self.replicas.values() if r.launched)
        successor = self.replicas.get(replica.successor or "")
        self._note(
            f"{replica.who()} left after step {step} ahead of its node's drain; {others} go on with the same "
            "global batch, no step trained again"
            + (
                ""
                if successor is None
                else f"; its successor {successor.name} "
                + ("trains" if successor.launched else "joins once it is placed and built")
            ),
            {"kind": "left", "replica": replica.name, "pids": replica.pids, "step": step},
        )

    def _ready_refs(self) -> list[Any]:
        """The `build` refs not yet returned, of every group still starting."""
        return [ref for r in self.replicas.values() for ref in r.ready]

    def _settle(self, done: list[Any]) -> list[_Replica]:
        """Take the returned `build` refs in `done`: record each rank's pid and node; a rank that died while
        starting loses its group (counted, its cause in the log, a replacement started). Returns the groups that
        are now built in full."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        complete = []
        for ref in done:
            replica = next((r for r in self.replicas.values() if ref in r.ready), None)
            if replica is None:
                continue  # its group was lost meanwhile
            rank = replica.ready.pop(ref)
            try:
                pid, node, self.total_steps = ray.get(ref)
            except (RayActorError, RayTaskError) as err:  # died while being built (the user's functions were checked)
                cause = str(err).strip().splitlines()
                self._lost(replica, replace=True, why=f"failed while starting: {cause[-1] if cause else err!r}")
                continue
            replica.built[rank] = (pid, node)
            if not replica.ready:
                self._log.membership.remote({"kind": "started", "replica": replica.name, "pids": replica.pids})
                complete.append(replica)
        return complete

    def _run(self, replica: _Replica) -> None:
        """Every rank of a built group starts training."""
        replica.running = {actor.run.remote(): rank for rank, actor in enumerate(replica.actors)}
        replica.launched = True

    def _launch(self, replica: _Replica) -> None:
        """A replacement built during the run starts training: it heals from a peer at its first quorum."""
        self._run(replica)
        self._note(
            f"{replica.who()} joined; it heals from a peer and takes part from the next step",
            {"kind": "joined", "replica": replica.name, "pid": replica.pid, "pids": replica.pids},
        )

    def _lost(self, replica: _Replica, replace: bool, why: str) -> None:
        """A replica is gone (`why`): say so, count it against `max_failures`, and start a replacement (healing
        from a peer) when `replace` and another replica is still training."""
        del self.replicas[replica.name]
        self._stop(replica)  # the group's other ranks cannot go on without it
        replace = replace and replica.successor not in self.replicas  # a drained group's successor is started
        step = self._ask_log("last_step")
        self.result.lost.append(
            {"replica": replica.name, "pid": replica.pid, "step": step, "time": time.time(), "why": why}
        )
        who = replica.who()
        others = sum(1 for r in self.replicas.values() if r.launched)
        if not others:
            going_on = "no replica left to go on"
        elif others >= self.min:
            going_on = f"{others} go on with the same global batch, no restart"
        else:  # below min_workers the quorum waits (a fixed worker count is min = max): said, not implied
            going_on = (
                f"{others} wait for a replacement, no restart: min_workers={self.min * self.group_size} asks for "
                f"{self.min} replica group(s) per step (a range such as --workers {self.group_size}:"
                f"{self.max * self.group_size} lets the others train on alone)"
            )
        going_on += "; starting a replacement" if replace and others else ""
        self._note(
            f"{who} lost after step {step} ({why}); {going_on}",
            {"kind": "lost", "replica": replica.name, "pid": replica.pid, "step": step, "why": why},
        )
        self._failed(f"{who}: {why}")
        if replace and others:  # with none left there is no peer to heal from: the run falls back instead
            self._start_replica(replica.index, None, floor=step)
