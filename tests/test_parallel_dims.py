"""Pure layout math: `ParallelDims` (dp from W, tp, pp; rank <-> coordinates, TP innermost), the check that a TP
group stays on one node, and the tensor-parallel plan's checks on a meta model. No process group needed."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from user_models import NanoGPT, gpt2, llama

from raytrain.errors import ConfigError
from raytrain.parallel.apply import repeated_blocks
from raytrain.parallel.dims import Coords, ParallelDims, check_tp_within_nodes
from raytrain.parallel.pipeline import (
    SCHEDULES,
    chain_stages,
    cut_stages,
    keep_stage,
    pipeline_units,
    schedule_order,
    sent_messages,
    split_of,
    stage_bounds,
    stage_models,
    stage_ties,
)
from raytrain.parallel.tensor import check_tp_plan, plan_of, resolve_plan
from raytrain.toy import GPT, block_mlp, block_mlp_tp_plan, mlp, mlp_tp_plan, next_token_loss


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
    need = r"3 pipeline stages \(pp x pp_chunks\) need at least 3 pipeline units with parameters, the model has 2"
    with pytest.raises(ConfigError, match=need):
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


def _hf_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return next_token_loss(lambda tokens: model(input_ids=tokens).logits, batch)  # type: ignore[arg-type]


SPLIT_MODELS = {  # builder, loss, where the split comes from, the blocks (4 each)
    "toy GPT": (lambda: GPT(tie_embeddings=True, blocks=4), next_token_loss, "GPT.pipeline_split()", "blocks"),
    "Llama": (lambda: llama(layers=4), _hf_loss, "LlamaForCausalLM's base_model_pp_plan", "model.layers"),
    "GPT-2": (lambda: gpt2(layers=4), _hf_loss, "the GPT-2 split", "transformer.h"),
}


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("family", SPLIT_MODELS)
def test_a_decoder_is_split_between_its_blocks_and_its_stages_chain_to_the_whole_models_losses(
    family: str, chunks: int
) -> None:
    """The split of a model that is not an nn.Sequential: embeddings with the first block, norm and head with the
    last; each stage keeps its parameters under their names in the whole model; the stages run one after another
    (each its own forward, fed the previous stage's output at its first block) give the whole model's losses. In
    2 chunks (the interleaved schedule) stage 0 holds blocks 0 and 2, stage 1 blocks 1 and 3, and each chunk's
    forward runs only its own blocks."""
    build, loss, source, blocks = SPLIT_MODELS[family]
    split = split_of(_meta(build))
    assert split is not None and split.source == source and split.blocks == blocks
    torch.manual_seed(0)
    whole = build().to(torch.float64).eval()
    names = {name for name, _ in whole.named_parameters(remove_duplicate=False)}
    stages = stage_models(lambda: copy.deepcopy(whole), 2, chunks)
    kept = [{name for name, _ in stage.named_parameters(remove_duplicate=False)} for stage in stages]
    assert kept[0] | kept[1] == names and all(k < names for k in kept)
    held = [{int(name[len(blocks) + 1 :].split(".")[0]) for name in k if name.startswith(blocks)} for k in kept]
    assert 0 in held[0] and 3 in held[1]
    if chunks == 2:  # four virtual stages of one block each, dealt round-robin
        assert held == [{0, 2}, {1, 3}]
    assert len(stage_ties(whole, 2, chunks)) == 1  # the embedding tied to the head: one copy on each end stage
    x = torch.randint(0, 16, (3, 8))
    batch = {"x": x, "y": torch.roll(x, -1, dims=1)}
    calls: list[int] = []
    for stage in stages:
        for block in stage.get_submodule(blocks).children():
            block.register_forward_pre_hook(lambda module, args: calls.append(id(module)))
    with torch.no_grad():
        assert torch.equal(chain_stages(stages, loss, batch), loss(whole, batch))
    assert len(calls) == 4  # each block ran once: a chunk's forward skips the stage's other chunk


def test_a_model_raytrain_cannot_split_is_refused_naming_what_is_missing() -> None:
    with pytest.raises(ConfigError, match=r"cannot split NanoGPT: .* define NanoGPT\.pipeline_split\(\)"):
        pipeline_units(_meta(NanoGPT))

    class Split(NanoGPT):
        def __init__(self, spec: dict[str, object]) -> None:
            super().__init__()
            self.spec = spec

        def pipeline_split(self) -> dict[str, object]:
            return self.spec

    full = {"blocks": "h", "first": ["wte", "wpe"], "last": ["ln_f", "lm_head"]}
    with pytest.raises(ConfigError, match=r"the blocks must be modules the forward calls.* h\.0 is a ModuleDict"):
        pipeline_units(Split(full))
    with pytest.raises(ConfigError, match=r"names 'ln_final', which Split does not have"):
        pipeline_units(Split({**full, "last": ["ln_final", "lm_head"]}))
    gpt = GPT(blocks=3)

    def split(first: list[str], **extra: object) -> None:
        spec = {"blocks": "blocks", "first": first, "last": ["norm", "head"], **extra}
        gpt.pipeline_split = lambda: spec  # type: ignore[method-assign]

    split(["token"])
    with pytest.raises(ConfigError, match=r"parameter 'position.weight' lies in none of blocks"):
        pipeline_units(gpt)
    split(["token", "position"], starts=[2])
    assert cut_stages(gpt, 2).bounds == [(0, 2), (2, 3)]  # a user-given cut: stage 1 starts at block 2
    split(["token", "position"], starts=[3])
    with pytest.raises(ConfigError, match=r"starts must be 1 increasing block indices in 1\.\.2 .* got \[3\]"):
        cut_stages(gpt, 2)


def _simulate(schedule: str, stages: int, micro: int, chunks: int = 1) -> int:
    """Every stage runs `schedule_order` one operation per tick. A forward of virtual stage v needs v - 1's output,
    a backward v + 1's input gradient, each sent over the channel from the stage holding it (a stage's receives
    take a message once it is sent, keeping the ones sent before it: `pipeline_step`'s inbox). Returns the ticks
    to the end; fails on a deadlock (no stage can move). The messages each channel carried, in order, must be
    those `sent_messages` gives (what the receiving stage expects)."""
    orders = [schedule_order(schedule, stage, stages, micro, chunks) for stage in range(stages)]
    carried: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    arrived: set[tuple[str, int, int]] = set()
    virtual, position, ticks = stages * chunks, [0] * stages, 0
    while any(p < len(o) for p, o in zip(position, orders, strict=True)):
        moves = []
        for stage, order in enumerate(orders):
            if position[stage] < len(order):
                kind, j, c = order[position[stage]]
                v = stage + c * stages
                source = v - 1 if kind == "F" else v + 1
                if not 0 <= source < virtual or (kind, source, j) in arrived:
                    moves.append((stage, kind, j, v))
        assert moves, f"{schedule} deadlocks at {position}"
        for stage, kind, j, v in moves:  # what one tick sends arrives for the next
            target = v + 1 if kind == "F" else v - 1
            if 0 <= target < virtual:
                carried.setdefault((stage, target % stages), []).append((kind, v, j))
                arrived.add((kind, v, j))
            position[stage] += 1
        ticks += 1
    for src in range(stages):
        for dst in range(stages):
            assert carried.get((src, dst), []) == sent_messages(orders, stages, chunks, src, dst)
    return ticks


def _in_flight(order: list[tuple[str, int, int]]) -> int:
    """The most micro-batch chunks whose forward ran and backward did not yet (activations held); fails on a
    backward before its forward."""
    held: set[tuple[int, int]] = set()
    most = 0
    for kind, j, c in order:
        if kind == "F":
            held.add((j, c))
        else:
            assert (j, c) in held, f"backward of {j} (chunk {c}) before its forward"
            held.remove((j, c))
        most = max(most, len(held))
    return most


@given(stages=st.integers(1, 6), micro=st.integers(1, 12), chunks=st.integers(2, 4))
def test_schedules_run_every_micro_batch_once_without_deadlock_and_hold_what_they_promise(
    stages: int, micro: int, chunks: int
) -> None:
    for schedule in SCHEDULES:
        per_stage = chunks if schedule == "interleaved_1f1b" else 1
        for stage in range(stages):
            order = schedule_order(schedule, stage, stages, micro, per_stage)
            every = [(kind, j, c) for kind in "FB" for j in range(micro) for c in range(per_stage)]
            assert sorted(order) == sorted(every)
            most = _in_flight(order)
            if schedule == "gpipe":
                assert most == micro
            elif schedule == "1f1b":
                assert most == min(micro, stages - stage)
            else:  # the warm-up forwards, and the one forward before each backward
                rounds = max(1, micro // stages)
                warmup = 2 * (stages - stage - 1) + (chunks - 1) * (micro // rounds + (micro % rounds > 0))
                assert most == min(warmup + 1, micro * chunks)
    # GPipe and 1F1B: the same bubble, 2 (micro + stages - 1) ticks of one forward or backward each
    assert _simulate("gpipe", stages, micro) == _simulate("1f1b", stages, micro) == 2 * (micro + stages - 1)
    # interleaved: a tick is one chunk (1 / chunks of a stage); with micro >= stages the bubble is smaller
    ticks = _simulate("interleaved_1f1b", stages, micro, chunks)
    if stages > 1 and micro >= stages and micro % stages == 0:
        assert ticks / chunks < 2 * (micro + stages - 1)
    with pytest.raises(ValueError, match="pipeline schedule must be one of gpipe, 1f1b, interleaved_1f1b, got 'zb'"):
        schedule_order("zb", 0, stages, micro)
    with pytest.raises(ValueError, match="the interleaved_1f1b schedule runs >= 2 chunks per stage, got 1"):
        schedule_order("interleaved_1f1b", 0, stages, micro, 1)


def test_the_driver_chains_the_stages_and_refuses_a_split_that_computes_other_losses() -> None:
    """`check_pipeline` runs real rows through the stages one after another and compares with the whole model: a
    split that puts the final norm before the blocks cuts without complaint but computes another function."""
    from raytrain.preflight import check_pipeline

    sample = {"x": np.arange(24, dtype=np.int64).reshape(3, 8) % 16, "y": np.ones((3, 8), dtype=np.int64)}

    def build(first: list[str], last: list[str]) -> nn.Module:
        torch.manual_seed(0)
        gpt = GPT(blocks=2)
        gpt.pipeline_split = lambda: {"blocks": "blocks", "first": first, "last": last}  # type: ignore[method-assign]
        return gpt

    def right() -> nn.Module:
        return build(["token", "position"], ["norm", "head"])

    line = check_pipeline(right, next_token_loss, sample, 2, right)
    assert line.startswith("pipeline check: 2 stages chained on 3 samples give the whole model's losses")

    def wrong() -> nn.Module:
        return build(["token", "position", "norm"], ["head"])

    with pytest.raises(ConfigError, match=r"compute other losses than the whole model \(max difference"):
        check_pipeline(wrong, next_token_loss, sample, 2, wrong)
