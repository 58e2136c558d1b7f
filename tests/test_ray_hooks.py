"""Every internal (non-public) Ray name `raytrain.ray_hooks` relies on, with the shape it relies on.

A Ray upgrade that renames a module, a class, a hook or a field fails here by name, in a second and without a
cluster, instead of as a silent no-op callback or an AttributeError inside Ray Train's controller.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def parameters(function: Any) -> list[str]:
    """The names of `function`'s parameters, without `self` and without `_ray_trace_ctx`, which Ray's tracing adds
    to an actor class's methods once the class has been made an actor in this process (e.g. by Ray Data)."""
    return [name for name in inspect.signature(function).parameters if name not in ("self", "_ray_trace_ctx")]


def field_names(cls: type) -> set[str]:
    assert dataclasses.is_dataclass(cls), f"{cls.__qualname__} is no longer a dataclass"
    return {field.name for field in dataclasses.fields(cls)}


@pytest.mark.parametrize(
    ("base", "hook", "expected"),
    [
        ("WorkerGroupCallback", "after_worker_group_start", ["worker_group"]),
        ("WorkerGroupCallback", "after_worker_group_poll_status", ["worker_group_status"]),
        ("ControllerCallback", "after_controller_state_update", ["previous_state", "current_state"]),
        ("ControllerCallback", "before_controller_execute_failure_decision", ["failure_decision"]),
    ],
)
def test_the_callback_hooks_exist_with_their_parameters(base: str, hook: str, expected: list[str]) -> None:
    from ray.train.v2._internal.execution import callback

    cls = getattr(callback, base)
    assert hasattr(cls, hook), f"Ray Train's {base} has no {hook} any more"
    assert parameters(getattr(cls, hook)) == expected


def test_our_callbacks_override_only_hooks_that_exist() -> None:
    from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

    from raytrain.ray_hooks import RefreshClusterView, RunLog, StopRepeatedUserErrors

    for ours in (StopRepeatedUserErrors, RunLog, RefreshClusterView):
        bases = [base for base in (WorkerGroupCallback, ControllerCallback) if issubclass(ours, base)]
        assert bases
        own = {name for name in vars(ours) if not name.startswith("_") and callable(vars(ours)[name])}
        for name in own:
            assert any(hasattr(base, name) for base in bases), f"{ours.__name__}.{name} is no hook of {bases}"


def test_the_controller_states_and_the_fields_read_from_them() -> None:
    from ray.train.v2._internal.execution.controller import state
    from ray.train.v2._internal.execution.scaling_policy.scaling_policy import ResizeDecision

    for name in ("RestartingState", "ReschedulingState", "ErroredState"):
        assert parameters(getattr(state, name).__init__) == ["training_failed_error"]
    assert parameters(state.ResizingState.__init__) == ["scaling_decision"]
    assert issubclass(state.InitializingState, state.TrainControllerState)  # RefreshClusterView's waiting states
    assert "num_workers" in field_names(ResizeDecision)


def test_the_worker_group_fields_read_by_the_callbacks() -> None:
    from ray.train.v2._internal.execution.context import DistributedContext
    from ray.train.v2._internal.execution.worker_group import ActorMetadata, Worker, WorkerGroup, WorkerGroupPollStatus

    assert hasattr(WorkerGroup, "get_workers")
    assert {"metadata", "distributed_context"} <= set(parameters(Worker.__init__))
    assert "node_id" in field_names(ActorMetadata)
    assert "world_rank" in field_names(DistributedContext)
    assert isinstance(inspect.getattr_static(WorkerGroupPollStatus, "errors"), property)


def test_controller_error_is_not_retried_and_wraps_an_exception() -> None:
    from ray.train.v2.api.exceptions import ControllerError

    from raytrain.errors import UserCodeError

    wrapped = ControllerError(UserCodeError("a bug"))
    assert wrapped.controller_failure.args == ("a bug",)


def test_the_preemption_context_of_a_worker() -> None:
    from ray.train.v2._internal.execution.context import TrainContext, get_train_context
    from ray.train.v2._internal.execution.preemption import PreemptionContext

    assert callable(get_train_context)
    assert "preemption_context" in field_names(TrainContext)
    assert "preemption_info" in field_names(PreemptionContext)


def test_the_autoscaling_coordinator_can_be_told_to_recompute() -> None:
    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as coordinator

    assert parameters(coordinator.get_or_create_autoscaling_coordinator) == []
    assert parameters(coordinator._AutoscalingCoordinatorActor.get_reserved_resources) == ["requester_id", "recompute"]


def test_the_gcs_drain_call_and_its_reason() -> None:
    from ray._raylet import InnerGcsClient  # type: ignore[attr-defined]  # GcsClient forwards to it
    from ray.core.generated import autoscaler_pb2

    assert hasattr(InnerGcsClient, "drain_node")
    assert autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION") > 0  # type: ignore[attr-defined]


def test_the_gcs_lists_the_nodes_being_drained() -> None:
    from ray._private.state import GlobalState

    assert parameters(GlobalState.get_draining_nodes) == []


def test_the_gcs_view_of_available_resources_per_node() -> None:
    from ray._private import state

    assert parameters(state.available_resources_per_node) == []


def test_what_the_start_watch_reads_the_controllers_wait_from() -> None:
    """`raytrain.start_watch`: the GCS's actor record by id; the controller's first state change comes in `run`
    (its `__init__` only sets the initial state), so `RunLog`'s first call means the run loop has begun."""
    from ray._private import state
    from ray.core.generated import common_pb2
    from ray.train.v2._internal.execution.controller.controller import TrainController

    from raytrain.ray_hooks import death_cause_text

    assert parameters(state.actors)[0] == "actor_id"
    assert "self._set_state(" not in inspect.getsource(TrainController.__init__)
    # the constructor's `_start` changes the state only when a start callback failed (the run then ends at once)
    start = inspect.getsource(TrainController._start)
    assert start.count("self._set_state(") == 1 and start.index("if failure_result") < start.index("self._set_state(")
    assert "_run_control_loop_iteration" in inspect.getsource(TrainController.run)
    cause = common_pb2.ActorDeathCause()  # the record's DeathCause: a protobuf with one of several contexts
    assert death_cause_text(cause) == ""
    cause.actor_died_error_context.error_message = "The actor died because its worker process exited"
    assert death_cause_text(cause) == "The actor died because its worker process exited"
    cause.runtime_env_failed_context.error_message = "pip install failed"
    assert death_cause_text(cause) == "pip install failed"


def test_the_driver_printer_that_is_made_one_line() -> None:
    import ray._private.worker as ray_worker

    assert parameters(ray_worker.print_to_stdstream) == ["data", "ignore_prefix"]


def test_ray_is_pinned_to_the_minor_version_these_names_were_read_from() -> None:
    import ray

    pyproject = (REPO / "pyproject.toml").read_text()
    match = re.search(r'"ray\[[^\]]*\]>=(\d+)\.(\d+),<(\d+)\.(\d+)"', pyproject)
    assert match, "pyproject.toml must pin ray to a minor-version range (the internals above are not stable API)"
    low, high = (int(match[1]), int(match[2])), (int(match[3]), int(match[4]))
    assert high == (low[0], low[1] + 1), f"ray pinned to {low}..{high}: one minor version at a time"
    installed = tuple(int(part) for part in ray.__version__.split(".")[:2])
    assert low <= installed < high, f"ray {ray.__version__} installed, pyproject allows {low}..{high}"


def test_the_elastic_policy_hooks_whole_replicas_counts_per_node() -> None:
    """`WholeReplicasPolicy` overrides Ray's per-node worker count and `torch_trainer_class` the controller start;
    with tp 2, 3 + 2 free slots hold 2 + 2 workers (no TP group across nodes), and replicas of 4 round 6 to 4."""
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy

    from raytrain.ray_hooks import WholeReplicasPolicy, torch_trainer_class

    assert parameters(ElasticScalingPolicy._count_possible_workers) == ["reserved_resources"]
    assert parameters(ElasticScalingPolicy.__init__) == ["scaling_config"]
    assert "scaling_policy" in inspect.getsource(TorchTrainer.fit)  # passed to _initialize_and_run_controller
    assert parameters(TorchTrainer._initialize_and_run_controller) == ["controller_init_kwargs"]
    config = ScalingConfig(num_workers=(2, 8), resources_per_worker={"CPU": 1, "worker_slot": 1})
    nodes = {"a": {"CPU": 3, "worker_slot": 3}, "b": {"CPU": 2, "worker_slot": 2}}
    assert ElasticScalingPolicy(config)._count_possible_workers(nodes) == 5  # Ray alone: a TP group across a and b
    assert WholeReplicasPolicy(config, tp=2, replica=2)._count_possible_workers(nodes) == 4
    assert WholeReplicasPolicy(config, tp=2, replica=2)._count_possible_workers({"a": nodes["a"]}) == 2
    three = {**nodes, "c": {"CPU": 2, "worker_slot": 2}}
    assert WholeReplicasPolicy(config, tp=2, replica=4)._count_possible_workers(three) == 4
    assert WholeReplicasPolicy(config, tp=2, replica=2)._count_possible_workers({}) == 0
    free = ScalingConfig(num_workers=(2, 7), resources_per_worker={"CPU": 0})  # Ray: no resources, max_workers
    assert WholeReplicasPolicy(free, tp=2, replica=2)._count_possible_workers(nodes) == 6
    assert issubclass(torch_trainer_class(1, 1), TorchTrainer) and issubclass(torch_trainer_class(2, 2), TorchTrainer)
    # Ctrl-C: Ray registers its SIGINT handler through this method (it waits on the controller inside the handler);
    # raytrain's subclass keeps the controller instead, so the default handler raises KeyboardInterrupt at once.
    assert "_register_sigint_handler(controller)" in inspect.getsource(TorchTrainer._initialize_and_run_controller)
    trainer = torch_trainer_class(1, 1).__new__(torch_trainer_class(1, 1))
    import signal

    before = signal.getsignal(signal.SIGINT)
    trainer._register_sigint_handler("controller")
    assert signal.getsignal(signal.SIGINT) is before and trainer.controller == "controller"


def test_a_lost_worker_is_said_in_words_not_in_gloos_text() -> None:
    from types import SimpleNamespace

    from raytrain.ray_hooks import describe_error, error_detail

    echoes = {
        0: RuntimeError(
            "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer"
        ),
        2: RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer."),
    }
    lost = SimpleNamespace(worker_failures=echoes)
    assert describe_error(lost) == "a worker was lost (ranks 0, 2 lost the connection to it)"  # type: ignore[arg-type]
    assert "Connection closed by peer" in error_detail(lost)  # type: ignore[arg-type]  # kept in raytrain.log
    bug = SimpleNamespace(worker_failures={**echoes, 1: ValueError("loss_fn must return one loss per sample")})
    assert describe_error(bug) == "rank 1: ValueError: loss_fn must return one loss per sample (and 2 more)"  # type: ignore[arg-type]


@pytest.mark.ray
def test_lost_nodes_are_judged_on_one_node_table_fetch_whatever_their_number(
    ray_local: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`leaving_nodes` probes 64 nodes (this instance's node, alive and answering, and 63 the GCS never knew) on
    one `ray.nodes()` fetch: the controller's calls per round do not grow with the cluster (one fetch per node
    probed cost a 64-node cluster 64 fetches of 64 records)."""
    import ray

    from raytrain.ray_hooks import leaving_nodes

    fetches: list[int] = []
    fetch = ray.nodes

    def counted() -> Any:
        fetches.append(1)
        return fetch()

    monkeypatch.setattr(ray, "nodes", counted)
    here = ray.get_runtime_context().get_node_id()
    unknown = {f"{i:056x}" for i in range(1, 64)}
    assert leaving_nodes({here, *unknown}) == unknown
    assert len(fetches) == 1
