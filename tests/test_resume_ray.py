"""Resumes on a real local Ray instance: that replay exactly (zero1 with dropout and the optimizer users reach
for first, AdamW with parameter groups, a cosine schedule and clipping), that change the run (a new global
batch, more epochs), after a torn log line, with trackers, and from damaged checkpoints."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import ray.cloudpickle
from ray_helpers import ids_by_epoch, make_trainer, read_jsonl

from raytrain.config import LRConfig
from raytrain.errors import ConfigError
from raytrain.lr_rules import lr_factor
from raytrain.toy import adamw_groups, mlp_factory
from raytrain.trackers import TensorBoard

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules by name

pytestmark = pytest.mark.ray

ROWS = 128


def test_resume_with_a_larger_global_batch_neither_skips_nor_repeats(
    ray_local: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run at B=16 stopped after a checkpoint, resumed at B=32 and with fewer Parquet partitions to the end of the
    epoch: every sample exactly once (the epoch ends in the order it began in), the peak LR rescaled by the linear
    rule from the first start's batch (base_batch was not given), and the cosine schedule continued where it was:
    the factor at the resume step is the one the first start had there (it jumped before: the run's length in steps
    changed), and the schedule ends with the run."""
    options = {"workers": 2, "rows": ROWS, "epochs": 1, "audit": True}
    # planned for the whole epoch (8 steps at B=16), stopped by a crash in step 5 (no retries)
    lr = LRConfig(base_lr=0.1, rule="linear", schedule="cosine", min_lr_ratio=0.1)
    monkeypatch.setenv("RAYTRAIN_FAULTS", "0:5:forward")
    with pytest.raises(Exception, match=r"(?i)fail"):
        make_trainer(tmp_path, "grow", global_batch=16, every=2, lr=lr, partitions=8, **options).fit()  # type: ignore[arg-type]
    monkeypatch.delenv("RAYTRAIN_FAULTS")
    result = make_trainer(tmp_path, "grow", global_batch=32, lr=lr, partitions=3, **options).fit()  # type: ignore[arg-type]
    resumed = read_jsonl(result.events_path)[-1]["step"]  # 2 or 4 (a crash may beat the last commit)
    metrics = list({m["step"]: m for m in read_jsonl(result.metrics_path)}.values())  # the last of a step retrained
    left = ROWS - 16 * resumed
    sizes = [16] * resumed + [32] * (left // 32) + ([left % 32] if left % 32 else [])
    assert [m["global_batch_size"] for m in metrics] == sizes  # the epoch's last step holds the rest
    ids = ids_by_epoch(result.samples_path or "")[0]
    assert sorted(ids) == list(range(ROWS)), "samples skipped or repeated across the resume"
    peaks = [0.1] * resumed + [0.2] * (len(sizes) - resumed)  # 0.1 x 32/16
    # schedule steps: x = s before the resume, then the rest of the 8 spread over the steps left
    end = len(sizes)
    x = list(range(resumed)) + [resumed + (s - resumed) * (8 - resumed) / (end - resumed) for s in range(resumed, end)]
    factors = [lr_factor(p, warmup_steps=0, schedule="cosine", total_steps=8, min_lr_ratio=0.1) for p in x]
    assert [m["lr"] for m in metrics] == pytest.approx([p * f for p, f in zip(peaks, factors, strict=True)])
    log = (Path(result.run_dir) / "raytrain.log").read_text()
    lengths = [line for line in log.splitlines() if line.startswith("[raytrain] run length:")]
    assert lengths[-1] == (  # the resume's one run-length line, after its decisions; none from the driver before it
        f"[raytrain] run length: resumed at step {resumed}, the run now ends at step {end} (was 8): the LR decay "
        f"continues from {resumed / 8:.0%} of its way at step {resumed} and reaches its end at step {end}"
    ), lengths
    assert "data order: epoch 0 began with partitions=8, shuffle_window=2 and ends in that order" in log


def test_streaming_run_resumed_mid_epoch_at_a_larger_batch_then_extended_trains_every_epoch(
    ray_local: None, tmp_path: Path
) -> None:
    """Streaming mode (no fixed order, the run's length unknown, so a constant LR after the linear rule): 3 steps
    at B=16 then stopped mid-epoch; resumed at B=32 to the end of its one epoch (a finished run); then extended to
    3 epochs. Every sample exactly once in every epoch, each step's batch as configured at its start (the epoch's
    last step holds the rest), and the peak LR rescaled from the first start's batch."""
    options = {"workers": 2, "rows": ROWS, "audit": True, "deterministic": False, "every": 3}
    lr = LRConfig(base_lr=0.1, rule="linear")
    make_trainer(tmp_path, "grow", global_batch=16, steps=3, epochs=1, lr=lr, **options).fit()  # type: ignore[arg-type]
    make_trainer(tmp_path, "grow", global_batch=32, epochs=1, lr=lr, **options).fit()  # type: ignore[arg-type]
    result = make_trainer(tmp_path, "grow", global_batch=32, epochs=3, lr=lr, **options).fit()  # type: ignore[arg-type]
    left, full = ROWS - 3 * 16, ROWS // 32  # the rest of epoch 0 after the stop; full steps of an epoch at B=32
    rest_of_0 = [32] * (left // 32) + ([left % 32] if left % 32 else [])
    epoch = [32] * full + ([ROWS % 32] if ROWS % 32 else [])
    starts = read_jsonl(result.events_path)
    assert [s["step"] for s in starts] == [0, 3, 3 + len(rest_of_0)]
    metrics = list({m["step"]: m for m in read_jsonl(result.metrics_path)}.values())
    sizes = [16] * 3 + rest_of_0 + epoch * 2  # each epoch's last step holds the rest
    assert [m["global_batch_size"] for m in metrics] == sizes
    assert [m["lr"] for m in metrics] == pytest.approx([0.1] * 3 + [0.2] * (len(sizes) - 3))  # 0.1 x 32/16
    by_epoch = ids_by_epoch(result.samples_path or "")
    assert sorted(by_epoch) == [0, 1, 2]
    for epoch, ids in by_epoch.items():
        assert sorted(ids) == list(range(ROWS)), f"epoch {epoch}: duplicates or missing ids"


class JsonTracker:
    """A tracker of one's own (what an MLflow or W&B adapter looks like): three methods, rank 0 only."""

    def start(self, run_dir: str, restored_step: int) -> None:
        self.path = Path(run_dir) / "tracked.jsonl"
        records = [json.loads(line) for line in self.path.read_text().splitlines()] if self.path.exists() else []
        kept = [r for r in records if r["step"] <= restored_step]  # steps after the checkpoint are trained again
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def log(self, metrics: dict[str, float], step: int) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    def finish(self) -> None:
        pass


ADAMW_LR = LRConfig(base_lr=0.01, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1, decay_steps=8)


def test_a_run_stopped_and_resumed_equals_the_run_that_never_stopped(ray_local: None, tmp_path: Path) -> None:
    """A run stopped after its checkpoint at step 4 and resumed at the same W replays steps 5..8 of the run that
    never stopped: the same losses, LRs and gradient norms (the model, the sharded optimizer state, the schedule,
    the data position and the random draws all came back). AdamW with three parameter groups (own weight decay,
    half LR for the first layer) and its state sharded by zero1, dropout (its draws are seeded per seed, step and
    micro-batch), a cosine schedule with warmup over an explicit decay length, clipping; two trackers
    (TensorBoard and one of the user's own) see every step once, and a torn metrics line (a crash or a full disk
    mid-write) does not break the resume. (zero2/zero3 state takes the same path through Ray; its save and load at
    the same and other world sizes are tests/test_checkpoint_reshard.py's.)"""
    options = {
        "workers": 2,
        "epochs": 5,
        "strategy": "zero1",
        "optimizer_fn": adamw_groups,
        "lr": ADAMW_LR,
        "max_grad_norm": 0.5,
        "model_fn": mlp_factory(8, 16, dropout=0.5),
    }
    full = read_jsonl(make_trainer(tmp_path, "full", steps=8, **options).fit().metrics_path)  # type: ignore[arg-type]
    assert all(m["grad_norm"] > 0 for m in full)
    trackers = [TensorBoard(), JsonTracker()]
    make_trainer(tmp_path, "split", steps=4, every=4, trackers=trackers, **options).fit()  # type: ignore[arg-type]
    with open(tmp_path / "split" / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "epoch": 0, "lo')  # torn mid-write
    result = make_trainer(tmp_path, "split", steps=8, every=4, trackers=trackers, **options).fit()  # type: ignore[arg-type]
    events = read_jsonl(result.events_path)
    assert [(e["restored"], e["step"]) for e in events] == [(False, 0), (True, 4)]
    resumed = read_jsonl(result.metrics_path)
    assert [m["step"] for m in resumed] == list(range(1, 9))
    for a, b in zip(full[4:], resumed[4:], strict=True):
        assert (b["step"], b["lr"]) == (a["step"], pytest.approx(a["lr"]))
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-9)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
    expected = [
        0.01 * lr_factor(s, warmup_steps=2, schedule="cosine", total_steps=8, min_lr_ratio=0.1) for s in range(8)
    ]
    assert [m["lr"] for m in full] == pytest.approx(expected)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(tmp_path / "split" / "tensorboard"))
    board.Reload()
    losses = {e.step: e.value for e in board.Scalars("loss")}
    assert sorted(losses) == list(range(1, 9))
    assert [losses[m["step"]] for m in resumed] == pytest.approx([m["loss"] for m in resumed], rel=1e-6)
    assert {"lr", "world_size", "global_batch_size", "step_time_s"} <= set(board.Tags()["scalars"])
    assert [r["step"] for r in read_jsonl(tmp_path / "split" / "tracked.jsonl")] == list(range(1, 9))


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "streaming"])
def test_drop_last_with_a_batch_larger_than_the_data_fails_on_the_driver(
    ray_local: None, tmp_path: Path, deterministic: bool
) -> None:
    trainer = make_trainer(
        tmp_path, "big", workers=2, rows=30, global_batch=40, drop_last=True, deterministic=deterministic
    )
    with pytest.raises(ConfigError, match=r"global_batch \(40\) is larger than the training set \(30 rows\)"):
        trainer.fit()
    assert not (tmp_path / "big").exists()  # no worker ever started


def test_a_broken_lr_schedule_fails_on_the_driver(ray_local: None, tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, "badhook", workers=2, steps=5, lr_schedule_fn=lambda step, total: -1.0)
    with pytest.raises(ConfigError, match=r"lr_schedule_fn .*\(0, 5\) must return a finite number >= 0.*got -1.0"):
        trainer.fit()
    assert not (tmp_path / "badhook").exists()


def test_a_tracker_without_its_methods_is_rejected_on_the_driver(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trackers must have start"):
        make_trainer(tmp_path, "bad", workers=1, trackers=[object()])


def test_damaged_checkpoints_resume_from_the_newest_intact_one(ray_local: None, tmp_path: Path) -> None:
    """Every kind of damage at once, newest first: the latest checkpoint's directory is gone, the one before lost
    its state file, the one before that has a shard cut short; the run resumes from the next, step 4, and trains
    on as it did before the damage."""
    import shutil

    from raytrain.checkpoint_files import STATE_FILE, checkpoint_dirs

    # the run that never stopped is the reference: its newest three checkpoints are then damaged
    options = {"workers": 2, "epochs": 3, "every": 2, "keep": 4}  # max_steps ends both starts
    reference = read_jsonl(make_trainer(tmp_path, "cut", steps=10, **options).fit().metrics_path)  # type: ignore[arg-type]
    found = checkpoint_dirs(str(tmp_path / "cut"))
    assert [step for step, _ in found] == [4, 6, 8, 10]
    paths = [Path(path) for _, path in found]
    shutil.rmtree(paths[3])  # the latest committed one: lost whole
    (paths[2] / STATE_FILE).unlink()  # its state file lost
    shard = paths[1] / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # a full disk or an upload cut short
    result = make_trainer(tmp_path, "cut", steps=12, **options).fit()  # type: ignore[arg-type]  # constant LR
    log = (tmp_path / "cut" / "raytrain.log").read_text()
    assert f"WARNING: checkpoint {paths[3].name} is damaged (the directory is missing)" in log
    assert f"WARNING: checkpoint {paths[2].name} is damaged ({STATE_FILE} is missing)" in log
    assert f"WARNING: checkpoint {paths[1].name} is damaged (__1_0.distcp has 100 of its" in log
    starts = read_jsonl(result.events_path)
    assert starts[-1]["step"] == 4  # the newest intact checkpoint
    metrics = read_jsonl(result.metrics_path)
    assert [m["step"] for m in metrics] == list(range(1, 13))
    for a, b in zip(reference[4:], metrics[4:10], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)


def test_with_every_checkpoint_damaged_the_run_stops_before_any_worker(ray_local: None, tmp_path: Path) -> None:
    from raytrain.checkpoint_files import checkpoint_dirs

    make_trainer(tmp_path, "lost", workers=1, steps=4, every=2).fit()
    for _, path in checkpoint_dirs(str(tmp_path / "lost")):
        (Path(path) / "__0_0.distcp").unlink()
    starts_before = len(read_jsonl(tmp_path / "lost" / "events.jsonl"))
    with pytest.raises(ConfigError, match=r"no intact checkpoint in .* __0_0.distcp is missing.*move the run"):
        make_trainer(tmp_path, "lost", workers=1, steps=6, every=2).fit()
    assert len(read_jsonl(tmp_path / "lost" / "events.jsonl")) == starts_before
