"""A real Ray autoscaler on one machine, driven by `cluster.yaml`'s own node types.

    with LocalAutoscalingCluster.from_cluster_yaml("cluster.yaml") as cluster:
        ray.init(address=cluster.address)           # head only (plus each type's min_workers)
        ...                                         # pending demand -> the autoscaler launches fake nodes
        cluster.reclaim(node_id)                    # the "cloud" takes a node back, as a spot reclaim does

The head runs Ray's autoscaler (v2, as `ray up` starts it) with a node provider that starts each "instance" as
a local Ray node (Ray's `FakeMultiNodeProvider`, which the autoscaler loads in its own process). The node types,
their `worker_slot`s, `min_workers`/`max_workers`, `priority` and the cluster's `upscaling_speed` come from the
file users deploy; only the sizes are scaled down (`cpus_per_node` CPUs per node, GPU types left out on a machine
without GPUs) and the idle timeout shortened, so a test or `raytrain demo --autoscale` exercises the same node
types and the same autoscaler decisions as the cloud cluster, in seconds.

`reclaim` is the cloud side of a spot reclaim: the provider itself kills the node's processes without a grace
period and stops listing the instance, exactly what the autoscaler sees when a cloud takes an instance back. The
autoscaler then launches a replacement for demand still pending.

Nothing here touches another Ray instance on the machine: the head is started in-process with free ports (never
`ray stop`), and `shutdown` kills only the processes of the nodes this cluster's provider started, which it
records as it starts them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID, FakeMultiNodeProvider
from ray.autoscaler.tags import TAG_RAY_USER_NODE_TYPE

from raytrain.errors import ConfigError
from raytrain.ports import free_port

logger = logging.getLogger(__name__)

HEAD_TYPE = "ray.head.default"  # the fake provider's name for the head's type
RECLAIM_PREFIX = "reclaim-"  # a file <control_dir>/reclaim-<node id> asks the provider to take that node back
NODES_FILE = "nodes.json"  # node id -> {"type", "pids"} of every node the provider lists, written by the provider
OBJECT_STORE_BYTES = 200 * 1024**2  # per fake node (Ray's default would be ~30 % of the machine's memory each)


@dataclass(frozen=True)
class LocalNodeTypes:
    """`cluster.yaml`'s node types as the local autoscaler runs them, and what was changed and why."""

    worker_types: dict[str, dict[str, Any]]
    head_resources: dict[str, float]
    notes: tuple[str, ...]


def local_node_types(
    cluster_config: Mapping[str, Any], *, cpus_per_node: int = 1, gpus_available: bool = False
) -> LocalNodeTypes:
    """Scale `cluster_config`'s `available_node_types` down to local fake nodes.

    Each worker type keeps its custom resources (e.g. `worker_slot`), `min_workers`, `max_workers` and
    `priority`; its CPU count becomes `cpus_per_node`; memory-like resources are dropped. Types that ask for GPUs
    are left out unless `gpus_available` (a fake GPU would let a run place work on a device that does not exist).
    The head type's custom resources are kept (CPU is the caller's). Raises `ConfigError` naming the field when
    the file has no usable worker type."""
    if cpus_per_node < 1:
        raise ConfigError(f"cpus_per_node must be an integer >= 1, got {cpus_per_node}")
    types = cluster_config.get("available_node_types")
    head_type = cluster_config.get("head_node_type")
    if not isinstance(types, Mapping) or head_type not in types:
        raise ConfigError(
            f"cluster config needs available_node_types with the head_node_type ({head_type!r}) among them"
        )
    notes: list[str] = []
    workers: dict[str, dict[str, Any]] = {}
    for name, spec in types.items():
        if name == head_type:
            continue
        resources = dict(spec.get("resources", {}))
        if resources.get("GPU", 0) and not gpus_available:
            notes.append(f"node type {name!r} left out: it has GPUs and this machine has none")
            continue
        local = {k: v for k, v in resources.items() if k not in ("CPU", "memory", "object_store_memory")}
        local["CPU"] = cpus_per_node
        local["object_store_memory"] = OBJECT_STORE_BYTES
        if not local.get("GPU"):
            local.pop("GPU", None)
        workers[name] = {
            "resources": local,
            "node_config": {},
            "min_workers": int(spec.get("min_workers", 0)),
            "max_workers": int(spec.get("max_workers", 0)),
            **({"priority": spec["priority"]} if "priority" in spec else {}),
        }
    if not workers:
        raise ConfigError("cluster config has no worker node type this machine can run (all need GPUs)")
    head = {
        k: float(v)
        for k, v in dict(types[head_type].get("resources", {})).items()
        if k not in ("CPU", "GPU", "memory", "object_store_memory")
    }
    return LocalNodeTypes(workers, head, tuple(notes))


def autoscaling_config(
    cluster_config: Mapping[str, Any],
    node_types: LocalNodeTypes,
    *,
    gcs_address: str,
    control_dir: str,
    idle_timeout_minutes: float,
) -> dict[str, Any]:
    """The autoscaling config the local head runs: `node_types`, the file's `max_workers` and `upscaling_speed`,
    the shortened idle timeout, and the reclaimable fake provider pointed at this cluster's GCS."""
    return {
        "cluster_name": f"{cluster_config.get('cluster_name', 'raytrain')}-local",
        "max_workers": int(
            cluster_config.get("max_workers", sum(t["max_workers"] for t in node_types.worker_types.values()))
        ),
        "upscaling_speed": float(cluster_config.get("upscaling_speed", 1.0)),
        "idle_timeout_minutes": idle_timeout_minutes,
        "provider": {
            "type": "external",
            "module": f"{__name__}.ReclaimableFakeProvider",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "launch_multiple": True,
            "head_node_id": FAKE_HEAD_NODE_ID,
            "gcs_address": gcs_address,
            "control_dir": control_dir,
        },
        "available_node_types": {
            **node_types.worker_types,
            HEAD_TYPE: {"resources": {}, "node_config": {}, "max_workers": 0},
        },
        "head_node_type": HEAD_TYPE,
        "auth": {},
        "docker": {},
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
    }


class ReclaimableFakeProvider(FakeMultiNodeProvider):
    """Ray's fake multi-node provider plus the cloud's side of a spot reclaim, and a record of what it started.

    Runs inside the head's autoscaler process. On every listing it takes back the nodes named by
    `<control_dir>/reclaim-<node id>` files (kills every process of the node at once and stops listing it, as a
    cloud does with a reclaimed instance) and keeps `<control_dir>/nodes.json` (each listed node's type and
    process ids) up to date, so that the cluster's owner can tell the node types apart and stop the nodes this
    provider started even after the autoscaler is gone."""

    def __init__(self, provider_config: dict[str, Any], cluster_name: str) -> None:
        super().__init__(provider_config, cluster_name)
        self._control_dir = str(provider_config["control_dir"])

    def _create_node_with_resources_and_labels(
        self,
        node_config: dict[str, Any],
        tags: dict[str, str],
        count: int,
        resources: dict[str, float],
        labels: dict[str, str],
    ) -> None:
        super()._create_node_with_resources_and_labels(node_config, tags, count, resources, labels)
        self._write_record()

    def non_terminated_nodes(self, tag_filters: dict[str, str]) -> list[str]:
        with self.lock:
            for name in os.listdir(self._control_dir):
                if name.startswith(RECLAIM_PREFIX):
                    node_id = name[len(RECLAIM_PREFIX) :]
                    node: Any = self._nodes.pop(node_id, None)
                    if node is not None and "node" in node:
                        node["node"].kill_all_processes(check_alive=False, allow_graceful=False)
                        logger.info("reclaimed node %s (as a cloud takes back a spot instance)", node_id)
                    os.remove(os.path.join(self._control_dir, name))
                    self._write_record()
            return list(super().non_terminated_nodes(tag_filters))

    def terminate_node(self, node_id: str) -> None:
        super().terminate_node(node_id)
        self._write_record()

    def _write_record(self) -> None:
        entries: dict[str, Any] = self._nodes
        record = {
            node_id: {
                "type": entry["tags"][TAG_RAY_USER_NODE_TYPE],
                "pids": [p.process.pid for infos in entry["node"].all_processes.values() for p in infos],
            }
            for node_id, entry in entries.items()
            if "node" in entry
        }
        path = os.path.join(self._control_dir, NODES_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)


def packaged_cluster_yaml() -> str:
    """Path of the `cluster.yaml` shipped inside the package (a link to the repository's top-level file)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cluster.yaml")


def load_cluster_yaml(path: str = "") -> dict[str, Any]:
    """Read a cluster launcher file (`""`: the packaged `cluster.yaml`) and check it has node types this machine
    can run; `ConfigError` naming the file and the problem otherwise."""
    import yaml

    path = path or packaged_cluster_yaml()
    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"cluster_yaml {path!r} cannot be read as YAML: {err}") from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"cluster_yaml {path!r} must be a mapping with available_node_types, got {type(config).__name__}"
        )
    try:
        local_node_types(config)
    except ConfigError as err:
        raise ConfigError(f"cluster_yaml {path!r}: {err}") from None
    return config


class LocalAutoscalingCluster:
    """A head node running Ray's autoscaler over local fake nodes of `cluster.yaml`'s types (see module doc)."""

    def __init__(
        self,
        cluster_config: Mapping[str, Any],
        *,
        head_cpus: int = 2,
        cpus_per_node: int = 1,
        idle_timeout_s: float = 10.0,
        system_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = dict(cluster_config)
        self.node_types = local_node_types(cluster_config, cpus_per_node=cpus_per_node)
        self.head_cpus = head_cpus
        self.idle_timeout_s = idle_timeout_s
        self.system_config = dict(system_config or {})
        self.control_dir = tempfile.mkdtemp(prefix="raytrain-autoscaler-")
        self.cluster: Any = None

    @classmethod
    def from_cluster_yaml(cls, path: str = "", **kwargs: Any) -> LocalAutoscalingCluster:
        """Build from a cluster launcher file (default: the repository's `cluster.yaml`, shipped in the package)."""
        return cls(load_cluster_yaml(path), **kwargs)

    def start(self) -> LocalAutoscalingCluster:
        """Start the head with the autoscaler; worker nodes come from the autoscaler (each type's min_workers at
        once, more on demand). Returns self."""
        from ray.cluster_utils import Cluster

        from raytrain.trainer import mute_state_api

        for note in self.node_types.notes:
            logger.info("local autoscaler: %s", note)
        saved = {k: os.environ.get(k) for k in ("RAY_FAKE_CLUSTER", "AUTOSCALER_UPDATE_INTERVAL_S")}
        os.environ.update({"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"})
        # no dashboard: the controller's PlacementGroupCleaner must not wait on the state API (the nodes the
        # autoscaler adds get the head's environment)
        restore_state_api = mute_state_api()
        config_path = os.path.join(self.control_dir, "autoscaling.json")
        try:
            self.cluster = Cluster()
            port = free_port("")
            address = f"{_node_ip()}:{port}"
            with open(config_path, "w") as f:
                json.dump(
                    autoscaling_config(
                        self.config,
                        self.node_types,
                        gcs_address=address,
                        control_dir=self.control_dir,
                        idle_timeout_minutes=self.idle_timeout_s / 60.0,
                    ),
                    f,
                )
            self.cluster.add_node(
                num_cpus=self.head_cpus,
                resources=self.node_types.head_resources,
                include_dashboard=False,
                gcs_server_port=port,
                autoscaling_config=config_path,
                env_vars={
                    "RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID,
                    "RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_NODE_ID,
                    "RAY_NODE_TYPE_NAME": HEAD_TYPE,
                },
                _system_config={"enable_autoscaler_v2": True, **self.system_config},
            )
        finally:
            restore_state_api()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        return self

    @property
    def address(self) -> str:
        """The GCS address to `ray.init` with."""
        return str(self.cluster.address)

    def provider_record(self) -> dict[str, dict[str, Any]]:
        """What the provider lists now: node id -> {"type": node type, "pids": [...]} (no Ray connection needed)."""
        try:
            with open(os.path.join(self.control_dir, NODES_FILE)) as f:
                return dict(json.load(f))
        except FileNotFoundError:
            return {}

    def worker_nodes(self) -> dict[str, str]:
        """Worker nodes that are alive in Ray's view and listed by the provider: node id -> node type (needs a Ray
        connection to this cluster). A node Ray lists a moment before the provider has recorded it counts once
        recorded; a reclaimed node stops counting when the provider takes it back."""
        import ray

        types = {node_id: entry["type"] for node_id, entry in self.provider_record().items()}
        return {n["NodeID"]: types[n["NodeID"]] for n in ray.nodes() if n["Alive"] and n["NodeID"] in types}

    def reclaim(self, node_id: str) -> None:
        """Ask the provider to take `node_id` back now, without notice (a spot reclaim at its deadline)."""
        with open(os.path.join(self.control_dir, RECLAIM_PREFIX + node_id), "w"):
            pass

    def shutdown(self) -> None:
        """Stop the head, then every process of every node the provider started (and still lists)."""
        import ray

        try:
            record = self.provider_record()
            connected = ray.is_initialized() and self.cluster is not None
            if connected and ray.get_runtime_context().gcs_address == self.address:
                ray.shutdown()  # Ray refuses to stop the head a driver of this process is connected to
            if self.cluster is not None:
                self.cluster.shutdown()  # the autoscaler stops with the head: no node starts after this
            record.update(self.provider_record())
            for entry in record.values():
                for pid in entry["pids"]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        finally:
            self.cluster = None
            shutil.rmtree(self.control_dir, ignore_errors=True)

    def __enter__(self) -> LocalAutoscalingCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _node_ip() -> str:
    import ray._private.services

    return str(ray._private.services.get_node_ip_address())
