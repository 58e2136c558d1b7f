"""Two raytrain runs on one machine at the same time, each with its own local Ray instance, both finish without an
unplanned restart. Ray Train's PlacementGroupCleaner asks Ray's state API whether its run's controller is alive;
unpointed, the state API answers for the most recently started instance on the machine, which does not know the
other run's controller, and the cleaner removes that run's placement group. raytrain points each instance's state
API at its own dashboard (`raytrain.trainer.own_state_api`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ray_helpers import read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.faults]

REPO = Path(__file__).resolve().parent.parent


def test_two_concurrent_local_runs_do_not_disturb_each_other(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    runs = []
    for name in ("first", "second"):
        command = [sys.executable, "-m", "raytrain.cli", "fit", "examples/fit_mlp.toml", "--storage", str(tmp_path)]
        command += ["--run-name", name, "--workers", "1", "--epochs", "10", "--steps", "400", "--json"]
        runs.append(
            subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
        time.sleep(15)  # the second instance starts while the first trains: it is the newest cluster on the machine
    for name, run in zip(("first", "second"), runs, strict=True):
        _, stderr = run.communicate(timeout=600)
        assert run.returncode == 0, f"{name}: {stderr[-3000:]}"
        starts = read_jsonl(tmp_path / name / "events.jsonl")
        assert len(starts) == 1, f"{name} restarted {len(starts) - 1} time(s): {stderr[-2000:]}"
        assert [m["step"] for m in read_jsonl(tmp_path / name / "metrics.jsonl")] == list(range(1, 401))
