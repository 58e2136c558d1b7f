"""`raytrain demo`: elastic training on an embedded local Ray cluster of fake nodes, with membership events.

    raytrain demo                                   # 3 fake nodes, workers 1..3, one shrink and one grow
    raytrain demo --events "kill@10,remove@25,add@45" --audit-samples --json

The head node runs the driver, Ray Train's controller and Ray Data (2 CPUs); each fake node carries one
`worker_slot`, which every training worker requires, so removing a node removes exactly one worker. Events fire
from a driver thread that follows `metrics.jsonl`: at the first committed-or-current step >= s it removes a node,
adds one, or SIGKILLs one training worker process. With RAY_ADDRESS set (or under `ray job submit`) the demo
trains on that cluster instead, and only `kill` events can be applied there.

    raytrain demo --autoscale                       # nodes come from Ray's autoscaler, one spot reclaim

With --autoscale the cluster starts with the head and `cluster.yaml`'s `min_workers` nodes only; Ray's autoscaler
(v2, over the file's own node types, `raytrain.cli.local_autoscaler`) launches nodes for the trainer's demand,
replaces a node that `reclaim@STEP` has the node provider take back, and removes idle nodes after training.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from raytrain.console import output
from raytrain.errors import ConfigError
from raytrain.rank0 import EVENTS_FILE, METRICS_FILE, read_jsonl
from raytrain.run_lock import run_lock

EVENT_KINDS = ("remove", "add", "kill", "drain", "reclaim")
HAND_DRIVEN_KINDS = ("remove", "add")  # only the fixed fake-node cluster: with --autoscale the autoscaler adds nodes
AUTOSCALE_KINDS = ("reclaim",)  # only with --autoscale: the cloud (the provider) takes a node back
DRAIN_DEADLINE_S = 8.0  # a drain announces the node's removal this long ahead (clouds give 30 s to 2 min)
WORKER_SLOT = "worker_slot"


@dataclass(frozen=True)
class Event:
    """A membership event applied when training first reaches optimizer step `step`."""

    kind: str
    step: int


def parse_events(text: str) -> list[Event]:
    """Parse ``"remove@10,add@20,kill@30"`` (or ``"none"``) into events sorted by step; `ConfigError` otherwise."""
    if text.strip().lower() in ("", "none"):
        return []
    events = []
    for item in text.split(","):
        kind, _, step = item.strip().partition("@")
        if kind not in EVENT_KINDS or not step.isdigit() or int(step) < 1:
            raise ConfigError(
                f"events must be a comma-separated list of KIND@STEP with KIND in {', '.join(EVENT_KINDS)} and "
                f"STEP >= 1 (or 'none'), got {item.strip()!r}"
            )
        events.append(Event(kind, int(step)))
    return sorted(events, key=lambda e: e.step)


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    """Settings of one demo run (the CLI flags)."""

    nodes: int = 3
    slots_per_node: int = 1  # worker slots per fake node (a tensor-parallel group must fit in one node)
    tp: int = 1  # tensor-parallel degree: the MLP's two layers split over tp workers of a node
    pp: int = 1  # pipeline stages: the MLP cut in pp stages, one per worker of a replica (across nodes)
    min_workers: int = 1
    max_workers: int = 3
    global_batch: int = 96
    micro_batch: int = 16
    steps: int = 240
    seed: int = 0
    storage: str = "raytrain_runs"
    run_name: str = ""
    deterministic: bool = True
    audit_samples: bool = False
    events: str = "remove@20,add@60"
    strategy: str = "ddp"
    checkpoint_every: int = 5
    background_save: bool = True
    epoch_steps: int = 50
    sample_time_s: float = 0.003
    resize_monitor_interval_s: float = 1.0
    timeout_s: float = 900.0
    autoscale: bool = False  # nodes come from Ray's autoscaler over cluster.yaml's node types (local_autoscaler)
    cluster_yaml: str = ""  # the node types for --autoscale; "" = the cluster.yaml shipped with raytrain
    idle_timeout_s: float = 10.0  # --autoscale: an idle worker node is removed after this long
    recovery: str = "restart"  # "live": torchft replica groups, survivors never restart (ClusterConfig.recovery)
    dp_shard: int = 1  # live mode: data ranks per replica group, sharding the model (ParallelConfig.dp_shard)

    def __post_init__(self) -> None:
        """Everything checkable without a cluster, so a bad flag fails before any Ray process starts."""
        from raytrain.config import BatchConfig, ClusterConfig, LoopConfig, ParallelConfig, check_whole_replicas

        if self.nodes < 1:
            raise ConfigError(f"nodes must be an integer >= 1, got {self.nodes}")
        if self.slots_per_node < 1:
            raise ConfigError(f"slots-per-node must be an integer >= 1, got {self.slots_per_node}")
        replica = ParallelConfig(tp=self.tp, pp=self.pp).replica
        if replica > 1:
            if self.autoscale:
                raise ConfigError("--tp/--pp > 1 run on the demo's own fake nodes; not with --autoscale")
            if self.slots_per_node % self.tp:
                raise ConfigError(
                    f"slots-per-node must be a multiple of tp ({self.tp}) to hold whole tensor-parallel groups, got "
                    f"{self.slots_per_node}"
                )
        if self.steps < 1:
            raise ConfigError(f"steps must be an integer >= 1, got {self.steps}")
        for name in ("epoch_steps", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {getattr(self, name)}")
        if self.sample_time_s < 0:
            raise ConfigError(f"sample_time must be >= 0 seconds, got {self.sample_time_s}")
        BatchConfig(global_batch=self.global_batch, micro_batch=self.micro_batch)
        ClusterConfig(min_workers=self.min_workers, max_workers=self.max_workers, recovery=self.recovery)
        ParallelConfig(dp_shard=self.dp_shard)
        if self.recovery != "live" and self.dp_shard != 1:
            raise ConfigError(
                f"--dp-shard {self.dp_shard} sizes live mode's replica groups: add --recovery live (or leave it out)"
            )
        if self.recovery == "live":
            strategies = ("ddp",) if self.dp_shard == 1 else ("zero2", "zero3")
            live_problems = [
                f"{name} {value!r} (live mode runs {valid})"
                for name, value, valid in (
                    ("--pp", self.pp, 1),
                    ("--deterministic", self.deterministic, True),
                    ("--autoscale", self.autoscale, False),
                )
                if value != valid
            ]
            if self.strategy not in strategies:
                live_problems.append(
                    f"--strategy {self.strategy!r} (live mode runs {' or '.join(strategies)} with --dp-shard "
                    f"{self.dp_shard})"
                )
            group = self.dp_shard * self.tp
            size = f"--dp-shard {self.dp_shard}" if self.tp == 1 else f"--dp-shard x --tp = {group}"
            for name, value in (("--workers min", self.min_workers), ("--workers max", self.max_workers)):
                if value % group:
                    live_problems.append(f"{name} {value} (a multiple of {size}: whole groups)")
            if self.slots_per_node < group:
                live_problems.append(
                    f"--slots-per-node {self.slots_per_node} (at least {size}: a replica group shares a node)"
                )
            if live_problems:
                raise ConfigError("--recovery live cannot run with " + ", ".join(live_problems))
            from raytrain.live import require_torchft

            require_torchft()
        LoopConfig(strategy=self.strategy, seed=self.seed)
        check_whole_replicas(self.min_workers, self.max_workers, self.global_batch, self.tp, self.pp)
        kinds = {event.kind for event in parse_events(self.events)}
        if self.autoscale and kinds & set(HAND_DRIVEN_KINDS):
            raise ConfigError(
                f"events {', '.join(sorted(kinds & set(HAND_DRIVEN_KINDS)))} need the demo's hand-driven cluster; "
                "with --autoscale the autoscaler adds nodes and `reclaim@STEP` takes one back as a cloud would "
                f"(valid with --autoscale: {', '.join(k for k in EVENT_KINDS if k not in HAND_DRIVEN_KINDS)})"
            )
        if not self.autoscale and kinds & set(AUTOSCALE_KINDS):
            raise ConfigError("event reclaim needs --autoscale (a node provider that can take a node back)")
        if self.idle_timeout_s <= 0:
            raise ConfigError(f"idle_timeout must be > 0 seconds, got {self.idle_timeout_s}")
        if self.autoscale:
            from raytrain.cli.local_autoscaler import load_cluster_yaml

            load_cluster_yaml(self.cluster_yaml)  # a missing or broken file fails before any Ray process

    def warnings(self, embedded: bool) -> list[str]:
        """Settings that are valid but cannot take effect as asked (printed before the run starts)."""
        notes = []
        slots = self.nodes * self.slots_per_node
        if embedded and not self.autoscale and self.max_workers > slots:
            each = "one worker slot" if self.slots_per_node == 1 else f"{self.slots_per_node} worker slots"
            notes.append(
                f"--workers allows {self.max_workers} workers but the demo cluster has {self.nodes} fake nodes with "
                f"{each} each: at most {slots} can run (add --nodes)"
            )
        for event in parse_events(self.events):
            if event.step > self.steps:
                notes.append(
                    f"event {event.kind}@{event.step} is after the last step ({self.steps}): it will not happen"
                )
        return notes


@dataclass(frozen=True)
class PacedLoss:
    """The demo's loss: `loss_fn` plus `seconds_per_sample` of simulated compute per sample, so that a toy model
    trains at the pace of a real one (a rank with more samples takes longer) and events land mid-run."""

    loss_fn: Any
    seconds_per_sample: float

    def __call__(self, model: Any, batch: dict[str, Any]) -> Any:
        """Sleep for the batch's simulated compute, then return `loss_fn(model, batch)`."""
        time.sleep(len(next(iter(batch.values()))) * self.seconds_per_sample)
        return self.loss_fn(model, batch)


@dataclass
class AppliedEvent:
    """An event as it happened: when, at which step, what it did."""

    kind: str
    planned_step: int
    applied_step: int
    time: float
    detail: str
    recovered_time: float | None = None
    recovered_world_size: int | None = None
    restored_step: int | None = None  # the checkpoint step the next worker group resumed from
    peak_step: int = 0  # the furthest step trained between the event and the restart
    node_gone_time: float | None = None  # a drain: when the node was removed (its deadline)
    grown_time: float | None = None  # live mode, a node added: the first step committed at a larger world after it

    @property
    def steps_lost(self) -> int | None:
        """Steps trained before the restart that had to be trained again (done after the last checkpoint)."""
        return (
            None if self.restored_step is None else max(0, max(self.peak_step, self.applied_step) - self.restored_step)
        )

    @property
    def recovery_s(self) -> float | None:
        """Seconds from the event to the first step finished by the next worker group."""
        return None if self.recovered_time is None else self.recovered_time - self.time

    @property
    def grown_s(self) -> float | None:
        """Live mode, a node added: seconds from its arrival to the first step a new replica group took part in
        (placed, built, healed from a peer) while the others trained."""
        return None if self.grown_time is None else self.grown_time - self.time


class FakeCluster:
    """A local Ray cluster: a head without worker slots and `nodes` fake nodes with `slots` worker slots each."""

    def __init__(self, nodes: int, head_cpus: int = 2, slots: int = 1) -> None:
        from ray.cluster_utils import Cluster

        from raytrain.ray_hooks import FAST_NODE_DEATH
        from raytrain.trainer import mute_state_api

        # no dashboard: the controller's PlacementGroupCleaner must not wait on the state API
        self._restore_state_api = mute_state_api()
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": head_cpus,
                "include_dashboard": False,
                "_system_config": FAST_NODE_DEATH,  # a removed node is marked dead in seconds, as cluster.yaml sets
            },
        )
        self.worker_nodes: list[Any] = []
        self.slots = slots
        for _ in range(nodes):  # started side by side (each start mostly waits), then waited for together
            self.worker_nodes.append(self._start_node(wait=False))
        self.cluster.wait_for_nodes(timeout=120)

    @property
    def address(self) -> str:
        """The GCS address to `ray.init` with."""
        return str(self.cluster.address)

    def add_node(self) -> str:
        """Start one more fake node with its worker slots (and as many logical CPUs)."""
        node = self._start_node(wait=True)
        self.worker_nodes.append(node)
        return f"added node {node.node_id[:8]}"

    def _start_node(self, wait: bool) -> Any:
        return self.cluster.add_node(num_cpus=self.slots, resources={WORKER_SLOT: self.slots}, wait=wait)

    def remove_node(self, node: Any = None, node_id: str | None = None) -> str:
        """Kill `node` (or the fake node of `node_id`; default: the most recently added one), as a spot reclaim
        would: no grace period."""
        if not self.worker_nodes:
            return "no fake node left to remove"
        node = node if node is not None else self._node(node_id)
        self.worker_nodes.remove(node)
        self.cluster.remove_node(node, allow_graceful=False)
        return f"removed node {node.node_id[:8]}"

    def drain_node(self, deadline_s: float, node_id: str | None = None) -> tuple[str, Any]:
        """Announce the removal of the fake node of `node_id` (default: the most recently added one) in
        `deadline_s` seconds (a spot notice); returns a description and the node, which the caller removes at the
        deadline."""
        from raytrain.ray_hooks import drain_node

        node = self._node(node_id)
        drain_node(self.address, node.node_id, deadline_s)
        return f"drain of node {node.node_id[:8]} announced, removal in {deadline_s:.0f} s", node

    def _node(self, node_id: str | None) -> Any:
        """The fake node of `node_id`; the most recently added one for None or an id not among them."""
        return next((n for n in self.worker_nodes if n.node_id == node_id), self.worker_nodes[-1])

    def shutdown(self) -> None:
        """Stop every node of the cluster."""
        self.cluster.shutdown()
        self._restore_state_api()


class AutoscaledNodes:
    """The demo's cluster with --autoscale: a head that runs Ray's autoscaler over `cluster.yaml`'s node types.

    The autoscaler adds nodes for the trainer's pending demand; `reclaim_node` has the node provider take one back
    without notice, as a cloud reclaims a spot instance. `poll` reports the nodes that came up or went away."""

    def __init__(self, cluster_yaml: str, idle_timeout_s: float) -> None:
        from raytrain.cli.local_autoscaler import LocalAutoscalingCluster
        from raytrain.ray_hooks import FAST_NODE_DEATH

        self.cluster = LocalAutoscalingCluster.from_cluster_yaml(
            cluster_yaml, idle_timeout_s=idle_timeout_s, system_config=FAST_NODE_DEATH
        ).start()
        self.initial_worker_nodes = len(self.cluster.provider_record())  # cluster.yaml's min_workers (all 0)
        self.alive: dict[str, str] = {}  # node id -> type, as of the last poll
        self.history: list[dict[str, Any]] = []  # {"time", "node", "type", "change": "up" | "down"}
        self.reclaimed: list[dict[str, Any]] = []  # {"time", "node", "type", "spare_nodes"}

    @property
    def address(self) -> str:
        """The GCS address to `ray.init` with."""
        return self.cluster.address

    def poll(self) -> tuple[list[str], list[str]]:
        """Node ids that came up and that went away since the last poll (recorded in `history`)."""
        now, alive = time.time(), self.cluster.worker_nodes()
        up = sorted(set(alive) - set(self.alive))
        down = sorted(set(self.alive) - set(alive))
        for node in up:
            self.history.append({"time": now, "node": node, "type": alive[node], "change": "up"})
        for node in down:
            self.history.append({"time": now, "node": node, "type": self.alive[node], "change": "down"})
        self.alive = alive
        return up, down

    def _training_nodes(self) -> set[str]:
        """The alive worker nodes (as of a fresh poll) that host a training worker."""
        from raytrain.ray_hooks import nodes_using

        self.poll()
        return set(self.alive) & nodes_using(WORKER_SLOT)

    def _newest(self, training: set[str]) -> str:
        """The newest of `training`, or of all alive worker nodes if none trains (provider ids count up)."""
        return max(training or self.alive)

    def reclaim_node(self, node: str | None = None) -> str:
        """Have the provider take back `node` (default: the newest worker node that hosts a training worker, so
        the reclaim hits training even when the autoscaler launched a spare) now, without notice."""
        from raytrain.ray_hooks import short_node_id

        training = self._training_nodes()
        if node is None:
            if not self.alive:
                return "no worker node to reclaim"
            node = self._newest(training)
        kind = self.alive.get(node, "?")
        self.cluster.reclaim(node)
        # A spare (a node without a training worker, e.g. launched at a restart) can take the reclaimed node's
        # place at once, and then no launch is needed.
        spare = len(set(self.alive) - training - {node})
        self.reclaimed.append({"time": time.time(), "node": node, "type": kind, "spare_nodes": spare})
        return f"the provider reclaimed node {short_node_id(node)} ({kind}), as a cloud takes back a spot instance"

    def remove_node(self, node: Any = None, node_id: str | None = None) -> str:
        """A drain's deadline: the node (or the node of `node_id`) is reclaimed (the same interface as
        `FakeCluster.remove_node`)."""
        return self.reclaim_node(node if node is not None else node_id)

    def add_node(self) -> str:
        """Not offered: the autoscaler adds nodes (`DemoOptions` refuses `add` events with --autoscale)."""
        raise ConfigError("with --autoscale the autoscaler adds nodes")

    def drain_node(self, deadline_s: float, node_id: str | None = None) -> tuple[str, Any]:
        """Announce the reclaim of the node of `node_id` (default: the newest worker node) in `deadline_s` seconds
        (a spot notice)."""
        from raytrain.ray_hooks import drain_node, short_node_id

        node = node_id or self._newest(self._training_nodes())
        drain_node(self.address, node, deadline_s)
        return f"drain of node {short_node_id(node)} announced, reclaim in {deadline_s:.0f} s", node

    def wait_for_scale_down(self, timeout_s: float) -> float | None:
        """Seconds until no worker node is left (the autoscaler removed the idle ones), None after `timeout_s`."""
        start = time.time()
        while time.time() - start < timeout_s:
            self.poll()
            if not self.alive:
                return time.time() - start
            time.sleep(0.5)
        return None

    def shutdown(self) -> None:
        """Stop the head (and its autoscaler) and every node the provider started."""
        self.cluster.shutdown()


class EventDriver:
    """Follows metrics.jsonl and applies each event once training reaches its step; records recoveries.

    Runs in the main thread (Ray's `Cluster.add_node` installs signal handlers, which only the main thread may).
    """

    def __init__(
        self,
        events: list[Event],
        run_dir: str,
        cluster: FakeCluster | AutoscaledNodes | None,
        kill: Callable[[], str] | None = None,
        target: Callable[[], str | None] | None = None,
    ) -> None:
        self.kill = kill  # live mode: the run kills one of its replicas (the worker pids are not in events.jsonl)
        # live mode: the node id a removal or drain hits, that of a training replica group (`LiveRun.event_node`):
        # the newest node may hold a group still being placed or healed, whose loss is another scenario; None: the
        # newest node (restart mode)
        self.target: Callable[[], str | None] = target or (lambda: None)
        self.pending = list(events)
        self.run_dir, self.cluster = run_dir, cluster
        self.last_poll = 0.0
        self.grown: list[str] = []  # node types of the latest growth not yet followed by a restart
        self.applied: list[AppliedEvent] = []
        self.skipped: list[str] = []
        self.timed: list[tuple[float, Any, AppliedEvent]] = []  # a drained node is removed at its deadline

    def _apply(self, event: Event, step: int) -> None:
        detail: str
        if event.kind == "kill" and self.kill is not None:
            detail = self.kill()
        elif event.kind == "kill":
            starts = read_jsonl(os.path.join(self.run_dir, EVENTS_FILE))
            pids = starts[-1].get("pids", []) if starts else []
            if not pids:
                detail = "no worker pid known"
            else:
                os.kill(pids[-1], signal.SIGKILL)
                detail = f"SIGKILL worker rank {len(pids) - 1} (pid {pids[-1]})"
        elif self.cluster is None:
            self.skipped.append(f"{event.kind}@{event.step}: needs the demo's own fake-node cluster")
            return
        elif event.kind == "drain":
            detail, node = self.cluster.drain_node(DRAIN_DEADLINE_S, self.target())
            applied = AppliedEvent(event.kind, event.step, step, time.time(), detail)
            self.timed.append((applied.time + DRAIN_DEADLINE_S, node, applied))
            self.applied.append(applied)
        elif event.kind == "reclaim":
            assert isinstance(self.cluster, AutoscaledNodes)
            detail = self.cluster.reclaim_node()
        elif event.kind == "remove":
            detail = self.cluster.remove_node(node_id=self.target())
        else:
            detail = self.cluster.add_node()
        if event.kind != "drain":
            self.applied.append(AppliedEvent(event.kind, event.step, step, time.time(), detail))
        print(f"[raytrain demo] step {step}: {event.kind}: {detail}", file=output(), flush=True)

    def _note_recoveries(self) -> None:
        starts = read_jsonl(os.path.join(self.run_dir, EVENTS_FILE))
        for applied in self.applied:
            if applied.recovered_time is not None:
                continue
            later = [s for s in starts if s["time"] > applied.time]
            if later:
                metrics = read_jsonl(os.path.join(self.run_dir, METRICS_FILE))
                # Recovered = the first step finished by the new worker group.
                first = [m for m in metrics if m["step"] > later[0]["step"] and m["time"] > later[0]["time"]]
                if first:
                    applied.recovered_world_size = later[0]["world_size"]
                    applied.recovered_time = first[0]["time"]
                    applied.restored_step = later[0]["step"]

    def _note_autoscaler(self, step: int) -> None:
        """Record nodes the autoscaler launched as a `grow` event (the restart it causes is then explained)."""
        assert isinstance(self.cluster, AutoscaledNodes)
        self.last_poll = time.time()
        up, _ = self.cluster.poll()
        if not up:
            return
        last = self.applied[-1] if self.applied else None
        if last is not None and last.kind == "grow" and last.recovered_time is None:
            self.grown.extend(self.cluster.alive[node] for node in up)  # the same growth, before its restart
        else:
            self.grown = [self.cluster.alive[node] for node in up]
            last = AppliedEvent("grow", step, step, time.time(), "")
            self.applied.append(last)
        counts = {kind: self.grown.count(kind) for kind in sorted(set(self.grown))}
        last.detail = f"the autoscaler added {len(self.grown)} node(s): " + ", ".join(
            f"{n} x {kind}" for kind, n in counts.items()
        )
        added = ", ".join(self.cluster.alive[node] for node in up)
        print(f"[raytrain demo] step {step}: grow: the autoscaler added {added}", file=output(), flush=True)

    def train(self, fit: Callable[[], Any], timeout_s: float, name: str = "raytrain-demo-fit") -> Any:
        """Run `fit()` in a thread named `name` while this (the main) thread applies the events (`follow`); return
        what `fit` returned, or raise what it raised, here. TimeoutError after `timeout_s` seconds."""
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["result"] = fit()
            except BaseException as err:  # re-raised in the calling thread below
                outcome["error"] = err

        training = threading.Thread(target=run, name=name, daemon=True)
        training.start()
        self.follow(training, timeout_s)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]

    def follow(self, training: threading.Thread, timeout_s: float) -> None:
        """Poll until `training` ends, applying due events; raise TimeoutError after `timeout_s` seconds."""
        metrics_path = os.path.join(self.run_dir, METRICS_FILE)
        deadline = time.monotonic() + timeout_s
        while training.is_alive():
            if time.monotonic() > deadline:
                raise TimeoutError(f"demo training did not finish within {timeout_s:.0f} s")
            self._note_recoveries()
            lines = read_jsonl(metrics_path)
            starts = read_jsonl(os.path.join(self.run_dir, EVENTS_FILE))
            step = lines[-1]["step"] if lines else 0
            for applied in self.applied:
                if applied.recovered_time is None:  # a step of the next worker group is not a step the old one lost
                    restart = next((s["time"] for s in starts if s["time"] > applied.time), float("inf"))
                    before = [m["step"] for m in lines if m["time"] < restart]
                    applied.peak_step = max(applied.peak_step, before[-1] if before else 0)
            if self.pending and step >= self.pending[0].step:
                self._apply(self.pending.pop(0), step)
            if isinstance(self.cluster, AutoscaledNodes) and time.time() - self.last_poll >= 1.0:
                self._note_autoscaler(step)
            for due in [t for t in self.timed if t[0] <= time.time()]:
                self.timed.remove(due)
                assert self.cluster is not None
                detail = self.cluster.remove_node(due[1])
                due[2].node_gone_time = time.time()
                print(f"[raytrain demo] drain deadline: {detail}", file=output(), flush=True)
            training.join(timeout=0.1)
        self._note_recoveries()


def autoscale_summary(
    metrics: list[dict[str, Any]],
    starts: list[dict[str, Any]],
    history: list[dict[str, Any]],
    reclaimed: list[dict[str, Any]],
    started: float,
    max_workers: int,
    scale_down_s: float | None,
) -> dict[str, Any]:
    """What the autoscaler did in an --autoscale run, from the run's metrics and the node history (pure).

    grow_s: from the start of `fit` to the first step at `max_workers`; replace_s: per reclaim, from the reclaim
    to the first step of a worker group started after it at the world size it had before; scale_down_s: from the
    end of training to no worker node."""

    def first_full_after(t: float, size: int) -> float | None:
        group = next((s["time"] for s in starts if s["time"] > t and s["world_size"] >= size), None)
        later = [m["time"] for m in metrics if group is not None and m["time"] > group and m["world_size"] >= size]
        return round(later[0] - t, 2) if later else None

    replace = []
    for event in reclaimed:
        before = [m["world_size"] for m in metrics if m["time"] <= event["time"]]
        size = before[-1] if before else max_workers
        replace.append({**event, "world_size_before": size, "replace_s": first_full_after(event["time"], size)})
    launched: dict[str, int] = {}
    for change in history:
        if change["change"] == "up":
            launched[change["type"]] = launched.get(change["type"], 0) + 1
    return {
        "grow_s": first_full_after(started, max_workers),
        "replace": replace,
        "replace_s": [r["replace_s"] for r in replace],
        "launched_by_type": launched,
        "node_history": history,
        "scale_down_s": None if scale_down_s is None else round(scale_down_s, 2),
    }


def live_summary(metrics: list[dict[str, Any]], applied: list[AppliedEvent], result: Any) -> dict[str, Any]:
    """A live run's recoveries, from its metrics and the `raytrain.live.driver.LiveResult`: for each event, the
    seconds from the event to the first step committed after it (`pause_s`, the same measure as a restart's
    `recovery_s`) and the world that committed it (filled into `applied` too), and for a node added the seconds to
    the first step at a larger world (`grown_s`: a new group placed, built and healed); the steps trained again
    (`steps_retrained`: attempts that failed and were redone, and the steps between a fallback's checkpoint and
    the step it had reached); every replica that ran to the end, with its pid and first step."""
    for event in applied:
        after = [m for m in metrics if m["time"] > event.time and m["step"] > event.applied_step]
        if after:
            event.recovered_time, event.recovered_world_size = after[0]["time"], after[0]["world_size"]
        before = [m["world_size"] for m in metrics if m["step"] <= event.applied_step]
        grown = [m for m in after if before and m["world_size"] > before[-1]]
        if event.kind == "add" and grown:
            event.grown_time = grown[0]["time"]
    failed = sorted({step for outcome in result.outcomes for step in outcome.failed_steps})
    rolled_back = sum(max(0, f["at_step"] - f["restored_step"]) for f in result.fallbacks)
    return {
        "pause_s": [None if e.recovery_s is None else round(e.recovery_s, 3) for e in applied],
        "grown_s": [None if e.grown_s is None else round(e.grown_s, 3) for e in applied],
        "steps_retrained": len(failed) + rolled_back,
        "failed_steps": failed,
        "lost": result.lost,
        "left": result.left,
        "finished": [
            {"replica": o.replica_id, "pid": o.pid, "first_step": o.first_step, "committed": o.committed}
            for o in sorted(result.outcomes, key=lambda o: o.replica_id)
        ],
        "restarts": result.restarts,
        "fallbacks": result.fallbacks,
    }


def audit_epochs(samples_path: str, num_rows: int, completed_epochs: int) -> dict[str, Any]:
    """Check samples.jsonl: per completed epoch, how many ids are duplicated and how many are missing."""
    by_epoch: dict[int, list[int]] = {}
    for record in read_jsonl(samples_path):
        by_epoch.setdefault(record["epoch"], []).extend(record["ids"])
    report = {}
    for epoch in range(completed_epochs):
        ids = by_epoch.get(epoch, [])
        unique = set(ids)
        report[str(epoch)] = {"duplicates": len(ids) - len(unique), "missing": num_rows - len(unique)}
    return report


@dataclass(frozen=True)
class Timeline:
    """What the demo's plot draws, computed from the run's files (pure, testable without a figure).

    retrained: (first, last) step ranges trained twice: from the checkpoint a restart resumed at to the furthest
        step trained before it (the model was rolled back).
    recoveries: (event time, recovered time, label) in seconds since the run's first start: from a membership
        event to the first step of the worker group it caused.
    unplanned: (time, world size) of restarts that no applied event explains (a crash, a lost node).
    """

    retrained: list[tuple[int, int]]
    recoveries: list[tuple[float, float, str]]
    unplanned: list[tuple[float, int]]
    t0: float


def timeline(starts: list[dict[str, Any]], applied: list[AppliedEvent]) -> Timeline:
    """The `Timeline` of a run from its events.jsonl starts and the events the demo applied."""
    t0 = starts[0]["time"] if starts else 0.0
    retrained = [
        (event.restored_step + 1, max(event.peak_step, event.applied_step))
        for event in applied
        if event.restored_step is not None and max(event.peak_step, event.applied_step) > event.restored_step
    ]
    recoveries = [
        (event.time - t0, event.recovered_time - t0, event.kind)
        for event in applied
        if event.recovered_time is not None
    ]
    explained = [(event.time, event.recovered_time or float("inf")) for event in applied]
    unplanned = [
        (start["time"] - t0, start["world_size"])
        for start in starts[1:]
        if not any(begin <= start["time"] <= end for begin, end in explained)
    ]
    return Timeline(retrained, recoveries, unplanned, t0)


def node_counts(history: list[dict[str, Any]], t0: float) -> tuple[list[float], list[int]]:
    """(seconds since `t0`, worker nodes alive) after each change of an autoscaler's node history (pure)."""
    times, counts, alive = [], [], 0
    for change in sorted(history, key=lambda h: h["time"]):
        alive += 1 if change["change"] == "up" else -1
        times.append(change["time"] - t0)
        counts.append(alive)
    return times, counts


def label_rows(positions: list[float], span: float, gap: float = 0.1) -> list[int]:
    """Pure: the row (0, 1, ...) for each label at x `positions`, so that two labels in one row stand at least
    `gap` x `span` apart: the lowest such row, in order of x (labels of close events stack instead of overlapping)."""
    last: list[float] = []  # the x of each row's rightmost label so far
    rows = [0] * len(positions)
    for i in sorted(range(len(positions)), key=lambda i: positions[i]):
        row = next((r for r, x in enumerate(last) if positions[i] - x >= gap * span), len(last))
        if row == len(last):
            last.append(positions[i])
        last[row] = positions[i]
        rows[i] = row
    return rows


def plot_run(
    run_dir: str, applied: list[AppliedEvent], path: str, node_history: list[dict[str, Any]] | None = None
) -> str:
    """Two panels, written as a PNG to `path`: the loss per step (steps trained twice shaded, events marked), and
    the world size over wall-clock time (integer ticks; each event's span until training resumed shaded;
    restarts no event explains marked with a red x). With `node_history` (--autoscale) the second panel also
    draws the worker nodes alive, and the world size of every worker group from its start (a group that
    trained no step before the next restart shows too)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    metrics = read_jsonl(os.path.join(run_dir, METRICS_FILE))
    starts = read_jsonl(os.path.join(run_dir, EVENTS_FILE))
    line = timeline(starts, applied)
    fig, (loss_axis, world_axis) = plt.subplots(2, 1, figsize=(9, 7))
    loss_axis.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], color="tab:blue", label="loss")
    for first, last in line.retrained:
        loss_axis.axvspan(first - 0.5, last + 0.5, color="tab:red", alpha=0.15, lw=0)
    steps = [m["step"] for m in metrics] or [1]
    rows = label_rows([float(e.applied_step) for e in applied], float(max(steps) - min(steps) + 1))
    for event, row in zip(applied, rows, strict=True):
        loss_axis.axvline(event.applied_step, color="gray", linestyle="--", linewidth=1)
        loss_axis.annotate(
            event.kind,
            (event.applied_step, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(3, -12 - 11 * row),
            textcoords="offset points",
            fontsize=9,
            color="gray",
        )
    loss_axis.set_xlabel("optimizer step (red: steps trained again after a restart)")
    loss_axis.set_ylabel("training loss")
    batches = sorted({m["global_batch_size"] for m in metrics})
    loss_axis.set_title(f"raytrain demo: global batch {batches} at every step")

    times = [m["time"] - line.t0 for m in metrics]
    if node_history is None:
        world_axis.step(times, [m["world_size"] for m in metrics], where="post", color="tab:orange")
    else:
        end = times[-1] if times else 0.0
        group_times = [start["time"] - line.t0 for start in starts] + [end]
        group_sizes = [start["world_size"] for start in starts]
        world_axis.step(group_times, [*group_sizes, group_sizes[-1]], where="post", color="tab:orange", label="workers")
        node_times, nodes = node_counts(node_history, line.t0)
        world_axis.step(
            node_times, nodes, where="post", color="tab:green", linestyle="--", label="worker nodes (autoscaler)"
        )
    span = max([1.0, *times, *(end for _, end, _ in line.recoveries)])
    rows = label_rows([begin for begin, _, _ in line.recoveries], span, gap=0.15)
    for (begin, end, kind), row in zip(line.recoveries, rows, strict=True):
        world_axis.axvspan(begin, end, color="tab:gray", alpha=0.2, lw=0)
        world_axis.annotate(
            f"{kind}: {end - begin:.0f} s",
            (begin, 0.05 + 0.07 * row),
            xycoords=("data", "axes fraction"),
            fontsize=8,
            color="dimgray",
        )
    if line.unplanned:  # drawn, so in the legend; none drawn: no legend entry promising one
        whens, worlds = zip(*line.unplanned, strict=True)
        world_axis.plot(
            whens, worlds, linestyle="none", marker="x", color="tab:red", markersize=9, label="unplanned restart"
        )
    if line.unplanned or node_history is not None:
        world_axis.legend(loc="upper right", fontsize=8)
    world_axis.yaxis.set_major_locator(MaxNLocator(integer=True))
    sizes = [m["world_size"] for m in metrics] + [s["world_size"] for s in starts]
    world_axis.set_ylim(0, max([1, *sizes, *node_counts(node_history or [], 0.0)[1]]) + 1)
    world_axis.set_xlabel("seconds since the first start (gray: an event until training resumed)")
    world_axis.set_ylabel("workers")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _demo_data(options: DemoOptions, run_name: str, rows: int, features: int) -> Any:
    """The demo's training data: Parquet files in `<storage>/.demo-data/<run>` (written once, 64-row row groups),
    read in place in the exact order (default), or a Ray dataset streamed with `--no-deterministic`."""
    from raytrain.data.parquet import ParquetSource
    from raytrain.toy import regression_dataset, write_regression_parquet

    if not options.deterministic:
        return regression_dataset(rows, features, options.seed)
    directory = os.path.join(os.path.abspath(options.storage), ".demo-data", run_name)
    marker = os.path.join(directory, f"rows-{rows}-features-{features}-seed-{options.seed}")
    if not os.path.exists(marker):
        shutil.rmtree(directory, ignore_errors=True)
        write_regression_parquet(directory, rows, features, options.seed, files=4, row_group=64)
        open(marker, "w").close()
    return ParquetSource(directory)


def run_demo(options: DemoOptions) -> dict[str, Any]:
    """Run the demo end to end and return its summary (also written to <run>/summary.json)."""
    import ray

    from raytrain.console import quiet_ray_logging
    from raytrain.storage import keep_out_of_uploads
    from raytrain.trainer import check_ray_address, check_storage_writable

    if "://" in options.storage:
        raise ConfigError(
            f"--storage must be a local directory for the demo (it writes its data set beside the runs), got "
            f"{options.storage!r}; object storage is for `raytrain fit` and the Python API (README: cloud cluster)"
        )
    events = parse_events(options.events)
    run_name = options.run_name or time.strftime("demo-%Y%m%d-%H%M%S")
    external = bool(os.environ.get("RAY_ADDRESS")) or ray.is_initialized()
    if external and options.autoscale:
        raise ConfigError(
            "--autoscale starts a cluster of its own (a head with Ray's autoscaler); it cannot run on an existing "
            f"cluster (RAY_ADDRESS={os.environ.get('RAY_ADDRESS', '')!r}): unset RAY_ADDRESS"
        )
    for note in options.warnings(embedded=not external):
        print(f"[raytrain demo] warning: {note}", file=output(), flush=True)
    check_ray_address()  # seconds, not minutes, for an address nobody answers at
    quiet_ray_logging()  # before the fake-node cluster starts
    run_dir = os.path.join(os.path.abspath(options.storage), run_name)
    check_storage_writable(run_dir)
    keep_out_of_uploads(options.storage)  # a .gitignore of * in a runs directory the demo creates
    with run_lock(run_dir):  # before any Ray process: the same run started twice refuses at once
        return _run(options, events, run_name, external)


def _run(options: DemoOptions, events: list[Event], run_name: str, external: bool) -> dict[str, Any]:
    """`run_demo` once its options are checked and the run is locked."""
    import ray

    from raytrain.config import BatchConfig, CheckpointConfig, ClusterConfig, LoopConfig, LRConfig, ParallelConfig
    from raytrain.console import init_ray
    from raytrain.toy import adamw, mlp_factory, mlp_tp_plan, squared_error
    from raytrain.trainer import ElasticTrainer, apply_ray_env_defaults, own_state_api

    apply_ray_env_defaults()
    cluster: FakeCluster | AutoscaledNodes | None = None
    if external:
        if not ray.is_initialized():
            init_ray()
        resources: dict[str, float] = {"CPU": 1.0}
    else:
        own_state_api(1)  # the fake cluster has no dashboard: Ray's state API answers nothing, never another run
        cluster = (
            AutoscaledNodes(options.cluster_yaml, options.idle_timeout_s)
            if options.autoscale
            else FakeCluster(options.nodes, slots=options.slots_per_node)
        )
        init_ray(address=cluster.address)
        resources = {"CPU": 1.0, WORKER_SLOT: 1.0}
    features = 16
    rows = options.global_batch * options.epoch_steps  # every step, the last of an epoch too, is a full batch
    trainer = ElasticTrainer(
        model_fn=mlp_factory(features, 256),
        loss_fn=PacedLoss(squared_error, options.sample_time_s),
        optimizer_fn=adamw,
        datasets={"train": _demo_data(options, run_name, rows, features)},
        batch=BatchConfig(global_batch=options.global_batch, micro_batch=options.micro_batch),
        lr=LRConfig(base_lr=1e-3, base_batch=64, rule="sqrt", warmup_steps=5),
        loop=LoopConfig(
            epochs=None,  # max_steps ends the run, across as many epochs as it takes
            max_steps=options.steps,
            strategy=options.strategy,
            seed=options.seed,
            deterministic=options.deterministic,
            id_column="id",
            audit_samples=options.audit_samples,
            log_every=5,
        ),
        checkpoint=CheckpointConfig(
            storage_path=options.storage,
            run_name=run_name,
            every_steps=options.checkpoint_every,
            background_save=options.background_save,
        ),
        cluster=ClusterConfig(
            min_workers=options.min_workers,
            max_workers=options.max_workers,
            resources_per_worker=resources,
            resize_monitor_interval_s=options.resize_monitor_interval_s,
            recovery=options.recovery,
        ),
        parallel=ParallelConfig(tp=options.tp, pp=options.pp, dp_shard=options.dp_shard),
        tp_plan_fn=mlp_tp_plan,  # used when tp > 1: the hidden layer's units split over the tp workers
        required_columns=("x", "y"),
    )
    run_dir = trainer.spec.checkpoint.run_dir()
    live = options.recovery == "live"
    driver = EventDriver(
        events,
        run_dir,
        cluster,
        kill=(lambda: trainer.live_run.kill_replica()) if live else None,
        target=(lambda: trainer.live_run.event_node()) if live else None,
    )
    for event in events:
        if cluster is None and event.kind != "kill":
            driver.skipped.append(f"{event.kind}@{event.step}: only the demo's own fake-node cluster can do this")
    driver.pending = [e for e in events if cluster is not None or e.kind == "kill"]
    for note in driver.skipped:
        print(f"[raytrain demo] skipping {note}", file=output(), flush=True)
    started = time.time()
    scale_down_s: float | None = None
    try:
        result = driver.train(trainer.fit, options.timeout_s)
        if isinstance(cluster, AutoscaledNodes):
            print(
                f"[raytrain demo] training done; waiting for the autoscaler to remove the idle worker nodes "
                f"(idle timeout {options.idle_timeout_s:.0f} s)",
                file=output(),
                flush=True,
            )
            scale_down_s = cluster.wait_for_scale_down(options.idle_timeout_s + 60.0)
    finally:
        if cluster is not None:
            ray.shutdown()
            cluster.shutdown()
    metrics = read_jsonl(result.metrics_path)
    starts = read_jsonl(result.events_path)
    completed_epochs = len(metrics) // options.epoch_steps
    live_part = live_summary(metrics, driver.applied, trainer.live_run.result) if live else None  # fills driver.applied
    summary: dict[str, Any] = {
        "run_dir": run_dir,
        "steps": len(metrics),
        "wall_s": round(time.time() - started, 1),
        "final_loss": metrics[-1]["loss"] if metrics else None,
        "global_batch_sizes": sorted({m["global_batch_size"] for m in metrics}),
        "world_sizes": [w for w, _ in itertools.groupby(m["world_size"] for m in metrics)]
        if live
        else [s["world_size"] for s in starts],
        "layouts": [s.get("layout") for s in starts] if options.tp * options.pp > 1 else None,
        "restarts": len(starts) - 1,  # live mode: only its fallbacks restart
        "events": [
            {**asdict(e), "recovery_s": e.recovery_s, "steps_lost": e.steps_lost, "grown_s": e.grown_s}
            for e in driver.applied
        ],
        "skipped_events": driver.skipped,
        "plot": plot_run(
            run_dir,
            driver.applied,
            os.path.join(run_dir, "loss_world_size.png"),
            cluster.history if isinstance(cluster, AutoscaledNodes) else None,
        ),
        "metrics": result.metrics_path,
        "checkpoint": result.checkpoint.path if result.checkpoint is not None else None,
    }
    if live_part is not None:
        summary["live"] = live_part
    if isinstance(cluster, AutoscaledNodes):
        summary["autoscale"] = {
            "initial_worker_nodes": cluster.initial_worker_nodes,
            **autoscale_summary(
                metrics, starts, cluster.history, cluster.reclaimed, started, options.max_workers, scale_down_s
            ),
        }
    if options.audit_samples and result.samples_path:
        summary["samples"] = result.samples_path
        summary["audit"] = audit_epochs(result.samples_path, rows, completed_epochs)
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
