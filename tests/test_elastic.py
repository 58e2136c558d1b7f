"""Elastic runs through the public CLI (`raytrain demo --json`) on a local multi-node cluster of fake nodes.

Each run is a subprocess with its own `ray.cluster_utils.Cluster`; every wait is bounded. In every scenario: the
global batch is the configured one at every step, the world sizes are the expected ones, the sample audit has no
duplicate and no missing id in any completed epoch, and (deterministic mode) the loss curve equals a fixed-size
run's step by step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ray_helpers import assert_same_curve, check_invariants, demo

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_shrink_by_node_removal_grow_by_node_addition_then_a_drained_node_costs_no_step(
    tmp_path: Path, fixed_size_losses: list[float]
) -> None:
    """A node removed without notice (the group restarts at 2 from its last checkpoint), a node added (the group
    grows back to 3), then a drain (a spot notice, a scale-down) announcing the removal of a node 8 s ahead: the
    workers commit a checkpoint after the step they are in and train nothing more, so the group restarts at 2 from
    exactly that step. 0.02 s of simulated compute per sample. Events fire at steps, so the grow has landed (at
    step 25) before the drain is announced (at 45); 15 steps after it show the run going on at 2."""
    summary = demo(
        tmp_path,
        "resize",
        "--nodes",
        "3",
        "--workers",
        "2:3",
        "--events",
        "remove@6,add@25,drain@45",
        "--steps",
        "60",
        "--sample-time",
        "0.02",
        "--checkpoint-every",
        "5",
    )
    assert summary["world_sizes"] == [3, 2, 3, 2], "expected a shrink to 2, a grow back to 3, a drain to 2"
    check_invariants(summary, 60)
    assert_same_curve(summary, fixed_size_losses)
    removed, added, drained = summary["events"]
    assert removed["recovered_world_size"] == 2 and added["recovered_world_size"] == 3
    assert drained["recovered_world_size"] == 2
    assert drained["steps_lost"] == 0, f"a drained node retrained {drained['steps_lost']} steps"
    lines = summary["stderr"].splitlines()
    assert any(line.startswith("[raytrain] worker group failed (") for line in lines)  # recovery, summarised
    assert any(line.startswith("[raytrain] cluster changed: restarting the worker group at 3") for line in lines)
    assert any("drain" in line for line in lines if line.startswith("[raytrain]")), summary["stderr"]
    assert len(lines) <= 100, f"{len(lines)} lines for a 60-step run with three events"
    # At most one checkpoint interval, plus the steps trained while the latest checkpoint was being written and
    # committed (~0.5 s here: Ray Train's controller registers reports at its polls).
    assert removed["steps_lost"] <= 2 * 5 and added["steps_lost"] <= 2 * 5


# tp 2 on 2 fake nodes of 2 worker slots: removing a node removes a whole replica. pp 2 on 4 fake nodes of one
# slot: a pipeline spans two nodes; removing one leaves 3 workers, which raytrain's WholeReplicasPolicy rounds down
# to one whole pipeline. Either way W 4 -> 2 -> 4 (dp 2 -> 1 -> 2), the checkpoint written at dp 2 loads at dp 1
# (DCP) and the curve equals the fixed one-worker run's (no model parallelism) step by step.
MODEL_PARALLEL = {"tp": (["--tp", "2", "--nodes", "2"], (2, 1)), "pp": (["--pp", "2", "--nodes", "4"], (1, 2))}


@pytest.mark.parametrize("kind", list(MODEL_PARALLEL))
def test_model_parallel_runs_shrink_and_grow_in_whole_replicas(
    tmp_path: Path, fixed_size_losses: list[float], kind: str
) -> None:
    flags, (tp, pp) = MODEL_PARALLEL[kind]
    events = ["--events", "remove@6,add@20", "--steps", "35", "--sample-time", "0.02", "--checkpoint-every", "5"]
    summary = demo(tmp_path, kind, *flags, *events)
    assert summary["world_sizes"] == [4, 2, 4], "expected a shrink to one replica and a grow back to two"
    assert [(layout["dp"], layout["tp"], layout["pp"]) for layout in summary["layouts"]] == [
        (2, tp, pp),
        (1, tp, pp),
        (2, tp, pp),
    ]
    check_invariants(summary, 35)
    assert_same_curve(summary, fixed_size_losses)
    lines = summary["stderr"].splitlines()
    assert any(f"dp 2 -> 1, tp {tp}, pp {pp}: accumulation" in line for line in lines)
    assert any(f"dp 1 -> 2, tp {tp}, pp {pp}: accumulation" in line for line in lines)
