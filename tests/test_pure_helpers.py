"""Pure helpers of the loop, the streaming step agreement, the demo and rank-0 logging (no Ray, no workers)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raytrain.batch_plan import plan_batch
from raytrain.cli.demo import Event, parse_events
from raytrain.console import LOG_FILE
from raytrain.data.id_ranges import IdRanges
from raytrain.data.streaming import micro_split, take_counts
from raytrain.errors import ConfigError
from raytrain.rank0 import Rank0Log, progress_bar, resize_line


@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.integers(1, 64))
def test_take_counts_fills_the_batch_from_whoever_has_rows(available: list[int], global_batch: int) -> None:
    world = len(available)
    if world > global_batch:
        return
    need = list(plan_batch(global_batch, 8, world).per_rank_samples)
    take = take_counts(need, available, global_batch)
    assert all(0 <= t <= a for t, a in zip(take, available, strict=True))
    # Exactly B when the ranks together have B rows; otherwise everything that is there (the epoch's last step).
    assert sum(take) == min(global_batch, sum(available))
    # Where every rank has its planned share, it takes exactly that.
    if all(a >= n for a, n in zip(available, need, strict=True)):
        assert take == need


def test_micro_split_keeps_the_cap_with_uneven_counts() -> None:
    micro = micro_split([10, 3, 0], 4)
    assert [sum(row) for row in micro] == [10, 3, 0]
    assert all(len(row) == 3 and max(row) <= 4 for row in micro)


def test_parse_events() -> None:
    assert parse_events("add@20, remove@10,kill@30") == [Event("remove", 10), Event("add", 20), Event("kill", 30)]
    assert parse_events("none") == []
    for bad in ("explode@3", "remove@0", "remove", "add@x"):
        with pytest.raises(ConfigError, match="events must be a comma-separated list of KIND@STEP"):
            parse_events(bad)


def test_resize_line_names_both_sizes_and_the_unchanged_batch_and_lr() -> None:
    three, two = plan_batch(96, 32, 3).to_dict(), plan_batch(96, 32, 2).to_dict()
    line = resize_line(three, two, 3e-3, 3e-3)
    assert line == (
        "world 3 -> 2: accumulation 1 -> 2, samples/rank [32,32,32] -> [48,48], global batch 96 (unchanged), "
        "peak lr 3.0e-03 (unchanged)"
    )
    assert resize_line(None, three, 3e-3, None).startswith("world 3: accumulation 1")
    # a restart at the same size and batch resized nothing, and says so; a new batch at the same size shows arrows
    assert resize_line(two, two, 3e-3, 3e-3) == (
        "world 2 (as before): accumulation 2, samples/rank [48,48], global batch 96 (unchanged), peak lr 3.0e-03 "
        "(unchanged)"
    )
    bigger = plan_batch(192, 32, 2).to_dict()
    assert resize_line(two, bigger, 6e-3, 3e-3).startswith("world 2 -> 2: accumulation 2 -> 3")


def test_a_finished_run_resumed_names_its_last_epoch_as_the_done_line_did() -> None:
    from raytrain.worker_loop import where_the_run_ends

    # 3 epochs: the done line said "last epoch 2"; the checkpoint holds the position of epoch 3, step 0
    assert where_the_run_ends(3, 3, None) == "the end of its last epoch (2, counted from 0)"
    assert where_the_run_ends(1, 2**31 - 1, 30) == "max_steps=30 (in epoch 1, counted from 0)"


def test_resize_line_of_a_tensor_parallel_run_names_the_layout() -> None:
    dp2, dp1 = plan_batch(8, 4, 2).to_dict(), plan_batch(8, 4, 1).to_dict()
    line = resize_line(dp2, dp1, 1e-3, 1e-3, {"dp": 1, "tp": 2, "pp": 1})
    assert line.startswith("dp 2 -> 1, tp 2, pp 1: accumulation 1 -> 2, samples/replica [4,4] -> [8], global batch 8")
    assert resize_line(None, dp2, 1e-3, None, {"dp": 2, "tp": 2, "pp": 1}).startswith("dp 2, tp 2, pp 1: accum")
    assert resize_line(None, dp2, 1e-3, None, {"dp": 2, "tp": 1, "pp": 1}).startswith("world 2: accum")


def test_progress_bar() -> None:
    assert progress_bar(5, 20) == "[#####...............]  25% "
    assert progress_bar(5, None) == ""


def test_rank0_log_writes_on_rank_0_only_and_trims_replayed_steps(tmp_path: Path) -> None:
    plan = plan_batch(8, 4, 2).to_dict()
    event = {"step": 0, "world_size": 2, "plan": plan, "lr": 0.1, "strategy": "ddp"}
    other = Rank0Log(1, str(tmp_path / "other"), audit=True, log_every=1)
    other.start(restored_step=0, event=event)
    assert not (tmp_path / "other").exists()
    log = Rank0Log(0, str(tmp_path), audit=True, log_every=100)
    log.total_steps = 5  # the run's length: its last step is printed although not a multiple of log_every
    log.start(restored_step=0, event=event)
    for step in range(1, 6):
        metrics = {
            "step": step,
            "epoch": 0,
            "world_size": 2,
            "global_batch_size": 8,
            "step_time_s": 0.1,
            "loss": 1.0,
            "lr": 0.1,
        }
        if step == 3:  # a validation and a metric the user's loop reported: that step's line shows both
            metrics |= {"val_loss": 0.25, "ema_norm": 7.5, "note": "text is not shown"}
        log.step(metrics, [step], shown=["ema_norm", "note"] if step == 3 else ())
    log.start(restored_step=3, event={**event, "step": 3})  # a restart from the step-3 checkpoint
    log.finish({"steps": 5, "val_loss": 0.25})
    fresh = Rank0Log(0, str(tmp_path / "again"), audit=False, log_every=100)
    for _ in range(2):  # a second start from step 0 (the first ended before its first checkpoint): no "as before"
        fresh.start(restored_step=0, event=event)
    fresh.start(restored_step=0, event={**event, "world_size": 1, "plan": plan_batch(8, 4, 1).to_dict()})  # resized
    fresh.close()
    again = (tmp_path / "again" / LOG_FILE).read_text().splitlines()
    assert again == [
        "[raytrain] world 2: accumulation 1, samples/rank [4,4], global batch 8, peak lr 1.0e-01, strategy ddp",
        "[raytrain] world 2: accumulation 1, samples/rank [4,4], global batch 8, peak lr 1.0e-01, strategy ddp, "
        "from step 0 (no checkpoint to resume from)",
        "[raytrain] world 2 -> 1: accumulation 1 -> 2, samples/rank [4,4] -> [8], global batch 8 (unchanged), peak lr "
        "1.0e-01 (unchanged), strategy ddp, from step 0 (no checkpoint to resume from)",
    ], again
    log.close()
    said = (tmp_path / LOG_FILE).read_text().splitlines()
    (restart,) = [line for line in said if line.endswith(", strategy ddp, resumed at step 3")]
    assert restart.startswith("[raytrain] world 2 (as before): accumulation 1, samples/rank [4,4], global batch 8")
    bars = [line for line in said if "| epoch 0 |" in line]
    assert [line.split("step")[1].split("|")[0].strip() for line in bars] == ["1", "3", "5"], bars
    assert "| loss 1.0000 | val_loss 0.25 | ema_norm 7.5 | world 2 |" in bars[1] and "text" not in bars[1], bars
    assert bars[-1].startswith("[raytrain] [####################] 100% step"), bars
    assert said[-1].startswith("[raytrain] done: steps 5, val_loss 0.25 (") and said[-1].endswith(
        f"; files in {tmp_path}"
    )
    metrics_steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    sample_steps = [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert metrics_steps == sample_steps == [1, 2, 3]
    starts = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [s["previous_world_size"] for s in starts] == [None, 2]


def test_timeline_shades_retrained_steps_recoveries_and_marks_unplanned_restarts() -> None:
    from raytrain.cli.demo import AppliedEvent, timeline

    starts = [
        {"time": 100.0, "world_size": 3, "step": 0},
        {"time": 150.0, "world_size": 2, "step": 10},  # caused by the removal at t=110
        {"time": 200.0, "world_size": 2, "step": 30},  # nothing applied explains this one: a crash
    ]
    removal = AppliedEvent("remove", 15, 15, 110.0, "removed node", 155.0, 2, 10, 17)
    line = timeline(starts, [removal])
    assert line.retrained == [(11, 17)]  # steps 11..17 were trained, rolled back, and trained again
    assert line.recoveries == [(10.0, 55.0, "remove")]
    assert line.unplanned == [(100.0, 2)]


def test_the_local_start_line_says_when_workers_outnumber_the_cores() -> None:
    from types import SimpleNamespace

    from raytrain.config import ClusterConfig
    from raytrain.trainer import local_cpus_reason

    spec = SimpleNamespace(cluster=ClusterConfig(min_workers=1, max_workers=5))
    assert local_cpus_reason(spec, cores=8) == "5 workers and Ray Data"  # type: ignore[arg-type]
    assert local_cpus_reason(spec, cores=2) == (  # type: ignore[arg-type]
        "5 workers and Ray Data; 5 workers take turns on 2 cores: slower than 2 workers would be, the same training"
    )


def test_plot_labels_of_close_events_stack_instead_of_overlapping() -> None:
    from raytrain.cli.demo import label_rows

    # kill@20, remove@22, drain@25, add@60 on 240 steps: the three close ones in rows 0-2, the far one back in row 0
    assert label_rows([20.0, 22.0, 25.0, 60.0], 240.0) == [0, 1, 2, 0]
    assert label_rows([60.0, 20.0], 240.0) == [0, 0] and label_rows([], 1.0) == []


def test_demo_warns_about_settings_that_cannot_take_effect() -> None:
    from raytrain.cli.demo import DemoOptions

    options = DemoOptions(nodes=3, min_workers=1, max_workers=5, steps=240, events="remove@20,add@500")
    notes = options.warnings(embedded=True)
    assert any("--workers allows 5 workers but the demo cluster has 3 fake nodes" in n for n in notes)
    assert any("event add@500 is after the last step (240): it will not happen" in n for n in notes)
    assert DemoOptions().warnings(embedded=True) == []


def test_fit_summary_counts_this_invocations_restarts_and_agrees_on_the_epoch(tmp_path: Path) -> None:
    from raytrain.cli.main import fit_summary, format_fit_summary
    from raytrain.trainer import FitResult

    (tmp_path / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "epoch": (s - 1) // 4, "loss": 0.5} | ({"val_loss": 0.75} if s == 8 else {})) + "\n"
            for s in range(1, 9)
        )
    )
    starts = [{"time": 10.0, "world_size": 2, "step": 0}, {"time": 20.0, "world_size": 2, "step": 8}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(s) + "\n" for s in starts))
    result = FitResult(None, None, str(tmp_path), str(tmp_path / "metrics.jsonl"), None, str(tmp_path / "events.jsonl"))
    summary = fit_summary(result, since=15.0)  # a plain rerun of a finished run: one start since, no restart
    assert summary["restarts"] == 0 and summary["world_sizes"] == [2] and summary["resumed_from_step"] == 8
    assert summary["last_epoch"] == 1 and summary["steps"] == 8
    steps_line = format_fit_summary(summary).splitlines()[1]
    assert steps_line == "steps           8 (resumed from step 8), final loss 0.5000, val_loss 0.7500, last epoch 1"


@given(st.sets(st.integers(-50, 200)), st.lists(st.integers(-50, 200)), st.lists(st.integers(-50, 200)))
def test_consumed_id_ranges_match_set_operations(first: set[int], second: list[int], third: list[int]) -> None:
    """Streaming mode's bookkeeping: ranges built and extended in any order hold exactly the set's ids, in the one
    canonical form (sorted, disjoint, never adjacent), and answer membership like the set."""
    import numpy as np

    ranges = IdRanges.from_ids(np.array(sorted(first), dtype=np.int64)).union(np.array(second, dtype=np.int64))
    ranges = ranges.union(np.array(third, dtype=np.int64))
    every = first | set(second) | set(third)
    assert ranges.to_ids().tolist() == sorted(every) and len(ranges) == len(every)
    assert ranges == IdRanges.from_ids(np.array(sorted(every), dtype=np.int64))
    starts, ends = ranges.ranges[:, 0], ranges.ranges[:, 1]
    assert (starts < ends).all() and (starts[1:] > ends[:-1]).all()
    probe = np.arange(-52, 203)
    assert ranges.contains(probe).tolist() == [int(i) in every for i in probe]


def test_id_ranges_at_the_int64_edges_and_refusals() -> None:
    """The lowest id and the highest storable one (2**63 - 2) are members like any other; 2**63 - 1 (the end of a
    range cannot be stored above it), floats and a damaged (non-canonical) ranges file are refused."""
    import numpy as np
    import pytest

    low, high = np.iinfo(np.int64).min, np.iinfo(np.int64).max - 1
    ranges = IdRanges.from_ids(np.array([high, low, high - 1, 0], dtype=np.int64))
    assert ranges.ranges.tolist() == [[low, low + 1], [0, 1], [high - 1, high + 1]]
    assert ranges.contains(np.array([low, low + 1, high, high - 2, 0])).tolist() == [True, False, True, False, True]
    with pytest.raises(ValueError, match="ids must be below"):
        IdRanges.from_ids(np.array([high + 1]))
    with pytest.raises(ValueError, match="ids must be below"):
        IdRanges.from_ids(np.array([2**64 - 1], dtype=np.uint64))
    with pytest.raises(ValueError, match="ids must be integers, got dtype float64"):
        IdRanges().union(np.array([1.2, 1.7]))
    with pytest.raises(ValueError, match="sorted, non-empty, disjoint and not adjacent"):
        IdRanges(np.array([[10, 20], [0, 5]]))


def test_consumed_ids_in_layout_order_take_one_range_per_run() -> None:
    """Ids consumed block by block with a few held back in a shuffle buffer: the ranges number the holes, not
    the ids (1e6 ids, 50 held back: at most 51 ranges, 816 bytes)."""
    import numpy as np

    held = np.random.default_rng(0).choice(10**6, 50, replace=False)
    ranges = IdRanges().union(np.setdiff1d(np.arange(10**6), held))
    assert len(ranges) == 10**6 - 50 and len(ranges.ranges) <= 51 and ranges.ranges.nbytes <= 51 * 16


def test_sizes_in_log_lines_keep_three_digits() -> None:
    from raytrain.memory_plan import format_bytes

    assert [format_bytes(n) for n in (512, 27_000, 505_900, 999_500, 3_200_000, 1_500_000_000, 2e13)] == [
        "512 B",
        "27 kB",
        "506 kB",
        "1 MB",
        "3.2 MB",
        "1.5 GB",
        "20 TB",
    ]


def test_steps_without_epochs_train_the_steps_and_both_say_which_ends_the_run() -> None:
    from raytrain.config import UNBOUNDED_EPOCHS, LoopConfig
    from raytrain.data.materialized import describe_run_length, run_total_steps

    steps_only = LoopConfig(max_steps=100)  # 79 steps per epoch: epochs defaulted to 1 and stopped at 79
    assert steps_only.epoch_limit == UNBOUNDED_EPOCHS and LoopConfig().epoch_limit == 1
    total = run_total_steps(
        num_rows=79 * 16,
        global_batch=16,
        drop_last=False,
        epochs=steps_only.epoch_limit,
        max_steps=100,
        step=0,
        epoch=0,
        sample_in_epoch=0,
    )
    assert total == 100
    assert describe_run_length(79 * 16, 16, False, steps_only) == "run length: max_steps=100 (1.27 epochs of 79 steps)"
    assert describe_run_length(79 * 16, 16, False, LoopConfig(epochs=1, max_steps=100)) == (
        "run length: epochs=1 ends the run at step 79 (79 steps per epoch), before max_steps=100"
    )
    assert describe_run_length(79 * 16, 16, False, LoopConfig(epochs=3, max_steps=100)) == (
        "run length: max_steps=100 ends the run in epoch 1 (of epochs 0-2, counted from 0 as the metrics count them; "
        "79 steps per epoch)"  # step 100 is in the second epoch, which metrics.jsonl and "done: last epoch" call 1
    )
    # 1,000 rows at B = 128: 7 full steps and one of 104 (the line says so, and what drop_last would do)
    assert describe_run_length(1000, 128, False, LoopConfig(epochs=2)) == (
        "run length: 2 epoch(s) of 8 steps, 16 steps; each epoch's last step trains the 104 samples left, not 128, "
        "at the step's LR (drop_last=False; drop_last=True leaves them out)"
    )
    assert describe_run_length(1000, 128, True, LoopConfig(epochs=2)).endswith(
        "7 steps, 14 steps; each epoch leaves out 104 of its 1000 samples (drop_last=True; a reshuffle picks others)"
    )
    assert (
        describe_run_length(79 * 16, 16, False, LoopConfig(epochs=2)) == "run length: 2 epoch(s) of 79 steps, 158 steps"
    )


@pytest.mark.parametrize("features", [8, 16])
def test_toy_regression_seeds_draw_samples_of_one_problem(features: int) -> None:
    """README's validation set (`seed=1`, 256 rows) is the training set's problem (`seed=0`, 2048 rows) on other
    samples: y follows tanh(x @ w) with the same w for every seed and size (it was redrawn per seed and size)."""
    import numpy as np

    from raytrain.toy import regression_arrays, regression_weights

    w = regression_weights(features)
    for rows, seed in ((2048, 0), (256, 1), (320, 7)):
        data = regression_arrays(rows, features, seed)
        residual = data["y"] - np.tanh(data["x"] @ w)
        assert float(np.abs(residual).max()) < 0.6 and 0.05 < float(residual.std()) < 0.15  # noise 0.1 only
    assert not np.array_equal(regression_arrays(256, features, 0)["x"], regression_arrays(256, features, 1)["x"])


def test_steps_until_agreement_spaces_agreements_about_a_period_apart() -> None:
    from raytrain.agreement import AGREE_MOST_STEPS, steps_until_agreement

    assert steps_until_agreement(0.02, 1) == 50  # 20 ms steps: every 50 steps, one second
    assert steps_until_agreement(0.5, 10) == 20
    assert steps_until_agreement(0.001, 1) == AGREE_MOST_STEPS  # never further apart than the cap
    assert steps_until_agreement(2.0, 1) == 1  # steps longer than the period agree at every step
    for seconds, steps in ((0.0, 5), (float("nan"), 5), (float("inf"), 5), (-1.0, 5), (0.1, 0)):
        assert steps_until_agreement(seconds, steps) == 1  # nothing known: agree at once


@pytest.mark.parametrize("step_s", [0.004, 0.02, 1.5])
def test_every_rank_agrees_at_the_same_steps_and_the_agreement_carries_the_slowest_ranks_wait(step_s: float) -> None:
    """Two ranks' clocks, fed the same agreed values (what the step's all-gather gives each), agree at the same
    steps, the first step first; between agreements a rank's data waits add up and the agreement carries the
    largest sum; the steps' pace sets the spacing (about a second's worth, capped; every step for slow steps)."""
    from raytrain.agreement import AGREE_MOST_STEPS, AgreementClock

    clocks = [AgreementClock(), AgreementClock()]
    agreed_at, window, waits = [], 0, []
    for step in range(1, 301):
        for rank, clock in enumerate(clocks):
            clock.waited(0.001 * (rank + 1))  # rank 1 always waits longer
        assert clocks[0].due == clocks[1].due
        window += 1
        agreed = None
        if clocks[0].due:
            values = [clock.values(-1.0, unwritten=rank == 0) for rank, clock in enumerate(clocks)]
            agreed = [max(column) for column in zip(*values, strict=True)]
            agreed[3] = step_s * window  # the slowest rank's seconds since the last agreement
            agreed_at.append(step)
            waits.append((agreed[2], agreed[1], window))
            window = 0
        for clock in clocks:
            clock.stepped(agreed)
    spacing = min(AGREE_MOST_STEPS, max(1, int(1.0 / step_s)))
    assert agreed_at[0] == 1  # a new worker group agrees at its first step (no pace known yet)
    assert all(b - a == spacing for a, b in itertools.pairwise(agreed_at)), agreed_at[:6]
    assert len(agreed_at) == 1 + (300 - 1) // spacing
    assert all(wait == pytest.approx(0.002 * steps) and unwritten == 1.0 for wait, unwritten, steps in waits)


def test_a_bug_in_the_users_project_is_shown_by_its_files_and_lines(tmp_path: Path) -> None:
    """A project of two files whose loss calls a helper that makes torch raise: the worker renders the user's
    frames (both files, innermost last, each with its code) and where inside torch it was raised; the strings
    survive the pickling Ray does, and the driver's error puts them under its one-line message. A long message is
    shortened at a word, never mid-word."""
    import importlib
    import pickle
    import sys

    import torch

    from raytrain.failures import frames_of, mark, traceback_of
    from raytrain.ray_hooks import describe_error, user_code_error

    (tmp_path / "shapes.py").write_text("def fold(x):\n    return x.view(7, -1)  # 7 does not divide it\n")
    (tmp_path / "train_job.py").write_text(
        "from shapes import fold\n\ndef loss(batch):\n    folded = fold(batch)\n    return folded.sum()\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        job = importlib.import_module("train_job")
        with pytest.raises(RuntimeError) as caught:
            job.loss(torch.zeros(1536))
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("train_job", "shapes"):
            sys.modules.pop(name, None)
    error = caught.value
    mark(error, 3, "step")
    error = pickle.loads(pickle.dumps(error))  # what Ray does between the worker and the controller
    assert error.__traceback__ is None  # the frames are gone after pickling: only the rendered strings remain
    frames = frames_of(error).splitlines()
    assert frames[0].endswith("in test_a_bug_in_the_users_project_is_shown_by_its_files_and_lines")  # the caller
    assert frames[2:] == [
        f'  File "{tmp_path / "train_job.py"}", line 4, in loss',
        "    folded = fold(batch)",
        f'  File "{tmp_path / "shapes.py"}", line 2, in fold',
        "    return x.view(7, -1)  # 7 does not divide it",
    ]
    assert len(frames) == 6  # 3 frames; torch's view raises in C++: no library frame below the user's
    assert "Traceback (most recent call last)" in traceback_of(error) and "test_pure_helpers.py" in traceback_of(error)
    stopped = user_code_error("RuntimeError: shape '[7, -1]' is invalid (at step 3 on rank 0)", error)
    assert str(stopped).splitlines()[1:] == frames
    assert stopped.worker_traceback == traceback_of(error)  # type: ignore[attr-defined]

    try:  # raised inside a library below the user's frame: its file and line under them
        json.loads("{'single': 'quotes'}")
    except ValueError as err:
        library = frames_of(err).splitlines()
    assert library[-2] == """    json.loads("{'single': 'quotes'}")"""  # the code, stripped, under its frame
    assert library[-1].startswith("  (raised inside json/decoder.py, line ")
    assert library[-1].endswith(", in raw_decode)")

    long = ValueError("word " * 60)
    shown = describe_error(long)
    assert shown.endswith("word ...") and len(shown) < 180, shown


def test_the_drivers_checks_of_the_users_functions_show_their_file_and_line(tmp_path: Path) -> None:
    """model_fn, optimizer_fn, lr_schedule_fn and units_fn of a user's file, each raising: the driver's check
    fails with one line naming the function and the error, then the user's file, line and code under it."""
    import importlib
    import sys

    import torch

    from raytrain import preflight
    from raytrain.errors import ConfigError

    (tmp_path / "bugs_job.py").write_text(
        "import torch\n"
        "def model():\n    return torch.nn.Linear(3, 'four')\n"
        "def optimizer(params, lr):\n    return torch.optim.AdamW(params, lr=lr, betas=0.9)\n"
        "def schedule(step, total):\n    return step / (total - total)\n"
        "def units(model):\n    return model.blocks\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        job = importlib.import_module("bugs_job")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("bugs_job", None)
    linear = torch.nn.Linear(3, 4)
    checks = [
        (lambda: preflight.build_model_for_check(job.model), "model_fn model raised TypeError", 3),
        (lambda: preflight.check_optimizer_fn(job.optimizer, linear, 0.1, "ddp"), "optimizer_fn optimizer raised", 5),
        (lambda: preflight.check_lr_schedule_fn(job.schedule, 10), "lr_schedule_fn schedule(0, 10) raised Zero", 7),
        (lambda: preflight.check_units_fn(job.units, linear), "units_fn units raised AttributeError", 9),
    ]
    for check, first, line in checks:
        with pytest.raises(ConfigError) as caught:
            check()
        shown = str(caught.value).splitlines()
        assert shown[0].startswith(first), shown
        user = [i for i, text in enumerate(shown) if text.startswith(f'  File "{tmp_path / "bugs_job.py"}"')]
        assert len(user) == 1 and shown[user[0]].endswith(f", line {line}, in {first.split()[1].split('(')[0]}"), shown
        assert shown[user[0] + 1].startswith("    return "), shown


def test_the_runs_directory_raytrain_creates_stays_out_of_a_working_dir_upload(tmp_path: Path) -> None:
    """`ray job submit --working-dir .` of a project whose runs went to the default `./raytrain_runs`: Ray's own
    packaging walk (the one that builds the upload) leaves the runs out, as git does; a directory that existed
    before raytrain (here the project itself) gets no file of raytrain's."""
    from ray._private.runtime_env.packaging import _dir_travel

    from raytrain.storage import keep_out_of_uploads

    project = tmp_path / "project"
    project.mkdir()
    (project / "entry.py").write_text("x = 1\n")
    assert keep_out_of_uploads(str(project / "raytrain_runs")) is True
    checkpoint = project / "raytrain_runs" / "run" / "checkpoint_2026-12-07_10-00-00.000000"
    checkpoint.mkdir(parents=True)
    (checkpoint / "__0_0.distcp").write_bytes(b"x" * 1024)
    uploaded: list[str] = []
    _dir_travel(project, [], lambda path: uploaded.append(str(path.relative_to(project))), include_gitignore=True)
    assert "entry.py" in uploaded and not any(p.startswith("raytrain_runs/") for p in uploaded), uploaded
    assert keep_out_of_uploads(str(project)) is False and sorted(p.name for p in project.iterdir()) == [
        "entry.py",
        "raytrain_runs",
    ]


def test_a_token_clusters_refusal_names_what_is_missing_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """README's cluster commands on a machine with `~/.ray/auth_token`: a head started with the mode unset uses
    the token; a process with the token but no `RAY_AUTH_MODE=token` is told to set the mode, not the token it has;
    without a token, both; in token mode, the token."""
    from ray._private.authentication.authentication_token_setup import AuthenticationTokenLoader

    from raytrain.trainer import _refused_message

    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    refusal = ValueError("InvalidAuthToken: Authentication token is missing or incorrect. More text")
    loader = AuthenticationTokenLoader.instance()
    try:
        loader.reset_cache()
        without = _refused_message("10.0.0.1:6379", refusal)
        (tmp_path / ".ray").mkdir()
        (tmp_path / ".ray" / "auth_token").write_text("0123456789abcdef" * 2)
        loader.reset_cache()
        with_token = _refused_message("10.0.0.1:6379", refusal)
        monkeypatch.setenv("RAY_AUTH_MODE", "token")
        in_token_mode = _refused_message("10.0.0.1:6379", refusal)
    finally:
        loader.reset_cache()
    start = "the Ray cluster at RAY_ADDRESS='10.0.0.1:6379' refused this process: it uses token authentication and "
    reason = " (InvalidAuthToken: Authentication token is missing or incorrect)"
    assert with_token == start + "this process does not (RAY_AUTH_MODE unset): set RAY_AUTH_MODE=token" + reason
    assert without.startswith(start + "this process does not (RAY_AUTH_MODE unset): set RAY_AUTH_MODE=token and ")
    assert in_token_mode.startswith(start + "the token here is missing or not the cluster's; set RAY_AUTH_TOKEN")


def test_the_demos_summary_says_its_audit_and_counts_in_words() -> None:
    from raytrain.cli.main import format_audit, format_summary

    clean = {str(e): {"duplicates": 0, "missing": 0} for e in range(4)}
    assert format_audit(clean) == "epochs 0-3: every sample exactly once"
    assert format_audit({"0": {"duplicates": 0, "missing": 0}}) == "epoch 0: every sample exactly once"
    broken = clean | {"2": {"duplicates": 3, "missing": 1}}
    assert format_audit(broken) == "epoch 2: 3 duplicated, 1 missing"
    event = {"kind": "kill", "applied_step": 10, "detail": "killed rank 1", "recovered_time": 1.0}
    event |= {"recovered_world_size": 2, "recovery_s": 8.2, "steps_lost": 1}
    summary = {"run_dir": "r", "steps": 20, "wall_s": 30, "final_loss": 0.5, "global_batch_sizes": [96]}
    summary |= {"world_sizes": [3, 2], "restarts": 1, "events": [event], "skipped_events": [], "audit": clean}
    summary["plot"] = "r/timeline.png"
    text = format_summary(summary)
    assert "training again at world 2 after 8.2 s, 1 step retrained" in text, text
    assert "audit           epochs 0-3: every sample exactly once" in text, text
