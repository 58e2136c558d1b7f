"""Resource faults: the run's storage filling up mid-run, and a worker running out of memory. Each ends with one
clear line, not ten restarts, and the latest committed checkpoint stays intact (real Ray, local instance)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray.cloudpickle
import torch
from ray_helpers import make_trainer, read_jsonl, wait_for

from raytrain.checkpoint_files import checkpoint_dirs, latest_committed, verify
from raytrain.cli.demo import PacedLoss
from raytrain.errors import UserCodeError
from raytrain.toy import squared_error

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules by name

pytestmark = pytest.mark.ray


def allocates_too_much_at_sample_42(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if bool((batch["id"] == 42).any()):
        torch.empty(10**13)  # 40 TB: the CPU allocator refuses
    return squared_error(model, batch)


def test_out_of_memory_names_the_strategy_and_micro_batch_to_change(ray_local: None, tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, "oom", workers=2, loss_fn=allocates_too_much_at_sample_42, max_failures=10)
    with pytest.raises(
        UserCodeError,
        match=r"OutOfMemory: out of memory at step \d+ .* with strategy ddp, "
        r"micro-batch cap 4 .* lower BatchConfig.micro_batch .* or use zero2 or zero3",
    ):
        trainer.fit()
    assert len(read_jsonl(tmp_path / "oom" / "events.jsonl")) == 1  # not retried


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MB tmpfs (needs root with CAP_SYS_ADMIN, as on the machines this project is developed and tested on)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_ends_with_one_line_and_the_last_checkpoint_intact(
    ray_local: None, tmp_path: Path, small_disk: Path
) -> None:
    """Another process fills the run's disk while it trains (paced so that the fill lands mid-run): the run stops
    at the first write that fails, with one line, and its latest committed checkpoint is intact."""
    trainer = make_trainer(
        small_disk, "full", workers=2, steps=40, every=2, loss_fn=PacedLoss(squared_error, 0.01), max_failures=10
    )
    outcome: dict[str, BaseException] = {}

    def train() -> None:
        try:
            trainer.fit()
        except BaseException as err:  # checked below
            outcome["error"] = err

    training = threading.Thread(target=train, daemon=True)
    training.start()
    wait_for(
        "5 steps before filling the disk",
        lambda: (
            (small_disk / "full" / "metrics.jsonl").exists()
            and len(read_jsonl(small_disk / "full" / "metrics.jsonl")) >= 5
        ),
        240,
        interval_s=0.2,
    )
    with open(small_disk / "filler", "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)
    training.join(timeout=300)
    assert not training.is_alive()
    error = outcome.get("error")
    assert isinstance(error, UserCodeError), repr(error)
    assert "the run's storage is full or not writable" in str(error) and "No space left on device" in str(error)
    (small_disk / "filler").unlink()
    intact = [step for step, path in checkpoint_dirs(str(small_disk / "full")) if verify(path) is None]
    committed = latest_committed(str(small_disk / "full"))  # what a resume restores
    assert committed is not None and committed[0] >= 2, committed  # committed before the disk filled
    assert verify(committed[1]) is None and committed[0] in intact, (committed, intact)
    print(f"stopped with one line; the latest committed checkpoint (step {committed[0]}) is intact")
