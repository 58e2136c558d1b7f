"""Pure-math tests of the batch plan (no Ray, no torch)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raytrain.batch_plan import parse_worker_range, plan_batch
from raytrain.errors import ConfigError


@settings(max_examples=400, deadline=None)
@given(
    global_batch=st.integers(1, 4096),
    micro_batch=st.integers(1, 256),
    world_size=st.integers(1, 64),
)
def test_plan_is_exact_minimal_and_balanced(global_batch: int, micro_batch: int, world_size: int) -> None:
    world_size = min(world_size, global_batch)
    plan = plan_batch(global_batch, micro_batch, world_size)
    k = plan.accumulation_steps
    # Exact: every sample of the global batch is assigned exactly once.
    assert sum(plan.per_rank_samples) == global_batch
    assert len(plan.micro_batches) == world_size
    assert all(len(row) == k for row in plan.micro_batches)
    # Capped, and k is the smallest possible: k - 1 micro-steps could hold fewer than B samples.
    assert plan.max_micro_batch <= micro_batch
    assert (k - 1) * micro_batch * world_size < global_batch <= k * micro_batch * world_size
    # Balanced: in every micro-step the ranks differ by at most one sample.
    for j in range(k):
        column = [row[j] for row in plan.micro_batches]
        assert max(column) - min(column) <= 1
    # The synchronising (last) micro-step of every rank holds data.
    assert all(row[-1] >= 1 for row in plan.micro_batches)
    # Loss weights sum to one and the offsets tile [0, B).
    assert math.isclose(sum(plan.loss_weight(r) for r in range(world_size)), 1.0)
    assert plan.rank_offset(world_size - 1) + plan.per_rank_samples[-1] == global_batch


def test_every_world_size_from_1_to_b_is_exact() -> None:
    for world_size in range(1, 97):
        assert sum(plan_batch(96, 8, world_size).per_rank_samples) == 96


def test_known_plan() -> None:
    plan = plan_batch(96, 32, 3)
    assert plan.accumulation_steps == 1
    assert plan.per_rank_samples == (32, 32, 32)
    plan = plan_batch(96, 32, 2)
    assert plan.accumulation_steps == 2
    assert plan.micro_batches == ((24, 24), (24, 24))
    plan = plan_batch(10, 4, 3)
    assert plan.accumulation_steps == 1
    assert plan.per_rank_samples == (4, 3, 3)
    assert plan.loss_scale == pytest.approx(3 / 10)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 4, 1), "global_batch must be an integer >= 1, got 0"),
        ((8, 0, 1), "micro_batch must be an integer >= 1, got 0"),
        ((8, 4, 0), r"world_size must be an integer in \[1, 8\], got 0"),
        ((8, 4, 9), r"world_size must be an integer in \[1, global_batch=8\], got 9"),
        ((8.0, 4, 1), "global_batch must be an integer >= 1, got 8.0"),
    ],
)
def test_bad_input_names_field_and_value(args: tuple, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_batch(*args)


def test_parse_worker_range() -> None:
    assert parse_worker_range("3") == (3, 3)
    assert parse_worker_range("1:12") == (1, 12)
    for bad in ("0", "4:2", "a:b", "1:2:3", ""):
        with pytest.raises(ConfigError, match="workers must be"):
            parse_worker_range(bad)
