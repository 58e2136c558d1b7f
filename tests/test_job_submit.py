"""`ray job submit ... -- raytrain fit examples/fit_mlp.toml` against a local `ray start --head` cluster.

The test starts the head itself (`ray start --head --block` in a subprocess, dashboard on 127.0.0.1 only), submits,
waits for SUCCEEDED, checks the run directory, and stops the cluster it started by ending that subprocess (never
`ray stop`, which would stop every Ray instance on the machine). Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, condition, timeout_s: float, interval_s: float = 1.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"waited {timeout_s:.0f} s for {what}")


def test_ray_job_submit_runs_raytrain_fit(tmp_path: Path) -> None:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    gcs_port, dashboard_port = free_port(), free_port()
    dashboard = f"http://127.0.0.1:{dashboard_port}"
    head = subprocess.Popen(
        [
            "ray",
            "start",
            "--head",
            "--block",
            f"--port={gcs_port}",
            "--num-cpus=4",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard_port}",
            "--disable-usage-stats",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:

        def dashboard_up() -> bool:
            try:
                with urllib.request.urlopen(f"{dashboard}/api/version", timeout=2) as response:
                    return response.status == 200
            except OSError:
                return False

        wait_for(f"the dashboard at {dashboard}", dashboard_up, 90)
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
                    str(REPO),
                    "--no-wait",
                    "--",
                    "raytrain",
                    "fit",
                    "examples/fit_mlp.toml",
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
                cwd=REPO,
            )
            attempts.append(done.stdout[-1500:] + done.stderr[-1500:])
            return re.search(r"raysubmit_\w+", done.stdout + done.stderr) if done.returncode == 0 else None

        job_id = wait_for("the job submission to be accepted", submitted, 120, interval_s=5)

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
        run_dir = runs / "fit-mlp"
        with open(run_dir / "metrics.jsonl") as f:
            lines = [json.loads(line) for line in f if line.strip()]
        assert [m["step"] for m in lines] == list(range(1, 9))
        assert {m["global_batch_size"] for m in lines} == {64}
        assert {m["world_size"] for m in lines} == {2}
        assert "run_dir" in logs and "final_loss" in logs  # the end-of-run summary reached the job's logs
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
