"""LR rules and schedules: a function of the global batch and the step only (pure, no Ray)."""

from __future__ import annotations

import inspect
import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raytrain.config import LRConfig
from raytrain.errors import ConfigError
from raytrain.lr_rules import ScheduleClock, describe_lr_on_resume, describe_schedule_on_resume, lr_factor, peak_lr


def test_rules() -> None:
    assert peak_lr(1e-3, 256, 1024, "linear") == pytest.approx(4e-3)
    assert peak_lr(1e-3, 256, 1024, "sqrt") == pytest.approx(2e-3)
    assert peak_lr(1e-3, 256, 1024, "none") == pytest.approx(1e-3)
    assert peak_lr(1e-3, 256, 64, "linear") == pytest.approx(2.5e-4)


def test_warmup_ramps_to_peak_and_never_trains_at_zero() -> None:
    assert [lr_factor(s, warmup_steps=4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(0, warmup_steps=0) == 1.0


def test_cosine_and_linear_decay_from_peak_to_min_after_warmup() -> None:
    cosine = [lr_factor(s, warmup_steps=2, schedule="cosine", total_steps=12, min_lr_ratio=0.1) for s in range(14)]
    assert cosine[:2] == [0.5, 1.0]  # warmup
    assert cosine[2] == pytest.approx(1.0)  # decay starts at the peak
    assert cosine[7] == pytest.approx(0.1 + 0.9 * 0.5)  # half way: the mean of peak and min
    assert cosine[12] == cosine[13] == pytest.approx(0.1)  # at and past the end: the minimum
    assert all(a >= b for a, b in itertools.pairwise(cosine[1:]))  # never rises after warmup
    linear = [lr_factor(s, warmup_steps=0, schedule="linear", total_steps=4) for s in range(5)]
    assert linear == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])


@given(
    step=st.integers(0, 10_000),
    warmup=st.integers(0, 100),
    total=st.integers(1, 5_000),
    schedule=st.sampled_from(["constant", "cosine", "linear"]),
    floor=st.floats(0.0, 1.0),
)
def test_factor_stays_between_min_and_peak(step: int, warmup: int, total: int, schedule: str, floor: float) -> None:
    factor = lr_factor(step, warmup_steps=warmup, schedule=schedule, total_steps=total, min_lr_ratio=floor)
    low = (step + 1) / warmup if step < warmup else floor if schedule != "constant" else 1.0
    assert low - 1e-12 <= factor <= 1.0 + 1e-12


def test_config_factor_uses_decay_steps_over_the_run_length() -> None:
    config = LRConfig(base_lr=1.0, schedule="linear", decay_steps=10)
    assert config.factor(5, total_steps=1000) == pytest.approx(0.5)
    assert LRConfig(base_lr=1.0, schedule="linear").factor(5, total_steps=20) == pytest.approx(0.75)


def test_config_base_batch_falls_back_to_the_checkpoint_then_the_global_batch() -> None:
    config = LRConfig(base_lr=1e-3, rule="linear")
    assert config.peak_lr(32) == pytest.approx(1e-3)  # first start: base batch = this global batch
    assert config.peak_lr(32, base_batch=16) == pytest.approx(2e-3)  # resumed: the checkpoint's base batch
    assert LRConfig(base_lr=1e-3, base_batch=64).peak_lr(32, base_batch=16) == pytest.approx(5e-4)  # config wins


def test_resume_message_says_what_really_happened() -> None:
    same = dict(rule="linear", base_batch=16, old_peak=1e-3, new_peak=1e-3)
    assert describe_lr_on_resume(old_global_batch=16, new_global_batch=16, **same) is None  # type: ignore[arg-type]
    rescaled = describe_lr_on_resume(
        rule="linear", base_batch=16, old_global_batch=16, new_global_batch=32, old_peak=1e-3, new_peak=2e-3
    )
    assert rescaled == (
        "global batch changed on resume: 16 -> 32; peak lr rescaled by the 'linear' rule from base batch 16: "
        "1.000e-03 -> 2.000e-03"
    )
    kept = describe_lr_on_resume(
        rule="none", base_batch=16, old_global_batch=16, new_global_batch=32, old_peak=1e-3, new_peak=1e-3
    )
    assert kept == "global batch changed on resume: 16 -> 32; peak lr unchanged at 1.000e-03 (rule 'none')"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: peak_lr(1e-3, 256, 512, "cubic"), "^rule must be one of linear, sqrt, none, got 'cubic'"),
        (lambda: peak_lr(0.0, 256, 512, "linear"), "base_lr must be > 0, got 0.0"),
        (lambda: peak_lr(1e-3, 0, 512, "linear"), "base_batch must be an integer >= 1, got 0"),
        (lambda: lr_factor(0, warmup_steps=-1), "warmup_steps must be an integer >= 0, got -1"),
        (lambda: lr_factor(0, warmup_steps=0, schedule="step"), "schedule must be one of constant, cosine, linear"),
        (lambda: lr_factor(3, warmup_steps=0, schedule="cosine"), "needs the run's total steps, got total_steps=None"),
        (lambda: LRConfig(base_lr=1.0, min_lr_ratio=1.5), r"min_lr_ratio must be a number in \[0, 1\], got 1.5"),
        (lambda: LRConfig(base_lr=1.0, decay_steps=0), "decay_steps must be an integer >= 1, got 0"),
        (lambda: LRConfig(base_lr=1.0, schedule="exp"), "schedule must be one of constant, cosine, linear, got 'exp'"),
    ],
)
def test_bad_input(call, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        call()


def test_lr_has_no_world_size_input() -> None:
    # The contract: nothing about the LR can depend on W, because W is not an argument.
    for fn in (peak_lr, lr_factor, LRConfig.factor, LRConfig.peak_lr):
        assert not any("world" in name for name in inspect.signature(fn).parameters)
    assert math.isfinite(peak_lr(1.0, 1, 1, "sqrt"))


def test_the_schedule_continues_when_a_resume_changes_the_runs_length() -> None:
    """128 samples at B = 16 are 8 steps; a resume at step 3 with B = 32 leaves 80 samples: 3 more steps, ending
    at step 6. The cosine factor at the resume step is the one the first start had there (x = 3 of 8), and the
    schedule reaches its end with the run (x = 8 at step 6), instead of jumping to 3 of 6."""
    first = ScheduleClock(total=8, end=8)
    assert [first.position(s) for s in range(8)] == list(range(8))  # x = s until a resume re-anchors
    resumed = first.resumed(3, ScheduleClock(total=6, end=6))
    assert resumed == ScheduleClock(total=8, end=6, anchor_step=3, anchor_x=3.0)
    assert [resumed.position(s) for s in (3, 4, 5, 6)] == pytest.approx([3, 3 + 5 / 3, 3 + 10 / 3, 8])

    def factor(clock: ScheduleClock, step: int) -> float:
        return lr_factor(clock.position(step), warmup_steps=0, schedule="cosine", total_steps=clock.total)

    assert factor(resumed, 3) == pytest.approx(factor(first, 3))  # continuous at the resume point
    assert factor(resumed, 6) == pytest.approx(0.0)  # and ends with the run
    assert describe_schedule_on_resume(first, resumed, 3, 6) == (
        "run length: resumed at step 3, the run now ends at step 6 (was 8): the LR decay continues from 38% of its "
        "way at step 3 and reaches its end at step 6"
    )
    assert (
        describe_schedule_on_resume(first, first, 3, 8)
        == "run length: resumed at step 3, the run ends at step 8 (as before)"
    )
    assert describe_schedule_on_resume(first, first, 3, None) is None  # streaming without max_steps: unknown
    # The same end, or a length fixed in steps (decay_steps): nothing re-anchored.
    assert first.resumed(3, ScheduleClock(total=8, end=8)) is first
    fixed = ScheduleClock(total=20, end=None)
    assert first.resumed(3, fixed) is fixed and fixed.position(3) == 3
    assert ScheduleClock.from_dict(resumed.to_dict()) == resumed


@pytest.mark.parametrize("resume_at", [10, 50])
@pytest.mark.parametrize("new_end", [400, 60])
def test_warmup_ends_at_its_step_whatever_the_runs_new_length(resume_at: int, new_end: int) -> None:
    """warmup_steps = 20, cosine to min_lr_ratio 0.1, max_steps 100; resumed at step 10 (warmup unfinished) or 50
    with max_steps 400 or 60: the LR sequence is the fresh run's up to the resume, the warmup ends at step 20 (the
    peak at step 20, (s + 1) / 20 before it), the decay continues from the factor reached (no jump) and ends with
    the run (min at the new end), never rising again after the peak."""
    lr = LRConfig(base_lr=1.0, warmup_steps=20, schedule="cosine", min_lr_ratio=0.1)

    def factors(clock: ScheduleClock, steps: range) -> list[float]:
        return [lr.factor(clock.position(s), clock.total) for s in steps]

    first = ScheduleClock(total=100, end=100, warmup=20)
    before = factors(first, range(100))
    resumed = first.resumed(resume_at, ScheduleClock(total=new_end, end=new_end, warmup=20))
    after = before[:resume_at] + factors(resumed, range(resume_at, new_end + 1))  # the run's steps, either clock
    assert after[resume_at] == pytest.approx(before[resume_at])  # the resume step trains at the LR it would have
    assert after[:20] == pytest.approx([(s + 1) / 20 for s in range(20)]) and after[20] == pytest.approx(1.0)
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(after[20:]))  # decays, never rises again
    assert after[new_end] == pytest.approx(0.1)  # ends with the run
    line = describe_schedule_on_resume(first, resumed, resume_at, new_end)
    assert line is not None and f"the run now ends at step {new_end} (was 100)" in line
    if resume_at < 20:
        assert line.endswith(f"warmup ends at step 20 as set, then the LR decays to its end at step {new_end}")
    else:  # 50 of 100 with 20 of warmup: 30 / 80 of the decay done
        assert f"the LR decay continues from 38% of its way at step {resume_at}" in line
    assert ScheduleClock.from_dict(resumed.to_dict()) == resumed
    # The same line only where the end moved: a warmup changed alone says "(as before)"; a run shortened to end at
    # the resume step says how far the decay had gone by the clock it had
    assert describe_schedule_on_resume(first, replace(first, warmup=10), 50, 100) == (
        "run length: resumed at step 50, the run ends at step 100 (as before)"
    )
    ended = describe_schedule_on_resume(first, first.resumed(50, ScheduleClock(50, 50, warmup=20)), 50, 50)
    assert ended is not None and "continues from 38% of its way at step 50" in ended
    # A record written before the warmup was kept (no "warmup") reads as it did: warmup stretched with the rest.
    legacy = ScheduleClock.from_dict({"total": 100, "end": 400, "anchor_step": 10, "anchor_x": 10.0})
    assert legacy.warmup == 0 and legacy.position(20) == pytest.approx(10 + 10 * 90 / 390)


def test_a_run_that_ended_within_its_warmup_and_is_extended_warms_up_then_decays() -> None:
    """8 steps with warmup_steps = 10 (the run ended inside its warmup), extended to 100 at a resume from step 8:
    the warmup goes on to step 10, never above the peak, and the decay spans steps 10-100 (it was flat at or above
    the peak to the end when the clock was re-anchored past its total)."""
    lr = LRConfig(base_lr=1.0, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    first = ScheduleClock(total=8, end=8, warmup=10)
    clock = first.resumed(8, ScheduleClock(total=100, end=100, warmup=10))
    factors = [lr.factor(clock.position(s), clock.total) for s in range(8, 101)]
    assert max(factors) == pytest.approx(1.0) and factors[10 - 8] == pytest.approx(1.0)
    assert factors[-1] == pytest.approx(0.1) and factors[0] == pytest.approx(lr.factor(8, 8))
    line = describe_schedule_on_resume(first, clock, 8, 100)
    assert line is not None and line.endswith(
        "warmup ends at step 10 as set, then the LR decays to its end at step 100"
    )
