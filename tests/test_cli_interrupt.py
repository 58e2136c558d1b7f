"""Ctrl-C ends a run cleanly: one line naming the last checkpoint and the command that resumes, exit 130, no
traceback; resuming with that command works, and `keep=2` leaves two checkpoints on disk (a checkpoint written but
never committed before the interruption is removed at the next start)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from ray_helpers import read_jsonl, sigint_as_in_a_terminal, wait_for

from raytrain.checkpoint_files import latest_committed

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent


def test_ctrl_c_names_the_checkpoint_and_the_resume_command(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    command = ["raytrain", "demo", "--storage", str(tmp_path), "--events", "none", "--nodes", "2", "--workers", "2"]
    command += ["--steps", "400", "--checkpoint-every", "5"]
    launcher = [sys.executable, "-m", "raytrain.cli", *command[1:]]
    demo = subprocess.Popen(
        launcher,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_as_in_a_terminal,
    )
    try:

        def committed_step_10() -> bool:  # checkpoints are committed ~0.5 s after their step
            runs = list(tmp_path.glob("demo-*"))
            found = latest_committed(str(runs[0])) if runs else None
            return found is not None and found[0] >= 10

        wait_for("a committed checkpoint at step 10 or later", committed_step_10, 240, interval_s=0.2)
        demo.send_signal(signal.SIGINT)
        _, stderr = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("raytrain: interrupted;")]
    assert len(lines) == 1, stderr[-3000:]
    assert "the last checkpoint is " in lines[0] and "; resume with: raytrain demo " in lines[0]
    resume = shlex.split(lines[0].split("resume with: ", 1)[1])
    assert "--run-name" in resume  # the demo names its run by the time: resuming needs the name
    step = int(lines[0].split("(step ", 1)[1].split(")")[0])
    assert step >= 10
    resume[resume.index("--steps") + 1] = str(step + 6)  # resume, and finish 6 steps later
    done = subprocess.run(
        [sys.executable, "-m", "raytrain.cli", *resume[1:]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = next(tmp_path.glob("demo-*"))
    starts = read_jsonl(run_dir / "events.jsonl")
    assert starts[-1]["restored"] and starts[-1]["step"] == step
    checkpoints = [p for p in run_dir.iterdir() if p.name.startswith("checkpoint_") and p.is_dir()]
    assert len(checkpoints) == 2, sorted(p.name for p in checkpoints)  # keep=2 (the demo's), nothing left over
