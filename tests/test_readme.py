"""README's Python API snippet runs as written, on a machine where another Ray instance is running, and never joins
that instance: `fit()` starts a local instance of its own, sized for the run (a bare `ray.init()` or `ray.data` call
would join the most recently started cluster)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from ray_helpers import ray_head

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent


def python_snippet() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## The Python API") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README has no python block under 'The Python API'"
    return match.group(1)


def jobs_seen_by(address: str) -> int:
    """How many drivers ever connected to the cluster at `address` (this check's own included)."""
    code = (
        f"import ray; ray.init(address={address!r}, log_to_driver=False); "
        "print(len(ray._private.state.state.job_table()))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return int(done.stdout.strip().splitlines()[-1])


def test_readme_python_snippet_runs_beside_another_ray_instance(tmp_path: Path) -> None:
    snippet = python_snippet()
    assert "import ray" not in snippet and "connect_ray" not in snippet  # fit() starts Ray itself
    with ray_head() as other:  # the newest cluster on this machine: a bare ray.init() would join it
        env = {k: v for k, v in other["env"].items() if k != "RAY_ADDRESS"}
        done = subprocess.run(
            [sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        loss, val_loss = (float(v) for v in done.stdout.strip().splitlines()[-1].split())
        assert 0 < loss < 1 and 0 < val_loss < 1.5
        assert (tmp_path / "runs" / "mlp" / "metrics.jsonl").exists()
        assert jobs_seen_by(other["address"]) == 1, "the snippet's driver joined the other Ray instance"
