"""raytrain's hooks into Ray Train's controller: the one module that uses Ray Train's internal (non-public) names.

Ray Train V2 accepts controller and worker-group callbacks through `RunConfig(callbacks=[...])` (its own
comments call this the way to build workarounds on internal callbacks), but their base classes live under
`ray.train.v2._internal`. Everything that depends on those names is here, and `tests/test_ray_hooks.py` fails
loudly if a Ray upgrade renames or reshapes them; `pyproject.toml` pins Ray to the 2.x range tested.

    StopRepeatedUserErrors   end the run when the same marked exception recurs at the same step (a bug)
    RunLog                   one line in <run>/raytrain.log per restart, resize or failure of the worker group
    RefreshClusterView       after a failure, wait until the group's lost or drained nodes are marked dead, then
                             refresh the elastic policy's view of the cluster, so the first restart uses the size
                             that fits now
    WholeReplicasPolicy      Ray Train's elastic scaling policy, counting workers in whole tensor-parallel groups per
                             node and whole replicas in all (Ray does the same for TPU slices)
    torch_trainer_class      TorchTrainer whose controller gets `WholeReplicasPolicy` when a replica has > 1 worker
    preemption_deadline_ms   in a worker: the drain Ray Train's preemption watcher announced for its node
    drain_node               ask the GCS to drain a node with a deadline (what a cloud's spot notice becomes)
"""

from __future__ import annotations

import time
from typing import Any

from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
from ray.train.v2._internal.execution.controller import state as controller_state
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy
from ray.train.v2.api.exceptions import ControllerError

from raytrain.console import DETAIL_PREFIX, append_line, counted, output
from raytrain.errors import UserCodeError
from raytrain.failures import Signature, is_storage_error, signature, traceback_of, with_frames
from raytrain.start_watch import mark_began


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
            if found.fatal:
                raise ControllerError(user_code_error(fatal_message(found, error), error))
            first = self._first_seen.setdefault(found, self._attempt)
            if first != self._attempt:
                raise ControllerError(
                    user_code_error(
                        f"{found.describe(rank)}, the same in two attempts of the worker group: a bug in the "
                        "training code, not retried (the latest checkpoint is kept; fix the code and run again)",
                        error,
                    )
                )


def user_code_error(message: str, error: BaseException) -> UserCodeError:
    """The `UserCodeError` for a worker's marked `error`: `message`, then the user's frames the worker rendered
    (file, line, code); the whole traceback rides along as its `worker_traceback` attribute, for raytrain.log."""
    stopped = UserCodeError(with_frames(message, error))
    stopped.worker_traceback = traceback_of(error)  # type: ignore[attr-defined]
    return stopped


def failure_tracebacks(error: BaseException | None) -> list[str]:
    """The whole tracebacks behind a worker-group failure, for raytrain.log's detail lines: each rank's marked
    error (`raytrain.failures.mark`), or the `UserCodeError` that stopped the run; none for a lost worker."""
    if error is None:
        return []
    inner = getattr(error, "controller_failure", None)
    stopped = getattr(inner if inner is not None else error, "worker_traceback", None)
    if isinstance(stopped, str):
        return [stopped]
    failures = getattr(error, "worker_failures", None) or {}
    found = []
    for rank, failure in sorted(failures.items()):
        base = getattr(failure, "_base_exc", failure)
        if signature(base) is not None:
            found.append(f"rank {rank}: {traceback_of(base)}")
    return found


COLLECTIVE_NOISE = ("gloo", "nccl", "connection reset", "connection closed")


def error_detail(error: BaseException | None) -> str:
    """The first line of every rank's failure, for raytrain.log's detail lines (not shown on the console)."""
    failures = getattr(error, "worker_failures", None) or {}
    parts = [f"rank {rank}: {_first_sentence(getattr(f, '_base_exc', f), 400)}" for rank, f in sorted(failures.items())]
    return "; ".join(parts) or (_first_sentence(error, 400) if error is not None else "")


def describe_error(error: BaseException | None) -> str:
    """One short line for a worker-group failure: the cause rather than its echoes (a rank whose peer died sees a
    collective's "connection reset"; the dead rank's own error says why), or the error itself."""
    if error is None:
        return "unknown error"
    failures = getattr(error, "worker_failures", None)
    if failures:
        unwrapped = {rank: getattr(failure, "_base_exc", failure) for rank, failure in failures.items()}
        rank, failure = min(unwrapped.items(), key=lambda item: (_is_echo(item[1]), item[0]))
        if _is_echo(failure):  # every report is a survivor's view of a peer that is gone: say that, not gloo's text
            seen = ", ".join(str(r) for r in sorted(unwrapped))
            return f"a worker was lost (rank{'s' if len(unwrapped) > 1 else ''} {seen} lost the connection to it)"
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        return f"rank {rank}: {_first_sentence(failure)}{more}"
    inner = getattr(error, "controller_failure", None)
    return _first_sentence(inner if inner is not None else error)


def _is_echo(error: BaseException) -> bool:
    text = str(error).lower()
    return any(word in text for word in COLLECTIVE_NOISE)


def _first_sentence(error: BaseException, limit: int = 160) -> str:
    """The error's type and its message's first sentence, or its first `limit` characters ended at a word and
    marked "..." (never cut mid-word)."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text = lines[0] if lines else ""
    end = text.find(". ", 20)
    if 0 < end < limit:
        text = text[: end + 1]
    elif len(text) > limit:
        cut = text.rfind(" ", 0, limit)
        text = text[: cut if cut > limit // 2 else limit].rstrip(" ,;:") + " ..."
    return f"{type(error).__name__}: {text}"


def quiet_driver_error_messages() -> None:
    """Ray's driver prints every error the cluster publishes (a raylet's death with its last 20 log lines, for
    instance) in full; make it one line each, `[ray] <first sentence>`. Changes only this process's printing."""
    import ray._private.worker as ray_worker

    original = ray_worker.print_to_stdstream
    if getattr(original, "__name__", "") == "one_line":
        return

    def one_line(data: dict[str, Any], ignore_prefix: bool) -> None:
        if data.get("pid") != "raylet":
            original(data, ignore_prefix)
            return
        for message in data.get("lines", []):
            first = next((line for line in str(message).splitlines() if line.strip()), "")
            end = first.find(". ")
            text = first[: end + 1] if end > 0 else first[:200]
            if "raylet is terminated" in text.lower():  # a node leaving: raytrain's own line says what it means
                continue
            print(f"[ray] {text}", file=output(), flush=True)

    ray_worker.print_to_stdstream = one_line


def fatal_message(found: Signature, error: BaseException) -> str:
    """The one line for a failure that is not retried at all (`raytrain.failures.mark`'s fatal ones)."""
    if is_storage_error(error):
        return (
            f"the run's storage is full or not writable ({found.kind}: {found.message}, {found.at}); the latest "
            "committed checkpoint is intact: free space or fix the permissions and run the same command again"
        )
    return f"{found.kind}: {found.message}"


FAILED_STATES = (controller_state.RestartingState, controller_state.ErroredState)


def append_detail(run_dir: str, text: str) -> None:
    """Append `text` to raytrain.log as detail lines, each line prefixed (the terminal's tail skips them all)."""
    append_line(run_dir, "\n".join(f"{DETAIL_PREFIX} {line}" for line in text.splitlines()))


class RunLog(ControllerCallback):
    """Runs in the Ray Train controller and appends one line per state change that matters to the user to
    `<run_dir>/raytrain.log` (the driver prints that file; Ray's own output is not forwarded by default):
    a failed worker group being restarted, a start that failed being retried, a resize, the final error. Before
    its first state change the driver's `StartWatch` speaks instead."""

    def __init__(self, run_dir: str, request: str = "the worker group", repeat_s: float = 60.0) -> None:
        self.run_dir, self.request, self.repeat_s = run_dir, request, repeat_s
        self._waiting_since: float | None = None  # the first failed start of the current wait
        self._said_at = 0.0
        self._attempts = 0
        self._began = False

    def after_controller_state_update(self, previous_state: Any, current_state: Any) -> None:
        """Write the line for `current_state`, if it is one of the above. A start that keeps failing (the cluster
        lacks the room) is said once, naming what the run waits for, then once a minute with the time waited.
        The first call (the run loop has begun) also ends the driver's `raytrain.start_watch.StartWatch`."""
        if not self._began:
            self._began = True
            mark_began(self.run_dir)
        error = getattr(current_state, "training_failed_error", None)
        if isinstance(current_state, controller_state.ReschedulingState):
            now = time.monotonic()
            self._attempts += 1
            if self._waiting_since is None:
                self._waiting_since = now
            elif now - self._said_at < self.repeat_s:
                return
            self._said_at = now
            waited = (
                f"{now - self._waiting_since:.0f} s, {self._attempts} attempts so far; " if self._attempts > 1 else ""
            )
            line = (
                f"waiting for room for {self.request} ({waited}{describe_error(error)}); trying again (said again "
                f"every {self.repeat_s:.0f} s; Ctrl-C stops)"
            )
            append_line(self.run_dir, f"[raytrain] {line}")
            return
        if isinstance(current_state, controller_state.RunningState):
            self._waiting_since, self._attempts = None, 0
        for text in failure_tracebacks(error) if isinstance(current_state, FAILED_STATES) else []:
            append_detail(self.run_dir, text)
        if isinstance(current_state, controller_state.RestartingState):
            line = f"worker group failed ({describe_error(error)}): restarting from the latest checkpoint"
            append_line(self.run_dir, f"{DETAIL_PREFIX} {error_detail(error)}")
        elif isinstance(current_state, controller_state.ResizingState):
            decision: Any = current_state.scaling_decision  # a ResizeDecision in this state
            count = decision.num_workers
            line = f"cluster changed: restarting the worker group at {counted(count, 'worker')}"
        elif isinstance(current_state, controller_state.ErroredState):
            if isinstance(getattr(error, "controller_failure", None), UserCodeError):
                # the driver raises it, whole (the CLI prints it): the log keeps it, the terminal says it once
                append_detail(self.run_dir, f"training failed: {error.controller_failure}")  # type: ignore[union-attr]
                return
            line = f"training failed: {describe_error(error)}"
        else:
            return
        append_line(self.run_dir, f"[raytrain] {line}")


NODE_DEATH_PATIENCE_S = 60.0  # the longest wait for the GCS to mark an unreachable node dead
FAST_NODE_DEATH = {  # GCS settings for clusters raytrain starts: an unreachable node is marked dead in ~3-5 s
    "health_check_initial_delay_ms": 2000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 2000,
    "health_check_failure_threshold": 4,
}


# Ray Train 2.60 controller states in which the controller waits for a scaling decision with no group running.
WAITING_STATES = (
    controller_state.InitializingState,
    controller_state.RestartingState,
    controller_state.ReschedulingState,
)


class RefreshClusterView(WorkerGroupCallback, ControllerCallback):
    """Runs in the Ray Train controller and makes the first restart after a node loss use the size the cluster can
    hold now. Ray Train's elastic policy sees the cluster through the autoscaling coordinator, which re-reads the
    node list every 20 s; right after a node dies it still counts that node, schedules the old size and waits for
    the worker-group start timeout before trying the right one. Before each failure decision this callback looks
    at every node of the worker group (not only those of the ranks that reported an error: a survivor's
    "connection reset" often arrives before the dead rank's error): a node whose raylet does not answer, or that
    is being drained, is waited for (at most `NODE_DEATH_PATIENCE_S`) until the GCS marks it dead; then the
    coordinator recomputes its view. While the group runs it compares the set of alive nodes every
    `monitor_interval_s` and refreshes the view when a node has joined or left, so a grow is seen at the next
    resize check instead of the coordinator's next tick."""

    def __init__(self, run_dir: str, monitor_interval_s: float) -> None:
        self.run_dir = run_dir
        self.monitor_interval_s = monitor_interval_s
        self._group_nodes: set[str] = set()
        self._alive_nodes: frozenset[str] | None = None
        self._checked_at = float("-inf")

    def after_worker_group_start(self, worker_group: Any) -> None:
        """Remember the nodes the group runs on."""
        self._group_nodes = {worker.metadata.node_id for worker in worker_group.get_workers()}

    def after_worker_group_poll_status(self, worker_group_status: Any) -> None:
        """Refresh the view when the set of alive nodes changed (checked every `monitor_interval_s`)."""
        if not worker_group_status.errors:
            self._refresh_if_nodes_changed()

    def after_controller_state_update(self, previous_state: Any, current_state: Any) -> None:
        """While no group runs (waiting for `min_workers`, e.g. until an autoscaler's nodes are up), refresh the
        view as soon as nodes join, so the group starts at the next decision instead of the coordinator's tick.
        (The controller calls this after every loop iteration, also when the state did not change.)"""
        if isinstance(current_state, WAITING_STATES):
            self._refresh_if_nodes_changed()

    def _refresh_if_nodes_changed(self) -> None:
        import time

        import ray

        if time.monotonic() - self._checked_at < self.monitor_interval_s:
            return
        self._checked_at = time.monotonic()
        alive = frozenset(n["NodeID"] for n in ray.nodes() if n["Alive"])
        if self._alive_nodes is not None and alive != self._alive_nodes:
            refresh_cluster_view()
        self._alive_nodes = alive

    def before_controller_execute_failure_decision(self, failure_decision: Any) -> None:
        """Wait for the group's lost and drained nodes to be marked dead, then refresh the coordinator's view."""
        import time

        started = time.monotonic()
        gone = sorted(leaving_nodes(self._group_nodes))
        while gone and time.monotonic() - started < NODE_DEATH_PATIENCE_S:
            records = node_records()  # one fetch per round, whatever the number of nodes
            if not any(records.get(node, {}).get("Alive") for node in gone):
                break
            time.sleep(0.2)
        if gone:
            waited = time.monotonic() - started
            names = ", ".join(short_node_id(node) for node in gone)
            append_line(self.run_dir, f"[raytrain] node {names} lost (marked dead after {waited:.1f} s)")
        refresh_cluster_view()


class WholeReplicasPolicy(ElasticScalingPolicy):
    """Ray Train's elastic policy with one change: the workers it counts on each node are rounded down to a multiple
    of `tp` (a tensor-parallel group never spans two nodes), and the total to a multiple of `replica` (tp * pp
    workers train one data-parallel replica), so every size Ray Train chooses is a layout raytrain can run. Runs in
    the controller."""

    def __init__(self, scaling_config: Any, tp: int, replica: int) -> None:
        super().__init__(scaling_config)
        self.tp, self.replica = tp, replica

    def _count_possible_workers(self, reserved_resources: Any) -> int:
        per_node = [
            super(WholeReplicasPolicy, self)._count_possible_workers({n: r}) for n, r in reserved_resources.items()
        ]
        total = min(sum(count - count % self.tp for count in per_node), self.scaling_config.max_workers)
        return total - total % self.replica


def torch_trainer_class(tp: int, replica: int) -> Any:
    """A `TorchTrainer` subclass that Ctrl-C stops at any moment, and for a model-parallel layout (replica > 1)
    whose controller scales elastically with `WholeReplicasPolicy` (a fixed-size run keeps Ray's fixed policy: its
    size is checked by the config).

    Ctrl-C: Ray Train's own SIGINT handler asks the controller to abort and waits for it, in the signal handler;
    while the controller is busy (e.g. retrying a worker group that cannot start) that wait does not end, and Ctrl-C
    is lost. This class installs no handler, so Ctrl-C raises `KeyboardInterrupt` in `fit` at once, and `stop()`
    then kills the controller (its workers go with it)."""
    from ray.train.torch import TorchTrainer

    class RaytrainTorchTrainer(TorchTrainer):
        controller: Any = None

        def _register_sigint_handler(self, controller: Any) -> None:
            self.controller = controller

        def _initialize_and_run_controller(self, **controller_init_kwargs: Any) -> Any:
            if replica > 1 and isinstance(controller_init_kwargs.get("scaling_policy"), ElasticScalingPolicy):
                controller_init_kwargs["scaling_policy"] = WholeReplicasPolicy(self.scaling_config, tp, replica)
            return super()._initialize_and_run_controller(**controller_init_kwargs)  # type: ignore[misc]

        def stop(self) -> None:
            """End the run now (after Ctrl-C): kill its controller, whose workers are killed with it."""
            import ray

            if self.controller is not None:
                ray.kill(self.controller, no_restart=True)

    return RaytrainTorchTrainer


def actor_id(handle: Any) -> str | None:
    """The hex id of the actor behind `handle` (None for None)."""
    return None if handle is None else str(handle._actor_id.hex())


def actor_record(actor_id: str) -> dict[str, Any] | None:
    """The GCS's record of actor `actor_id` (`ActorID`, `State`, `StartTime` in ms once alive, `DeathCause` as the
    text of its error message, ...), asked of the GCS directly (no dashboard); None when the GCS has no record or
    does not answer."""
    from ray._private import state

    try:
        record = state.actors(actor_id=actor_id)
    except Exception:  # the GCS not answering: the caller says what it can without the record
        return None
    if not record:
        return None
    return {**record, "DeathCause": death_cause_text(record.get("DeathCause"))}


def death_cause_text(cause: Any) -> str:
    """The error message of a GCS `ActorDeathCause` (a protobuf holding one of several contexts); "" for none."""
    if cause is None:
        return ""
    if not hasattr(cause, "WhichOneof"):
        return str(cause)
    context = cause.WhichOneof("context")
    if context is None:
        return ""
    detail = getattr(cause, context)
    return str(getattr(detail, "error_message", "") or getattr(detail, "formatted_exception_string", "") or context)


def short_node_id(node_id: str) -> str:
    """Eight hex digits that tell nodes apart in a log line: Ray's usual prefix, or the suffix for the ids of Ray's
    fake node provider (`raytrain demo --autoscale`), which all start with f's and count up at the end."""
    return node_id[-8:] if node_id.startswith("ffffffffffffffff") else node_id[:8]


def nodes_using(resource: str) -> set[str]:
    """Ids of the alive nodes where some of `resource` is in use (reserved by a placement group or held by a task
    or actor), from the GCS's per-node view of available resources."""
    import ray
    from ray._private.state import available_resources_per_node

    available = available_resources_per_node()
    return {
        n["NodeID"]
        for n in ray.nodes()
        if n["Alive"] and available.get(n["NodeID"], {}).get(resource, 0.0) < n["Resources"].get(resource, 0.0)
    }


def node_records() -> dict[str, dict[str, Any]]:
    """Every node the GCS knows (alive or dead), by id: one `ray.nodes()` fetch, which callers make once per round
    and share, never once per node (a fetch returns every node: per node it would cost the cluster's size
    squared)."""
    import ray

    return {n["NodeID"]: n for n in ray.nodes()}


def leaving_nodes(nodes: set[str], records: dict[str, dict[str, Any]] | None = None) -> set[str]:
    """Those of `nodes` that are dead, unknown, being drained, or whose raylet does not answer (probed in
    parallel), judged on `records` (default: one `node_records()` fetch)."""
    from concurrent.futures import ThreadPoolExecutor

    from ray._private.state import state as ray_state

    if not nodes:
        return set()
    try:
        draining = set(ray_state.get_draining_nodes())
    except Exception:  # an older GCS: no drains known
        draining = set()
    records = node_records() if records is None else records
    probed = sorted(nodes - draining)
    with ThreadPoolExecutor(max_workers=min(32, len(probed) or 1)) as pool:
        answers = dict(zip(probed, pool.map(lambda node: _raylet_answers(records.get(node)), probed), strict=True))
    return (nodes & draining) | {node for node, answered in answers.items() if not answered}


def _raylet_answers(record: dict[str, Any] | None, timeout_s: float = 1.0) -> bool:
    """Whether the raylet of the node `record` describes is alive and accepts a TCP connection (a crashed
    worker's node does; a lost one not)."""
    import socket

    if record is None or not record["Alive"]:
        return False
    try:
        with socket.create_connection((record["NodeManagerAddress"], record["NodeManagerPort"]), timeout_s):
            return True
    except OSError:
        return False


def refresh_cluster_view() -> None:
    """Have Ray's autoscaling coordinator (the elastic policy's view of the cluster) re-read the nodes now instead
    of at its next 20 s tick. Best effort: a failure leaves the old view, which corrects itself at that tick."""
    import logging

    import ray
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    try:
        coordinator = get_or_create_autoscaling_coordinator()
        ray.get(coordinator.get_reserved_resources.remote("raytrain-refresh", recompute=True), timeout=10)
    except Exception as err:  # the next tick corrects the view
        logging.getLogger(__name__).warning("could not refresh the cluster view: %s", err)


def preemption_deadline_ms() -> int | None:
    """In a training worker: None, or the deadline (UNIX ms; 0 when unknown) of a drain that Ray Train's preemption
    watcher announced for a node of this worker group. Local: it does not synchronise the workers (which
    `ray.train.get_preemption_info` does, through an actor round trip); the loop all-reduces it itself."""
    from ray.train.v2._internal.execution.context import get_train_context

    info = get_train_context().preemption_context.preemption_info
    return None if info is None else int(info.deadline_ms or 0)


def drain_node(gcs_address: str, node_id_hex: str, deadline_s: float, message: str = "raytrain demo") -> None:
    """Announce that a node will go away in `deadline_s` seconds, as a cloud's preemption notice does through
    the autoscaler (GCS `DrainNode` with reason PREEMPTION). It does not stop the node: the caller removes it."""
    import time

    from ray._raylet import GcsClient  # type: ignore[attr-defined]
    from ray.core.generated import autoscaler_pb2

    deadline_ms = int(time.time() * 1000 + deadline_s * 1000)
    accepted, why = GcsClient(address=gcs_address).drain_node(
        node_id_hex,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),  # type: ignore[attr-defined]
        message,
        deadline_ms,
    )
    if not accepted:
        raise RuntimeError(f"the drain of node {short_node_id(node_id_hex)} was not accepted: {why}")
