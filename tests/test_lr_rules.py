"""LR rules: a function of the global batch and the step only."""

from __future__ import annotations

import math

import pytest

from raytrain.errors import ConfigError
from raytrain.lr_rules import lr_at_step, lr_change_on_resume, peak_lr


def test_rules() -> None:
    assert peak_lr(1e-3, 256, 1024, "linear") == pytest.approx(4e-3)
    assert peak_lr(1e-3, 256, 1024, "sqrt") == pytest.approx(2e-3)
    assert peak_lr(1e-3, 256, 1024, "none") == pytest.approx(1e-3)
    assert peak_lr(1e-3, 256, 64, "linear") == pytest.approx(2.5e-4)


def test_warmup_ramps_to_peak_and_never_trains_at_zero() -> None:
    lrs = [lr_at_step(s, 1.0, 4) for s in range(6)]
    assert lrs == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_at_step(0, 2.0, 0) == 2.0


def test_resume_with_other_global_batch_warns_with_both_lrs() -> None:
    assert lr_change_on_resume(1e-3, 256, "linear", 512, 512) is None
    message = lr_change_on_resume(1e-3, 256, "sqrt", 256, 1024)
    assert message is not None
    assert "256 -> 1024" in message and "1.000e-03 -> 2.000e-03" in message


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: peak_lr(1e-3, 256, 512, "cubic"), "lr_rule must be one of linear, sqrt, none, got 'cubic'"),
        (lambda: peak_lr(0.0, 256, 512, "linear"), "base_lr must be > 0, got 0.0"),
        (lambda: peak_lr(1e-3, 0, 512, "linear"), "base_batch must be an integer >= 1, got 0"),
        (lambda: lr_at_step(0, 1.0, -1), "warmup_steps must be an integer >= 0, got -1"),
    ],
)
def test_bad_input(call, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        call()


def test_lr_has_no_world_size_input() -> None:
    # The contract: nothing about the LR can depend on W, because W is not an argument.
    import inspect

    for fn in (peak_lr, lr_at_step):
        assert not any("world" in name for name in inspect.signature(fn).parameters)
    assert math.isfinite(peak_lr(1.0, 1, 1, "sqrt"))
