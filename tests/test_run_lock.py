"""The run lock without Ray: one holder per run directory, and no trace left by a run refused before it wrote."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from raytrain.errors import ConfigError
from raytrain.run_lock import LOCK_FILE, run_lock

HOLD = """
import sys, time
from raytrain.run_lock import run_lock
with run_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_second_process_is_refused_while_the_first_holds_the_run(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "r"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=r"is already being trained by pid \d+"), run_lock(str(run)):
            pass
        assert (run / LOCK_FILE).exists()  # the refused one removed nothing of the holder's
    finally:
        holder.kill()
        holder.wait()
    with run_lock(str(run)):  # the lock died with its process
        pass


def test_a_refused_run_leaves_no_directory_behind(tmp_path: Path) -> None:
    run = tmp_path / "storage" / "run"
    with pytest.raises(ValueError), run_lock(str(run)):
        assert (run / LOCK_FILE).exists()
        raise ValueError("the config was bad")
    assert not (tmp_path / "storage").exists()


def test_a_run_that_wrote_keeps_its_directory_and_an_existing_one_is_never_removed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with run_lock(str(run)):
        (run / "metrics.jsonl").write_text("{}\n")
    assert (run / "metrics.jsonl").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with run_lock(str(empty)):
        pass
    assert empty.is_dir()


def test_the_same_process_may_take_the_lock_again(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with run_lock(str(run)), run_lock(str(run)):
        assert (run / LOCK_FILE).exists()
    assert not run.exists()
