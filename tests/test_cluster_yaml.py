"""cluster.yaml: valid for Ray's cluster launcher and laid out the way raytrain needs it (offline: no AWS, no network).

Validation is Ray's own: `prepare_config` (fills in the AWS defaults.yaml exactly as `ray up` does before it
talks to AWS) followed by `validate_config` (ray-schema.json plus Ray's cross-field checks), and
`AutoscalingConfig`, which the head's autoscaler (v2) builds from the same file. Negative controls prove the
validator rejects broken copies. The spot/on-demand comments in cluster.yaml are checked against Ray's v2
scheduler, the resource bundles against raytrain's and Ray Train's config classes.
"""

from __future__ import annotations

import copy
import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CLUSTER_YAML = REPO / "cluster.yaml"


@pytest.fixture(scope="module")
def text() -> str:
    return CLUSTER_YAML.read_text()


@pytest.fixture(scope="module")
def config(text: str) -> dict[str, Any]:
    loaded = yaml.safe_load(text)
    assert isinstance(loaded, dict), "cluster.yaml must be a mapping"
    return loaded


def ray_validate(config: dict[str, Any]) -> dict[str, Any]:
    """What `ray up` does with the file before any cloud call: fill in defaults, then validate. Returns it."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def node_types(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return config["available_node_types"]


def worker_types(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: t for name, t in node_types(config).items() if name != config["head_node_type"]}


def is_spot(node_type: dict[str, Any]) -> bool:
    return node_type["node_config"].get("InstanceMarketOptions", {}).get("MarketType") == "spot"


def fits(bundle: dict[str, float], resources: dict[str, float]) -> bool:
    return all(resources.get(name, 0) >= amount for name, amount in bundle.items() if amount > 0)


def all_commands(config: dict[str, Any]) -> list[str]:
    keys = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands")
    keys += ("head_start_ray_commands", "worker_start_ray_commands")
    commands = [c for key in keys for c in config.get(key) or []]
    for node_type in node_types(config).values():
        commands += node_type.get("initialization_commands", []) + node_type.get("worker_setup_commands", [])
    return commands


def head_start_command(config: dict[str, Any]) -> list[str]:
    starts = [shlex.split(c.split(";")[-1]) for c in config["head_start_ray_commands"] if "--head" in c]
    assert len(starts) == 1, f"expected one `ray start --head` command, got {config['head_start_ray_commands']}"
    return starts[0]


def raytrain_metadata(config: dict[str, Any]) -> dict[str, Any]:
    return config["metadata"]["raytrain"]


# --- Ray's own validation ---------------------------------------------------------------------------------


def test_ray_validates_the_file(config: dict[str, Any]) -> None:
    prepared = ray_validate(config)
    # Ray's defaults must not have replaced our commands (its AWS defaults bind the dashboard to 0.0.0.0).
    for key in ("head_start_ray_commands", "worker_start_ray_commands", "initialization_commands"):
        assert prepared[key] == config[key], key
    assert prepared["head_setup_commands"] == config["setup_commands"] + config["head_setup_commands"]


def test_head_autoscaler_v2_accepts_the_file(config: dict[str, Any]) -> None:
    from ray.autoscaler.v2.instance_manager.config import AutoscalingConfig

    autoscaling = AutoscalingConfig(copy.deepcopy(config), skip_content_hash=True)
    types = autoscaling.get_node_type_configs()
    assert set(types) == set(node_types(config))
    assert autoscaling.get_max_num_worker_nodes() == config["max_workers"]


def _set(path: tuple[str, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(config: dict[str, Any]) -> None:
        target = config
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


def _first_worker(config: dict[str, Any]) -> str:
    return next(iter(worker_types(config)))


NEGATIVE_CONTROLS = {
    "unknown top-level key": (lambda c: c.update(max_worker=4), "jsonschema", "max_worker"),
    "max_workers of the wrong type": (_set(("max_workers",), "eight"), "jsonschema", "eight"),
    "fractional worker_slot": (
        lambda c: node_types(c)[_first_worker(c)]["resources"].update(worker_slot=0.5),
        "jsonschema",
        "0.5",
    ),
    "unknown node-type key": (
        lambda c: node_types(c)[_first_worker(c)].update(min_worker=1),
        "jsonschema",
        "min_worker",
    ),
    "node type without resources": (
        lambda c: node_types(c)[_first_worker(c)].pop("resources"),
        "jsonschema",
        "resources",
    ),
    "head_node_type not a node type": (_set(("head_node_type",), "no-such-type"), ValueError, "head_node_type"),
    "min_workers above the global max_workers": (
        lambda c: node_types(c)[_first_worker(c)].update(min_workers=c["max_workers"] + 1),
        ValueError,
        "min_workers",
    ),
}


@pytest.mark.parametrize("case", sorted(NEGATIVE_CONTROLS))
def test_ray_rejects_broken_copies(config: dict[str, Any], case: str) -> None:
    import jsonschema

    mutate, expected, needle = NEGATIVE_CONTROLS[case]
    broken = copy.deepcopy(config)
    mutate(broken)
    error = jsonschema.ValidationError if expected == "jsonschema" else expected
    with pytest.raises(error) as raised:
        ray_validate(broken)
    assert needle in str(raised.value)


# --- Head and worker layout -------------------------------------------------------------------------------


def test_head_runs_no_training(config: dict[str, Any]) -> None:
    head = node_types(config)[config["head_node_type"]]
    resources = head["resources"]
    assert "worker_slot" not in resources, "a training worker asking for worker_slot must never fit on the head"
    assert resources.get("GPU") == 0, "declare GPU: 0 explicitly, so Ray never advertises a GPU on the head"
    assert resources.get("CPU", 0) >= 2, "the head needs CPUs for the driver and Ray Data"
    assert head.get("max_workers", 0) == 0 and head.get("min_workers", 0) == 0
    assert not is_spot(head), "a reclaimed head ends the cluster: keep it on-demand"


def test_every_worker_type_has_one_worker_slot(config: dict[str, Any]) -> None:
    workers = worker_types(config)
    assert workers
    for name, node_type in workers.items():
        assert node_type["resources"].get("worker_slot") == 1, name


def test_min_workers_at_most_max_workers(config: dict[str, Any]) -> None:
    for name, node_type in node_types(config).items():
        low, high = node_type.get("min_workers", 0), node_type.get("max_workers", config["max_workers"])
        assert 0 <= low <= high, f"{name}: min_workers={low} max_workers={high}"
    assert sum(t.get("min_workers", 0) for t in node_types(config).values()) <= config["max_workers"]


def test_every_worker_role_has_a_spot_and_an_on_demand_type(config: dict[str, Any]) -> None:
    roles: dict[tuple[str, tuple[tuple[str, int], ...]], dict[str, list[str]]] = {}
    for name, node_type in worker_types(config).items():
        key = (node_type["node_config"]["InstanceType"], tuple(sorted(node_type["resources"].items())))
        roles.setdefault(key, {"spot": [], "on-demand": []})["spot" if is_spot(node_type) else "on-demand"] += [name]
    assert any(dict(resources).get("GPU", 0) > 0 for _, resources in roles), "no GPU worker role"
    assert any(dict(resources).get("GPU", 0) == 0 for _, resources in roles), "no CPU worker role"
    types = node_types(config)
    for role, kinds in roles.items():
        assert kinds["spot"] and kinds["on-demand"], f"{role}: needs a spot and an on-demand type, got {kinds}"
        for spot in kinds["spot"]:
            for on_demand in kinds["on-demand"]:
                assert types[spot].get("priority", 0) > types[on_demand].get("priority", 0), (spot, on_demand)


def _schedule(config: dict[str, Any], bundle: dict[str, float], count: int, down: dict[str, float] | None = None):
    """Node types (name -> count) that Ray's v2 autoscaler would launch for `count` bundles on an empty cluster."""
    from ray.autoscaler.v2.instance_manager.config import AutoscalingConfig
    from ray.autoscaler.v2.scheduler import ResourceDemandScheduler, SchedulingRequest
    from ray.autoscaler.v2.utils import ResourceRequestUtil
    from ray.core.generated.autoscaler_pb2 import ResourceRequestByCount

    autoscaling = AutoscalingConfig(copy.deepcopy(config), skip_content_hash=True)
    request = SchedulingRequest(
        disable_launch_config_check=True,
        node_type_configs=autoscaling.get_node_type_configs(),
        max_num_nodes=autoscaling.get_max_num_nodes(),
        resource_requests=[ResourceRequestByCount(request=ResourceRequestUtil.make(bundle), count=count)],
        recoverable_resource_availabilities=down or {},
    )
    reply = ResourceDemandScheduler().schedule(request)
    launched: dict[str, int] = {}
    for launch in reply.to_launch:
        launched[launch.instance_type] = launched.get(launch.instance_type, 0) + launch.count
    return launched, len(reply.infeasible_resource_requests)


def _role_types(config: dict[str, Any], gpu: bool) -> tuple[str, str]:
    names = {is_spot(t): name for name, t in worker_types(config).items() if (t["resources"].get("GPU", 0) > 0) == gpu}
    return names[True], names[False]


def test_autoscaler_prefers_spot_and_spills_over_to_on_demand(config: dict[str, Any]) -> None:
    gpu_bundle = raytrain_metadata(config)["worker_resources"]["gpu"]["resources_per_worker"]
    spot, on_demand = _role_types(config, gpu=True)
    spot_max = node_types(config)[spot]["max_workers"]
    assert spot_max + 2 <= config["max_workers"]
    launched, infeasible = _schedule(config, gpu_bundle, spot_max + 2)
    assert launched == {spot: spot_max, on_demand: 2} and infeasible == 0


def test_cpu_training_launches_cpu_spot_nodes_only(config: dict[str, Any]) -> None:
    cpu_bundle = raytrain_metadata(config)["worker_resources"]["cpu"]["resources_per_worker"]
    spot, _ = _role_types(config, gpu=False)
    assert _schedule(config, cpu_bundle, 3) == ({spot: 3}, 0)


def test_autoscaler_uses_on_demand_while_spot_is_marked_unavailable(config: dict[str, Any]) -> None:
    gpu_bundle = raytrain_metadata(config)["worker_resources"]["gpu"]["resources_per_worker"]
    spot, on_demand = _role_types(config, gpu=True)
    # What Ray's CloudResourceMonitor reports for a type after an allocation timeout (recovering 0 -> 1).
    assert _schedule(config, gpu_bundle, 2, down={spot: 0.0}) == ({on_demand: 2}, 0)


# --- raytrain's side: resource bundles and storage --------------------------------------------------------


@pytest.mark.parametrize("role", ["cpu", "gpu"])
def test_recommended_worker_resources_fit_workers_only(config: dict[str, Any], role: str) -> None:
    from ray.train import ScalingConfig

    from raytrain.config import ClusterConfig

    spec = raytrain_metadata(config)["worker_resources"][role]
    bundle = spec["resources_per_worker"]
    cluster = ClusterConfig(min_workers=1, max_workers=4, use_gpu=spec["use_gpu"], resources_per_worker=bundle)
    ScalingConfig(num_workers=(1, 4), use_gpu=cluster.use_gpu, resources_per_worker=dict(bundle))
    assert bundle.get("worker_slot") == 1
    head = node_types(config)[config["head_node_type"]]
    assert not fits(bundle, head["resources"]), "the bundle must not fit on the head"
    hosts = [name for name, t in worker_types(config).items() if fits(bundle, t["resources"])]
    assert any(is_spot(node_types(config)[n]) for n in hosts) and any(not is_spot(node_types(config)[n]) for n in hosts)
    for name in hosts:  # leave CPUs on every node for Ray Data (README: Troubleshooting)
        assert bundle["CPU"] < node_types(config)[name]["resources"]["CPU"], name
    if role == "gpu":
        assert all(node_types(config)[n]["resources"].get("GPU", 0) >= 1 for n in hosts)


def test_checkpoints_go_to_s3_and_the_run_files_to_the_shared_mount(config: dict[str, Any], text: str) -> None:
    from raytrain.config import CheckpointConfig

    meta = raytrain_metadata(config)
    storage, log_dir, mount = meta["storage_path"], meta["log_dir"], meta["efs_mount_point"].rstrip("/")
    assert storage.startswith("s3://"), storage
    checkpoint = CheckpointConfig(storage_path=storage, log_dir=log_dir, run_name="r")
    assert not checkpoint.is_local and checkpoint.run_dir() == f"{log_dir}/r"
    assert log_dir.startswith(mount + "/"), (log_dir, mount)
    init = " ".join(config["initialization_commands"])
    assert re.search(rf"mount -t nfs4 .*:/ {re.escape(mount)}\b", init), "the EFS mount is missing"
    assert log_dir in init, "the run-files directory is not created on the mount"
    # Documented for the reader: the arguments to pass.
    assert f'storage_path="{storage}", log_dir="{log_dir}"' in text


# --- Dashboard and network exposure -----------------------------------------------------------------------


def test_dashboard_binds_to_loopback_only(config: dict[str, Any], text: str) -> None:
    start = head_start_command(config)
    assert start[:3] == ["ray", "start", "--head"]
    assert "--dashboard-host=127.0.0.1" in start
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in start
    assert "--dashboard-host=0.0.0.0" not in text and "--dashboard-host 0.0.0.0" not in text
    assert not any("0.0.0.0" in command for command in all_commands(config))
    assert "ray dashboard cluster.yaml" in text


def test_the_head_marks_lost_nodes_dead_as_fast_as_the_tested_clusters(config: dict[str, Any]) -> None:
    # The fake clusters of the tests and benchmarks start with FAST_NODE_DEATH (Ray accepts these keys there);
    # recovery figures measured on them hold for cluster.yaml only when its head starts with the same values.
    import json

    from raytrain.ray_hooks import FAST_NODE_DEATH

    flags = [arg for arg in head_start_command(config) if arg.startswith("--system-config=")]
    assert len(flags) == 1, "the head's `ray start` sets no --system-config"
    assert json.loads(flags[0].split("=", 1)[1]) == FAST_NODE_DEATH


def test_no_inbound_rule_for_ray_ports(config: dict[str, Any]) -> None:
    rules = config["provider"].get("security_group", {}).get("IpPermissions", [])
    for rule in rules:
        low, high = rule.get("FromPort", -1), rule.get("ToPort", -1)
        for port in (6379, 8265, 10001):
            assert not (low == -1 or low <= port <= high), f"inbound rule opens port {port}: {rule}"


def test_workers_join_the_head(config: dict[str, Any]) -> None:
    starts = [c for c in config["worker_start_ray_commands"] if "ray start" in c]
    assert len(starts) == 1 and "--address=$RAY_HEAD_IP:6379" in starts[0]
    assert "--port=6379" in head_start_command(config)


# --- Installing raytrain on the nodes ---------------------------------------------------------------------


def test_setup_installs_this_checkout(config: dict[str, Any]) -> None:
    import ray

    assert config["file_mounts"] == {"~/raytrain": "."}, "copy the checkout (ray up runs from the repo root)"
    assert 'name = "raytrain"' in (REPO / "pyproject.toml").read_text()
    setup = config["setup_commands"]
    install = setup.index("pip install -e ~/raytrain")
    torch = next(i for i, c in enumerate(setup) if 'pip install "torch' in c)
    assert torch < install, "install torch (CUDA or CPU build) before raytrain, which only asks for torch>=2.6"
    pins = [m for c in setup for m in re.findall(r'"ray\[train,default\]==([^"]+)"', c)]
    assert pins == [ray.__version__], f"pin Ray on the nodes to the local version {ray.__version__}, got {pins}"
    assert any("boto3" in c for c in config["head_setup_commands"]), "the head's autoscaler needs boto3"


def test_provider_settings(config: dict[str, Any]) -> None:
    assert config["cluster_name"] == "raytrain"
    assert config["provider"]["type"] == "aws" and config["provider"]["cache_stopped_nodes"] is False
    assert config["auth"]["ssh_user"] == "ubuntu"
    assert config["idle_timeout_minutes"] >= 1, "shorter than a worker-group restart could give nodes back mid-run"
    assert config["upscaling_speed"] > 0


def test_workers_run_the_spot_watcher_after_ray_start(config: dict[str, Any]) -> None:
    commands = config["worker_start_ray_commands"]
    start = next(i for i, c in enumerate(commands) if "ray start" in c)
    watchers = [i for i, c in enumerate(commands) if "raytrain.spot_watch" in c]
    assert watchers and watchers[0] > start, "start the spot watcher once the node has joined"
    watcher = commands[watchers[0]]
    assert "--address=$RAY_HEAD_IP:6379" in watcher and watcher.rstrip().endswith("&"), watcher
