"""Elastic runs through the public CLI (`raytrain demo --json`) on a local multi-node cluster of fake nodes.

Each run is a subprocess with its own `ray.cluster_utils.Cluster`; every wait is bounded. In every scenario: the
global batch is the configured one at every step, the world sizes are the expected ones, the sample audit has no
duplicate and no missing id in any completed epoch, and (deterministic mode) the loss curve equals a fixed-size
run's step by step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

GLOBAL_BATCH = 24
EPOCH_STEPS = 10
RUN_TIMEOUT_S = 600


def demo(tmp: Path, name: str, *args: str) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "raytrain.cli",
        "demo",
        "--storage",
        str(tmp),
        "--run-name",
        name,
        "--json",
        "--global-batch",
        str(GLOBAL_BATCH),
        "--micro-batch",
        "4",
        "--epoch-steps",
        str(EPOCH_STEPS),
        "--audit-samples",
        *args,
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"waited {RUN_TIMEOUT_S} s for `raytrain demo {' '.join(args)}` to finish") from err
    assert done.returncode == 0, f"demo {args} failed:\n{done.stderr[-4000:]}"
    stdout = done.stdout.strip().splitlines()
    assert len(stdout) == 1, f"--json prints one JSON object on stdout, got {len(stdout)} lines"
    # Quiet by default: every line on stderr is raytrain's own or a one-line summary of a Ray error.
    noise = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith(("[raytrain", "[ray]"))]
    assert not noise, "lines that are neither raytrain's nor a Ray error summary:\n" + "\n".join(noise[:20])
    return {**json.loads(stdout[0]), "stderr": done.stderr}


def losses(summary: dict[str, Any]) -> list[float]:
    with open(summary["metrics"]) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def check_invariants(summary: dict[str, Any], steps: int) -> None:
    with open(summary["metrics"]) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    assert {m["global_batch_size"] for m in lines} == {GLOBAL_BATCH}
    assert all(sum(m["per_rank_samples"]) == GLOBAL_BATCH for m in lines)
    completed = steps // EPOCH_STEPS
    assert len(summary["audit"]) == completed
    for epoch, counts in summary["audit"].items():
        assert counts == {"duplicates": 0, "missing": 0}, f"epoch {epoch}: {counts}"


@pytest.fixture(scope="module")
def fixed_size_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The reference: 3 workers on 3 nodes, no events."""
    tmp = tmp_path_factory.mktemp("fixed")
    summary = demo(
        tmp, "fixed", "--nodes", "3", "--workers", "3", "--events", "none", "--steps", "100", "--sample-time", "0"
    )
    assert summary["world_sizes"] == [3]
    return losses(summary)


def assert_same_curve(summary: dict[str, Any], reference: list[float]) -> None:
    curve = losses(summary)
    for step, (a, b) in enumerate(zip(curve, reference, strict=False), start=1):
        assert a == pytest.approx(b, rel=1e-4), f"step {step}: {a} vs fixed-size {b}"


def test_shrink_by_node_removal_then_grow_by_node_addition(tmp_path: Path, fixed_size_losses: list[float]) -> None:
    # 0.02 s of simulated compute per sample: the grow (seen at Ray's next 20 s resource refresh) lands mid-run.
    summary = demo(
        tmp_path,
        "resize",
        "--nodes",
        "3",
        "--workers",
        "2:3",
        "--events",
        "remove@6,add@25",
        "--steps",
        "160",
        "--sample-time",
        "0.02",
        "--checkpoint-every",
        "5",
    )
    assert summary["world_sizes"] == [3, 2, 3], "expected a shrink to 2 and a grow back to 3 before the end"
    check_invariants(summary, 160)
    assert_same_curve(summary, fixed_size_losses)
    removed, added = summary["events"]
    assert removed["recovered_world_size"] == 2 and added["recovered_world_size"] == 3
    lines = summary["stderr"].splitlines()
    assert any(line.startswith("[raytrain] worker group failed (") for line in lines)  # recovery, summarised
    assert any(line.startswith("[raytrain] cluster changed: restarting the worker group at 3") for line in lines)
    assert len(lines) <= 80, f"{len(lines)} lines for a 160-step run with two events"
    assert removed["steps_lost"] <= 5 and added["steps_lost"] <= 5  # never more than one checkpoint interval


def test_sigkill_of_a_worker_restarts_at_the_same_size(tmp_path: Path, fixed_size_losses: list[float]) -> None:
    summary = demo(
        tmp_path,
        "kill",
        "--nodes",
        "3",
        "--workers",
        "2:3",
        "--events",
        "kill@6",
        "--steps",
        "30",
        "--sample-time",
        "0.01",
    )
    assert summary["world_sizes"] == [3, 3]
    check_invariants(summary, 30)
    assert_same_curve(summary, fixed_size_losses)
