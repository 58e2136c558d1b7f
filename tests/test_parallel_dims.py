"""Pure layout math: `ParallelDims` (dp from W, tp, pp; rank <-> coordinates, TP innermost), the check that a TP
group stays on one node, and the tensor-parallel plan's checks on a meta model. No process group needed."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from raytrain.errors import ConfigError
from raytrain.parallel.apply import repeated_blocks
from raytrain.parallel.dims import Coords, ParallelDims, check_tp_within_nodes
from raytrain.parallel.pipeline import keep_stage, model_inputs, pipeline_units, stage_bounds
from raytrain.parallel.tensor import check_tp_plan, plan_of, resolve_plan
from raytrain.toy import GPT, block_mlp, block_mlp_tp_plan, mlp, mlp_tp_plan, squared_error


@given(tp=st.integers(1, 8), pp=st.integers(1, 8), dp=st.integers(1, 8))
def test_coordinates_cover_every_rank_once_with_tp_innermost(tp: int, pp: int, dp: int) -> None:
    dims = ParallelDims.of(tp * pp * dp, tp=tp, pp=pp)
    assert dims.dp == dp and dims.replica == tp * pp
    seen = set()
    for rank in range(dims.world):
        c = dims.coords(rank)
        assert 0 <= c.pp < pp and 0 <= c.dp < dp and 0 <= c.tp < tp
        assert dims.rank_of(c) == rank
        seen.add((c.pp, c.dp, c.tp))
        assert c.tp == rank % tp  # consecutive ranks form a TP group
    assert len(seen) == dims.world


def test_a_four_worker_tp2_layout() -> None:
    dims = ParallelDims.of(4, tp=2)
    assert (dims.dp, dims.describe()) == (2, "dp 2, tp 2, pp 1")
    assert [dims.coords(r) for r in range(4)] == [Coords(0, 0, 0), Coords(0, 0, 1), Coords(0, 1, 0), Coords(0, 1, 1)]
    assert ParallelDims.of(4, pp=2).coords(2) == Coords(pp=1, dp=0, tp=0)  # PP outermost


def test_a_world_that_tp_times_pp_does_not_divide_is_refused_naming_both() -> None:
    with pytest.raises(
        ConfigError, match=r"world size 5 is not a multiple of tp \* pp = 2 \* 1 = 2.*valid sizes: 2, 4"
    ):
        ParallelDims.of(5, tp=2)
    with pytest.raises(ConfigError, match="tp must be an integer >= 1, got 0"):
        ParallelDims.of(4, tp=0)
    with pytest.raises(ValueError, match="rank 4 is outside a world of 4"):
        ParallelDims.of(4, tp=2).coords(4)


def test_a_tp_group_spanning_two_nodes_is_refused() -> None:
    check_tp_within_nodes(["a", "a", "b", "b"], 2)
    with pytest.raises(ConfigError, match=r"ranks 2\.\.3 spans 2 nodes"):
        check_tp_within_nodes(["a", "a", "a", "b", "b", "b"], 2)


def _meta(fn):  # type: ignore[no-untyped-def]
    with torch.device("meta"):
        return fn()


def test_the_toy_gpt_plan_resolves_to_every_block_linear() -> None:
    plan = check_tp_plan(_meta(GPT), None, 2)
    assert plan["blocks.1.q"] == "colwise" and plan["blocks.0.out"] == "rowwise"
    assert len(plan) == 12  # 6 linears x 2 blocks; embeddings, norms and head stay whole


def test_plan_errors_name_the_pattern_the_module_and_the_numbers() -> None:
    gpt = _meta(GPT)
    with pytest.raises(ConfigError, match="needs a tensor-parallel plan for Sequential"):
        plan_of(_meta(mlp), None)
    with pytest.raises(ConfigError, match=r"'blocks\.\*\.nope' matches no module"):
        resolve_plan(gpt, {"blocks.*.nope": "colwise"}, 2)
    with pytest.raises(ConfigError, match="style must be one of colwise, rowwise, got 'diagonal'"):
        resolve_plan(gpt, {"blocks.*.q": "diagonal"}, 2)
    with pytest.raises(ConfigError, match=r"'blocks\.0\.ln1' is a LayerNorm"):
        resolve_plan(gpt, {"blocks.0.ln1": "colwise"}, 2)
    with pytest.raises(
        ConfigError, match=r"'blocks.0.q' is colwise but its output features \(32\) are not a multiple of tp = 3"
    ):
        resolve_plan(gpt, {"blocks.*.q": "colwise"}, 3)
    custom = check_tp_plan(gpt, lambda m: {"blocks.0.fc": "colwise", "blocks.0.out": "rowwise"}, 4)
    assert custom == {"blocks.0.fc": "colwise", "blocks.0.out": "rowwise"}
    assert isinstance(gpt, nn.Module)


def test_stage_bounds_balance_parameters_and_never_leave_a_stage_empty() -> None:
    assert stage_bounds([10, 0, 10, 0], 2) == [(0, 2), (2, 4)]  # parameter-less units stay with the unit before
    assert stage_bounds([1, 1, 1, 1, 100], 2) == [(0, 4), (4, 5)]
    assert stage_bounds([100, 1, 1, 1], 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ConfigError, match="pp = 3 needs at least 3 pipeline units with parameters, the model has 2"):
        stage_bounds([5, 0, 5], 3)


@given(counts=st.lists(st.integers(0, 50), min_size=1, max_size=12), stages=st.integers(1, 6))
def test_stage_bounds_cover_every_unit_once(counts: list[int], stages: int) -> None:
    if sum(1 for c in counts if c) < stages:
        return
    bounds = stage_bounds(counts, stages)
    assert len(bounds) == stages and bounds[0][0] == 0 and bounds[-1][1] == len(counts)
    assert all(a < b and b == c for (a, b), (c, _) in itertools.pairwise(bounds))
    assert all(sum(counts[a:b]) > 0 for a, b in bounds)


def test_keep_stage_keeps_names_and_replaces_the_other_units() -> None:
    model = _meta(lambda: block_mlp(8, 16, blocks=4))
    whole = {name for name, _ in model.named_parameters()}
    line = keep_stage(model, 1, 2)
    kept = {name for name, _ in model.named_parameters()}
    assert kept < whole and all(name.startswith(("1.2.", "1.3.", "2.")) for name in kept), kept
    assert line.startswith("pipeline stage 1 of 2: units 1.2..3")
    assert [name for name, _ in repeated_blocks(model)] == ["1.2", "1.3"]  # per-block FSDP units on a stage too
    assert resolve_plan(model, block_mlp_tp_plan(model), 2, stage=True) == {
        "1.2.up": "colwise",
        "1.3.up": "colwise",
        "1.2.down": "rowwise",
        "1.3.down": "rowwise",
    }
    mlp_stage = _meta(mlp)
    keep_stage(mlp_stage, 0, 2)  # "2" (the second linear layer) is an Identity here: its pattern matches nothing
    assert resolve_plan(mlp_stage, mlp_tp_plan(_meta(mlp)), 2, stage=True) == {"0": "colwise"}
    with pytest.raises(ConfigError, match=r"cuts nn\.Sequential models into stages, got GPT"):
        pipeline_units(_meta(GPT))


def test_model_inputs_are_what_loss_fn_passes_to_the_model() -> None:
    batch = {"x": torch.ones(3, 8), "y": torch.zeros(3)}
    assert model_inputs(squared_error, batch) is batch["x"]
    with pytest.raises(ConfigError, match="must call the model with one tensor"):
        model_inputs(lambda model, b: model(b["x"], b["y"]), batch)
    with pytest.raises(ConfigError, match="must call the model"):
        model_inputs(lambda model, b: b["y"], batch)
