"""The suite's two test processes (tests/conftest.py, `RayTestsInOneProcess`): every test that needs Ray runs in
one of them, so two Ray instances never run side by side. Checked on a small suite of its own with this
conftest, so an upgrade of pytest or pytest-xdist that breaks the grouping fails here, not as a flaky Ray test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).resolve().parent / "conftest.py"

SUITE = """
import os, time
from pathlib import Path
import pytest

OUT = Path(os.environ["WORKERS_OUT"])


def record(name):
    time.sleep(0.3)  # long enough that a free process would take the next test
    (OUT / name).write_text(os.environ.get("PYTEST_XDIST_WORKER", "main"))


@pytest.mark.ray
@pytest.mark.parametrize("i", range(4))
def test_marked_ray(i):
    record(f"marked-{i}")


@pytest.mark.slow
def test_marked_slow():
    record("slow")


def test_uses_the_shared_instance(ray_local):
    record("fixture")


@pytest.fixture
def ray_local():  # stands in for conftest's fixture of that name: using it is what counts
    yield


@pytest.mark.parametrize("i", range(4))
def test_plain(i):
    record(f"plain-{i}")
"""


def test_the_tests_that_need_ray_run_in_one_process_and_the_rest_beside_them(tmp_path: Path) -> None:
    suite, out = tmp_path / "suite", tmp_path / "out"
    suite.mkdir()
    out.mkdir()
    shutil.copy(CONFTEST, suite / "conftest.py")
    (suite / "test_suite.py").write_text(SUITE)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup"]
    done = subprocess.run(
        [*command, "-W", "ignore::pytest.PytestUnknownMarkWarning", str(suite)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=suite,
        env={**os.environ, "WORKERS_OUT": str(out)},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    worker = {path.name: path.read_text() for path in out.iterdir()}
    ray = {worker[name] for name in ("marked-0", "marked-1", "marked-2", "marked-3", "slow", "fixture")}
    assert len(ray) == 1 and ray <= {"gw0", "gw1"}, worker  # one process ran them all
    assert {worker[f"plain-{i}"] for i in range(4)} - ray, worker  # the other ran the rest (some of it at least)
