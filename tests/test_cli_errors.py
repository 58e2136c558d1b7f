"""A user's mistake at the command line: one `raytrain: error:` line, exit 2, and nothing started (checked by the
absence of any run directory and of Ray's own output)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def raytrain(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run(
        [sys.executable, "-m", "raytrain.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **(env or {})},
        cwd=REPO,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("demo", "--global-batch", "0"), "global_batch must be an integer >= 1, got 0"),
        (("demo", "--micro-batch", "-1"), "micro_batch must be an integer >= 1, got -1"),
        (("demo", "--micro-batch", "x"), "demo: argument --micro-batch: invalid int value: 'x'"),
        (("demo", "--workers", "3:2"), "workers must be 'N' or 'MIN:MAX' with 1 <= MIN <= MAX, got '3:2'"),
        (("demo", "--strategy", "zero9"), "demo: argument --strategy: invalid choice: 'zero9'"),
        (("plan", "--workers"), "plan: argument --workers: expected one argument"),
        (("frobnicate",), "argument COMMAND: invalid choice: 'frobnicate'"),
        (("fit", "examples/fit_mlp.toml", "--dry-run", "--storage", "README.md"), "README.md' is not a directory"),
        (("demo", "--storage", "s3://bucket/runs"), "--storage must be a local directory for the demo"),
        (
            (
                "fit",
                "examples/fit_mlp.toml",
                "--dry-run",
                "--storage",
                "s3://bkt/runs?endpoint_override=127.0.0.1:1&scheme=http",
            ),
            "storage_path 's3://bkt/runs/fit-mlp' is not writable",
        ),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    storage = ("--storage", str(tmp_path / "runs")) if args[0] == "demo" and "--storage" not in args else ()
    done = raytrain(*args, *storage)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("raytrain: error: ") and message in lines[0], done.stderr
    assert not (tmp_path / "runs").exists()  # nothing was started, nothing written


def test_verbose_adds_the_traceback_and_keeps_the_exit_code(tmp_path: Path) -> None:
    done = raytrain("--verbose", "demo", "--global-batch", "0", "--storage", str(tmp_path / "runs"))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):" and "raytrain/config.py" in done.stderr, done.stderr
    assert lines[-1] == "raytrain: error: global_batch must be an integer >= 1, got 0"


def test_an_unreachable_ray_address_fails_in_seconds_for_every_entry_point(tmp_path: Path) -> None:
    for args in (("demo", "--steps", "5", "--storage", str(tmp_path)), ("fit", "examples/fit_mlp.toml")):
        done = raytrain(*args, env={"RAY_ADDRESS": "127.0.0.1:1"})
        assert done.returncode == 2, done.stderr
        assert "cannot reach the Ray cluster at RAY_ADDRESS='127.0.0.1:1'" in done.stderr.strip().splitlines()[-1]


def test_help_shows_examples() -> None:
    done = raytrain("--help")
    assert done.returncode == 0 and "examples:" in done.stdout and "raytrain demo" in done.stdout
