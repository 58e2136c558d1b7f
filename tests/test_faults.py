"""Fault injection on a local multi-node Ray cluster (marker `faults`): many failures in one run at seeded random
steps and phases, the same run started twice then its driver killed. In every case: the global batch is exact at every
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
    spec = seeded_faults(seed=86, count=5, last_step=38)  # every phase, every rank
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


def test_a_second_start_is_refused_and_a_killed_driver_resumes(tmp_path: Path) -> None:
    """The same run started twice at once: the second refuses at once, naming the first, which trains on
    undisturbed. Then SIGKILL to the first driver's whole process group (the driver and the Ray cluster it started:
    a machine lost), and the same command again: it resumes from the last committed checkpoint and finishes,
    nothing lost. In restart mode only: the lock is the same code in live mode, and a new live driver resuming
    from a live checkpoint (at another layout, even) is the cross-mode chain's last leg in test_live_ray.py; a
    live-mode copy of this test (70 s) repeated that path."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    steps = 60
    command = _demo_command(tmp_path, "killed", steps)
    metrics_file, starts_file = tmp_path / "killed" / "metrics.jsonl", tmp_path / "killed" / "events.jsonl"
    first = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        wait_for("the first run to train", metrics_file.exists, 300, interval_s=0.5)
        started = time.monotonic()
        second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        refused_after, refused_at = time.monotonic() - started, len(read_jsonl(metrics_file))
        wait_for(
            "12 steps, and 2 after the refusal, before the kill",
            lambda: len(read_jsonl(metrics_file)) >= max(12, refused_at + 2),
            300,
            interval_s=0.5,
        )
        assert first.poll() is None, "the first run ended before the kill"
        assert len(read_jsonl(starts_file)) == 1  # the refused start did not disturb the first: no restart
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
    assert second.returncode == 2, second.stderr[-2000:]
    assert "is already being trained by pid" in second.stderr.strip().splitlines()[-1]
    print(f"the second start refused after {refused_after:.1f} s")
    time.sleep(2)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    starts = read_jsonl(starts_file)
    assert starts[-1]["restored"] and starts[-1]["step"] >= CHECKPOINT_EVERY
    metrics = read_jsonl(metrics_file)
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert {m["global_batch_size"] for m in metrics} == {24}
    by_epoch: dict[int, list[int]] = {}
    for record in read_jsonl(tmp_path / "killed" / "samples.jsonl"):
        by_epoch.setdefault(record["epoch"], []).extend(record["ids"])
    for epoch in range(steps // 10):
        assert sorted(by_epoch[epoch]) == list(range(240)), f"epoch {epoch}: lost or repeated samples"
