"""Ray's real autoscaler (v2) over `cluster.yaml`'s own node types, on one machine (`raytrain.cli.local_autoscaler`).

The cluster starts with the head and the file's `min_workers` worker nodes (0 for every type); every worker node
the run gets is launched by the autoscaler for the trainer's pending demand; a node taken back by the node
provider (as a cloud reclaims a spot instance) is replaced for the demand still pending; idle nodes are removed
after the idle timeout once training ends.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from ray_helpers import assert_same_curve, check_invariants, demo, wait_for

from raytrain.cli.local_autoscaler import LocalAutoscalingCluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS = 100  # the fixed-size reference's length; ~10 s of steps after the reclaim leave time to grow back


def test_demand_grows_the_cluster_a_reclaimed_node_is_replaced_and_idle_nodes_go(
    tmp_path: Path, fixed_size_losses: list[float]
) -> None:
    summary = demo(
        tmp_path,
        "autoscale",
        "--autoscale",
        "--workers",
        "1:3",
        "--events",
        "reclaim@40",
        "--steps",
        str(STEPS),
        "--sample-time",
        "0.02",
        "--checkpoint-every",
        "5",
        "--idle-timeout",
        "8",
    )
    auto: dict[str, Any] = summary["autoscale"]
    # Scale-up from demand: no worker node at the start; the autoscaler launched them, spot first.
    assert auto["initial_worker_nodes"] == 0
    assert set(auto["launched_by_type"]) <= {"cpu-spot", "cpu-ondemand"}, auto["launched_by_type"]
    assert auto["launched_by_type"].get("cpu-spot", 0) >= 3, auto["launched_by_type"]
    assert auto["grow_s"] is not None, "the world never reached max_workers=3"
    assert summary["world_sizes"][-1] == 3 and max(summary["world_sizes"]) == 3
    # Replacement: the reclaimed node (one with a training worker) is gone, and a node launched after it, or a
    # spare the autoscaler had launched before (at a restart), takes its place; the world is back at 3.
    (reclaimed,) = auto["replace"]
    ups_after = [h for h in auto["node_history"] if h["change"] == "up" and h["time"] > reclaimed["time"]]
    downs = [h["node"] for h in auto["node_history"] if h["change"] == "down" and h["time"] > reclaimed["time"]]
    assert reclaimed["node"] in downs
    assert ups_after or reclaimed["spare_nodes"] > 0, "no replacement node after the reclaim, and no spare"
    assert reclaimed["replace_s"] is not None, "the world did not get back to 3 after the reclaim"
    # The group started at 1 and grew, or (the nodes launched before the first start) at 3; either way the reclaim
    # of a node with a worker restarted it once more at 3.
    sizes = summary["world_sizes"]
    assert len(sizes) > sizes.index(3) + 1, f"the reclaim of a node with a worker did not restart the group: {sizes}"
    # Exact batch, clean audit, and the loss curve of the fixed one-worker run through all of it.
    check_invariants(summary, STEPS)
    assert_same_curve(summary, fixed_size_losses)
    # Scale-down: nothing raytrain started keeps a node busy once training is over.
    assert auto["scale_down_s"] is not None, "idle worker nodes were not removed after training"
    assert any(line.startswith("[raytrain demo] step") and "reclaim" in line for line in summary["stderr"].splitlines())


def test_spot_first_then_on_demand_when_the_spot_type_is_at_its_maximum(no_ray_connection: None) -> None:
    # cluster.yaml: cpu-spot (priority 10, max 4) and cpu-ondemand (priority 0, max 4), same resources.
    import ray
    from ray.autoscaler.sdk import request_resources

    bundle = {"CPU": 1, "worker_slot": 1}
    state_api = os.environ.get("RAY_API_SERVER_ADDRESS")
    with LocalAutoscalingCluster.from_cluster_yaml(idle_timeout_s=4) as cluster:
        # the muted state API is the cluster's processes' only: `ray job submit` here afterwards failed with it
        assert os.environ.get("RAY_API_SERVER_ADDRESS") == state_api
        ray.init(address=cluster.address, log_to_driver=False)
        assert cluster.worker_nodes() == {}
        request_resources(bundles=[bundle] * 5)
        wait_for("5 worker nodes", lambda: len(cluster.worker_nodes()) >= 5, 120, interval_s=0.5)
        nodes = cluster.worker_nodes()
        assert sorted(nodes.values()) == ["cpu-ondemand"] + ["cpu-spot"] * 4, nodes
        request_resources(bundles=[])
        wait_for("idle nodes removed", lambda: not cluster.worker_nodes(), 120, interval_s=0.5)
        ray.shutdown()
        pids = [pid for entry in cluster.provider_record().values() for pid in entry["pids"]]
    wait_for("every node process gone after shutdown", lambda: not [p for p in pids if _running(p)], 30, 0.5)


def _running(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited; its parent reaps it
