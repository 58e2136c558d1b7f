"""tp/pp "auto" (`raytrain.parallel.layout`): the planner's choice applied on the driver, the config rules around
it, and the one driver-side check of a tp x pp layout. No Ray, no process group."""

from __future__ import annotations

import dataclasses

import pytest
from torch import nn
from user_models import DropoutDecoder

from raytrain.config import (
    BatchConfig,
    CheckpointConfig,
    ClusterConfig,
    LoopConfig,
    LRConfig,
    ParallelConfig,
    TrainSpec,
)
from raytrain.errors import ConfigError
from raytrain.memory_plan import GB
from raytrain.parallel.layout import check_model_parallel, choose_layout, resolve_parallel
from raytrain.toy import GPT, block_mlp, block_mlp_tp_plan, mlp

# Ψ = 1e9 parameters at 16 bytes each (fp32 parameters and gradients, Adam's two moments), largest unit 2.5e8, on
# 8 workers: ddp 16 GB, zero1 9 GB, zero2 5.5 GB, zero3 2 GB + a 2 GB gathered working set; tp=4: 8Ψ/4 + 8Ψ/8 = 3 GB;
# tp=4,pp=2: 8Ψ/8 + 8Ψ/8 = 2 GB. The budget is 80 % of the device.
BILLION = dict(num_params=10**9, largest_unit=250_000_000)


@pytest.mark.parametrize(
    ("memory_gb", "per_node", "expected"),
    [
        (20.1, 8, (1, 1)),  # ddp fits 16.08 GB
        (5.0, 8, (1, 1)),  # zero3 with its working set: 4 GB <= 4 GB
        (4.5, 8, (4, 1)),  # zero3 needs 4 GB > 3.6; tp=2 needs 5 GB; tp=4 needs 3 GB
        (4.5, 4, (4, 1)),
        (3.0, 4, (4, 2)),  # budget 2.4 GB: tp=4 (3 GB) does not fit, 4 x 2 stages (2 GB) does
    ],
)
def test_auto_applies_the_planners_layout(memory_gb: float, per_node: int, expected: tuple[int, int]) -> None:
    tp, pp, reason = choose_layout(
        **BILLION, min_workers=8, workers_per_node=per_node, device_memory_bytes=int(memory_gb * GB)
    )
    assert (tp, pp) == expected
    assert reason.startswith(f"layout auto -> tp {tp}, pp {pp} on 8 workers of {memory_gb:.3g} GB, {per_node} per node")
    assert ("counted with zero2 on the dp axis" in reason) == (tp * pp > 1)


def test_auto_plans_for_the_smallest_world_and_whole_nodes() -> None:
    # at 2 workers (min_workers) zero3 shards half as far: 8 GB + 2 GB > 3.6 GB; TP may only be 2 (gcd(2, 8)) and
    # tp=2 needs 8Ψ/2 + 8Ψ/2 = 8 GB: nothing fits, and the error says so with the planner's reason
    with pytest.raises(ConfigError, match=r"fits no layout on 2 workers of 4\.5 GB, 2 per node: nothing fits"):
        choose_layout(**BILLION, min_workers=2, workers_per_node=8, device_memory_bytes=int(4.5 * GB))


def test_auto_needs_both_degrees_and_the_device_facts() -> None:
    with pytest.raises(ConfigError, match=r"set both to 'auto' or both to integers, got tp='auto', pp=1"):
        ParallelConfig(tp="auto", device_memory_gb=80, workers_per_node=8)
    with pytest.raises(ConfigError, match=r"set device_memory_gb"):
        ParallelConfig(tp="auto", pp="auto", workers_per_node=8)
    with pytest.raises(ConfigError, match=r"set workers_per_node"):
        ParallelConfig(tp="auto", pp="auto", device_memory_gb=80)
    with pytest.raises(ConfigError, match=r"tp must be an integer >= 1 or 'auto', got 'max'"):
        ParallelConfig(tp="max", pp="auto")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"device_memory_gb must be a number > 0 or None, got -1"):
        ParallelConfig(device_memory_gb=-1)
    unresolved = ParallelConfig(tp="auto", pp="auto", device_memory_gb=80, workers_per_node=8)
    with pytest.raises(ConfigError, match=r"TrainSpec takes a resolved layout"):
        TrainSpec(
            batch=BatchConfig(global_batch=8, micro_batch=4),
            lr=LRConfig(base_lr=0.1),
            loop=LoopConfig(),
            checkpoint=CheckpointConfig(),
            cluster=ClusterConfig(),
            parallel=unresolved,
        )


def test_resolve_counts_the_users_model_on_the_meta_device() -> None:
    # the toy MLP 16 -> 64 -> 1: 1,153 parameters, largest FSDP unit 1,088, 18,448 bytes under ddp; on 2 workers
    # zero2 needs 11,536 bytes and zero3 17,936 (with its working set); tp=2 needs 9,232. A 12,000-byte device
    # (budget 9,600) therefore runs tp 2; a roomy one runs tp 1.
    cluster = ClusterConfig(min_workers=2, max_workers=4)
    tight = ParallelConfig(tp="auto", pp="auto", device_memory_gb=12_000 / GB, workers_per_node=2)
    resolved, reason = resolve_parallel(tight, cluster, lambda: mlp(features=16, hidden=64))
    assert (resolved.tp, resolved.pp) == (2, 1) and resolved.device_memory_gb == tight.device_memory_gb
    assert "layout auto -> tp 2, pp 1" in reason
    roomy = ParallelConfig(tp="auto", pp="auto", device_memory_gb=1.0, workers_per_node=2)
    assert resolve_parallel(roomy, cluster, lambda: mlp(features=16, hidden=64))[0].degrees == (1, 1)
    given = ParallelConfig(tp=2)
    assert resolve_parallel(given, cluster, lambda: mlp(features=16, hidden=64)) == (given, "")
    # a schedule and sequence parallel asked for with "auto": what the chosen layout has no use for is left off
    wishes = {"pp_schedule": "interleaved_1f1b", "pp_chunks": 2, "sequence_parallel": True}
    resolved, reason = resolve_parallel(
        dataclasses.replace(roomy, **wishes), cluster, lambda: mlp(features=16, hidden=64)
    )
    assert (resolved.degrees, resolved.pp_schedule, resolved.chunks, resolved.sequence_parallel) == (
        (1, 1),
        "gpipe",
        1,
        False,
    )
    assert reason.endswith("; unused at tp 1, pp 1, so left off: pp_schedule 'interleaved_1f1b', sequence_parallel")
    resolved, reason = resolve_parallel(
        dataclasses.replace(tight, **wishes), cluster, lambda: mlp(features=16, hidden=64)
    )
    assert (resolved.degrees, resolved.pp_schedule, resolved.sequence_parallel) == ((2, 1), "gpipe", True)
    assert reason.endswith("so left off: pp_schedule 'interleaved_1f1b'")


def test_one_driver_check_names_the_layout_or_the_problem() -> None:
    assert check_model_parallel(block_mlp, 1, 1) == []
    # units: in 288, four blocks of 4,256 (LayerNorm 64, up 2,112, down 2,080), head 33, Flatten 0
    lines = check_model_parallel(block_mlp, 1, 2, pp_schedule="1f1b")
    assert lines == [
        "pipeline parallel: 7 units in 2 stages of 8,800, 8,545 parameters (balanced by parameters; 1f1b over the "
        "accumulation micro-batches)"
    ]
    assert check_model_parallel(GPT, 2, 1)[0] == "tensor parallel: 12 linear layers split over tp = 2 workers of a node"
    assert check_model_parallel(GPT, 1, 2)[0].startswith("pipeline parallel: 2 units in 2 stages")  # its split
    with pytest.raises(ConfigError, match=r"pipeline parallel \(pp > 1\) cannot split Transformer"):
        check_model_parallel(lambda: nn.Transformer(16, 2, 1, 1, 32), 1, 2)
    with pytest.raises(ConfigError, match=r"tp > 1 needs a tensor-parallel plan for Sequential"):
        check_model_parallel(mlp, 2, 1)
    # interleaved: the two stages' chunks summed per worker
    assert check_model_parallel(lambda: GPT(blocks=4), 1, 2, pp_schedule="interleaved_1f1b", pp_chunks=2)[0].startswith(
        "pipeline parallel: 4 units in 2 stages (2 chunks each) of "
    )
    # sequence parallel gathers the input of the modules holding the colwise layers: the toy GPT computes its
    # attention in the block's own forward, which would see T / tp positions
    with pytest.raises(ConfigError, match=r"'blocks\.0\.q' sits directly in 'blocks\.0'"):
        check_model_parallel(GPT, 2, 1, sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"sequence parallel needs the block list of Sequential"):
        check_model_parallel(block_mlp, 2, 1, tp_plan_fn=block_mlp_tp_plan, sequence_parallel=True)
    assert check_model_parallel(DropoutDecoder, 2, 1, sequence_parallel=True)[1] == (
        "sequence parallel: the blocks blocks hold 1/2 of the positions between the split layers; 4 modules gather "
        "their input (blocks.0.attn, blocks.0.mlp, ...)"
    )
    with pytest.raises(ConfigError, match="sequence_parallel cuts the activations over the tp ranks: it needs tp > 1"):
        ParallelConfig(sequence_parallel=True)


def _strategy_with_memory(rank: int, world: int, memory: int, stages: int) -> str:
    from unittest import mock

    import torch

    from raytrain.parallel import strategy

    with mock.patch.object(strategy, "device_memory_bytes", return_value=memory):  # the memory a worker reports
        try:
            return strategy.resolve_layout(
                "auto",
                "unsharded",
                block_mlp(),  # 17,345 parameters; the heavier of 2 stages holds 8,800
                world_size=1,
                accumulation_steps=1,
                precision="fp32",
                device=torch.device("cpu"),
                stages=stages,
            ).strategy
        except ConfigError as err:
            return f"refused: {err}"


def test_strategy_auto_on_the_workers_counts_the_heaviest_pipeline_stage() -> None:
    from raytrain.testing.multiprocess import run_world

    # at dp = 1 every strategy holds 16 bytes per parameter counted: the whole model 277,520 bytes, the heavier
    # stage 140,800. A worker of 200,000 bytes (budget 160,000) holds the stage, not the whole model.
    whole, stage = (run_world(_strategy_with_memory, 1, 200_000, stages)[0] for stages in (1, 2))
    assert whole.startswith("refused: strategy 'auto': the model (17,345 parameters) does not fit") and stage == "ddp"
