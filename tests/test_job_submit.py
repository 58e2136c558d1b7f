"""`ray job submit --working-dir DIR -- raytrain fit char_project/job.toml` against a local `ray start --head`
cluster: a user's project of two files (`train.py` imports its neighbour `charmodel.py`), shipped by Ray's runtime
environment, trains (it failed with "No module named 'charmodel'" before).

The test starts the head itself (`ray_helpers.ray_head`: its own `ray start --head --block`, dashboard on
127.0.0.1 only, stopped without `ray stop`), submits, waits for SUCCEEDED and checks the run directory. Every
wait is bounded.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from ray_helpers import ray_head, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent


def test_ray_job_submit_runs_a_two_file_project(tmp_path: Path) -> None:
    working_dir = tmp_path / "project"  # what a user's checkout holds: the project and its text
    shutil.copytree(
        REPO / "examples" / "char_project", working_dir / "char_project", ignore=shutil.ignore_patterns("data")
    )
    shutil.copytree(REPO / "examples" / "data", working_dir / "data")
    with ray_head(dashboard=True) as head:
        env, dashboard = head["env"], head["dashboard"]
        runs = tmp_path / "runs"
        attempts: list[str] = []

        def submitted() -> re.Match[str] | None:
            # The dashboard answers before its job agent is ready; a refused submission is tried again.
            done = subprocess.run(
                [
                    "ray",
                    "job",
                    "submit",
                    "--address",
                    dashboard,
                    "--working-dir",
                    str(working_dir),
                    "--no-wait",
                    "--",
                    "raytrain",
                    "fit",
                    "char_project/job.toml",
                    "--storage",
                    str(runs),
                    "--steps",
                    "8",
                    "--workers",
                    "2",
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
                cwd=tmp_path,
            )
            attempts.append(done.stdout[-1500:] + done.stderr[-1500:])
            return re.search(r"raysubmit_\w+", done.stdout + done.stderr) if done.returncode == 0 else None

        try:
            job_id = wait_for("the job submission to be accepted", submitted, 240, interval_s=5)
        except AssertionError as err:  # say what the CLI answered
            raise AssertionError(f"{err}; last answer:\n{attempts[-1] if attempts else '(none)'}") from None

        def cli(*args: str) -> str:
            done = subprocess.run(
                ["ray", "job", *args, "--address", dashboard, job_id.group(0)],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            return done.stdout + done.stderr  # the CLI logs part of its answer to stderr

        def finished() -> str | None:
            status = cli("status").upper()
            return next(
                (
                    s
                    for s in ("SUCCEEDED", "FAILED", "STOPPED")
                    if f"JOB '{job_id.group(0).upper()}' {s}" in status or f": {s}" in status
                ),
                None,
            )

        state = wait_for(f"job {job_id.group(0)} to finish", finished, 420, interval_s=3)
        logs = cli("logs")
        assert state == "SUCCEEDED", logs[-4000:]
        run_dir = runs / "char-gru"
        with open(run_dir / "metrics.jsonl") as f:
            lines = [json.loads(line) for line in f if line.strip()]
        assert [m["step"] for m in lines] == list(range(1, 9))
        assert {m["global_batch_size"] for m in lines} == {64}
        assert {m["world_size"] for m in lines} == {2}
        assert "run directory" in logs and "final loss" in logs  # the end-of-run summary reached the job's logs
