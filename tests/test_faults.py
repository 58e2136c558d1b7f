"""Fault injection on a local multi-node Ray cluster (marker `faults`): many failures in one run at seeded random
steps and phases, a killed driver, the same run started twice. In every case: the global batch is exact at every
step, no sample is lost or repeated in any completed epoch, and the loss curve equals a fixed-size run's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from ray_helpers import assert_same_curve, check_invariants, demo, read_jsonl, wait_for

from raytrain.faults import FIRED_FILE, PHASES

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.faults]

REPO = Path(__file__).resolve().parent.parent
CHECKPOINT_EVERY = 5


def seeded_faults(seed: int, count: int, last_step: int) -> str:
    """`count` faults at random steps (2..last_step) and phases; checkpoint/report ones on checkpoint steps."""
    rng = np.random.default_rng(seed)
    steps = sorted(rng.choice(np.arange(2, last_step + 1), size=count, replace=False).tolist())
    faults = []
    for step in steps:
        phase = PHASES[int(rng.integers(len(PHASES)))]
        if phase in ("checkpoint", "report"):
            step = -(-step // CHECKPOINT_EVERY) * CHECKPOINT_EVERY
        faults.append(f"{int(rng.integers(3))}:{step}:{phase}")
    return ",".join(faults)


def test_five_failures_at_random_steps_and_phases(tmp_path: Path, fixed_size_losses: list[float]) -> None:
    spec = seeded_faults(seed=11, count=5, last_step=38)
    summary = demo(
        tmp_path,
        "faults",
        "--nodes",
        "3",
        "--workers",
        "3",
        "--events",
        "none",
        "--steps",
        "50",
        "--sample-time",
        "0",
        "--checkpoint-every",
        str(CHECKPOINT_EVERY),
        env={"RAYTRAIN_FAULTS": spec},
    )
    fired = read_jsonl(Path(summary["run_dir"]) / FIRED_FILE)
    assert len(fired) == 5, f"faults {spec}: fired {fired}"
    assert len({f["step"] for f in fired}) == 5
    assert set(summary["world_sizes"]) == {3} and summary["restarts"] >= 5
    check_invariants(summary, 50)
    assert_same_curve(summary, fixed_size_losses)
    print(f"faults {spec}: survived {len(fired)} failures, {summary['restarts']} restarts")


def _demo_command(tmp_path: Path, name: str, steps: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "raytrain.cli",
        "demo",
        "--storage",
        str(tmp_path),
        "--run-name",
        name,
        "--global-batch",
        "24",
        "--micro-batch",
        "4",
        "--epoch-steps",
        "10",
        "--audit-samples",
        "--nodes",
        "2",
        "--workers",
        "2",
        "--events",
        "none",
        "--steps",
        str(steps),
        "--sample-time",
        "0.01",
        "--checkpoint-every",
        str(CHECKPOINT_EVERY),
        "--json",
    ]


def test_a_killed_driver_and_the_run_started_again(tmp_path: Path) -> None:
    """SIGKILL to the driver's whole process group (the driver and the Ray cluster it started: a machine lost),
    then the same command again: it resumes from the last committed checkpoint and finishes, nothing lost."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    command = _demo_command(tmp_path, "killed", 40)
    first = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        wait_for(
            "12 steps before the kill",
            lambda: (
                (tmp_path / "killed" / "metrics.jsonl").exists()
                and len(read_jsonl(tmp_path / "killed" / "metrics.jsonl")) >= 12
            ),
            300,
            interval_s=0.5,
        )
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
    time.sleep(2)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    starts = read_jsonl(tmp_path / "killed" / "events.jsonl")
    assert starts[-1]["restored"] and starts[-1]["step"] >= CHECKPOINT_EVERY
    metrics = read_jsonl(tmp_path / "killed" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 41))
    assert {m["global_batch_size"] for m in metrics} == {24}
    by_epoch: dict[int, list[int]] = {}
    for record in read_jsonl(tmp_path / "killed" / "samples.jsonl"):
        by_epoch.setdefault(record["epoch"], []).extend(record["ids"])
    for epoch in range(4):
        assert sorted(by_epoch[epoch]) == list(range(240)), f"epoch {epoch}: lost or repeated samples"


def test_the_same_run_started_twice_refuses_the_second(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    command = _demo_command(tmp_path, "twice", 30)
    first = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for("the first run to train", lambda: (tmp_path / "twice" / "metrics.jsonl").exists(), 300, 0.5)
        started = time.monotonic()
        second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        refused_after = time.monotonic() - started
        _, stderr = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
    assert second.returncode == 2, second.stderr[-2000:]
    assert "is already being trained by pid" in second.stderr.strip().splitlines()[-1]
    assert first.returncode == 0, stderr[-3000:]
    metrics = read_jsonl(tmp_path / "twice" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 31))  # the first run was not disturbed
    assert len(read_jsonl(tmp_path / "twice" / "events.jsonl")) == 1
    print(f"the second start refused after {refused_after:.1f} s")
