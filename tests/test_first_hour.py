"""A user's first hour with a project of their own, through the real console script and Python API:

- more workers than the local machine has cores: `raytrain fit` sizes the local Ray instance it starts for the run
  and says so; an instance the user started too small is refused in seconds, naming what is asked and what is
  there (it waited forever before);
- a project of two files (`examples/char_project`: `train.py` imports its neighbour `charmodel.py`) trains with
  `raytrain fit` (under `ray job submit --working-dir`: `test_security.py`);
- `--steps` without epochs trains the steps asked for, across epochs, and the run length is said before training;
- Ctrl-C while the worker group cannot start (a cluster without room) stops the run at once with the resume line.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ray_helpers import char_project_checkout, ray_head, read_jsonl, sigint_as_in_a_terminal, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent


def _cli() -> list[str]:
    return [shutil.which("raytrain") or sys.executable, *([] if shutil.which("raytrain") else ["-m", "raytrain.cli"])]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, **extra}


def test_a_two_file_project_trains_the_steps_asked_for_with_more_workers_than_cores(tmp_path: Path) -> None:
    project = char_project_checkout(tmp_path) / "char_project"
    command = [*_cli(), "fit", str(project / "job.toml"), "--workers", "3", "--steps", "15"]
    command += ["--storage", str(tmp_path / "runs")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    cores, said = os.cpu_count(), done.stdout + done.stderr
    assert f"started a local Ray instance with {max(cores or 1, 4)} logical CPUs on {cores} cores" in said
    # 820 windows of the sonnets at global batch 64: 13 steps per epoch (the last one partial)
    assert "run length: max_steps=15 (1.15 epochs of 13 steps)" in said
    metrics = read_jsonl(tmp_path / "runs" / "char-gru" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 16))  # past the end of epoch 0: the steps asked for
    assert {m["world_size"] for m in metrics} == {3} and metrics[-1]["epoch"] == 1


def test_an_instance_too_small_for_min_workers_is_refused_in_seconds(tmp_path: Path) -> None:
    script = f"""
import ray, sys
sys.path.insert(0, {str(REPO / "tests")!r})
from ray_helpers import make_trainer
from raytrain.errors import ConfigError
from dataclasses import replace
from pathlib import Path
ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False)
try:
    make_trainer(Path({str(tmp_path)!r}), "small", workers=3, steps=2).fit()
except ConfigError as err:
    print("REFUSED:", err)
gpu = make_trainer(Path({str(tmp_path)!r}), "gpu", workers=1, steps=2)
gpu.spec = replace(gpu.spec, cluster=replace(gpu.spec.cluster, use_gpu=True))
try:
    gpu.fit()
except ConfigError as err:
    print("GPU REFUSED:", err)
"""
    # bounded by the timeout: it waited forever before
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, env=_env())
    assert "REFUSED: min_workers=3 needs 3 workers of CPU 1, and the local Ray instance holds 2 (1 node: CPU 2)" in (
        done.stdout
    ), done.stdout[-2000:] + done.stderr[-2000:]
    assert "connect_ray(4)" in done.stdout
    # a GPU asked on a machine without one: the advice is about the GPU, not about CPUs
    assert "GPU REFUSED: min_workers=1 needs 1 worker of CPU 1, GPU 1" in done.stdout, done.stdout[-2000:]
    assert "no node has GPU 1 for one worker: set use_gpu=False" in done.stdout.split("GPU REFUSED:")[1]
    assert "connect_ray" not in done.stdout.split("GPU REFUSED:")[1]


def test_ctrl_c_stops_a_run_whose_workers_cannot_start(tmp_path: Path) -> None:
    """A cluster of 2 CPUs (no autoscaler here, but raytrain cannot know that of a cluster it joined) and a run
    asking for 3 workers: raytrain says what it waits for; Ctrl-C during the start-up retries ends it at once."""
    with ray_head(num_cpus=2) as head:
        command = [*_cli(), "fit", str(REPO / "examples" / "fit_mlp.toml"), "--workers", "3"]
        command += ["--storage", str(tmp_path / "runs")]
        run = subprocess.Popen(
            command,
            env=_env(RAY_ADDRESS=head["address"], RAY_AUTH_MODE="disabled"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=sigint_as_in_a_terminal,
        )
        try:
            log = tmp_path / "runs" / "fit-mlp" / "raytrain.log"
            wait_for("the driver to say what it waits for", lambda: log.exists() and "waiting" in log.read_text(), 180)
            time.sleep(5)  # the controller is now trying to start the worker group
            run.send_signal(signal.SIGINT)
            stdout, stderr = run.communicate(timeout=60)  # bounded: Ctrl-C was lost in Ray's handler before
        finally:
            if run.poll() is None:
                run.kill()
    assert "waiting for 3 workers of CPU 1: the cluster holds 2 now (1 node: CPU 2)" in log.read_text()
    assert run.returncode == 130, stderr[-3000:]
    assert "raytrain: interrupted;" in stderr and "Traceback" not in stderr, stderr[-3000:]
    # one line, the CLI's (fit() leaves it to the CLI), and with no checkpoint yet it says the run starts over
    assert "interrupted" not in stdout, stdout[-3000:]
    assert "no checkpoint was written in" in stderr, stderr[-3000:]
    assert "the same command starts from step 0: raytrain fit" in stderr, stderr[-3000:]
