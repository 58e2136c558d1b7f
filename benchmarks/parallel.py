"""python benchmarks/parallel.py [--quick]

What tensor and pipeline parallelism buy per worker, measured side by side with plain data parallelism.

How: 4 gloo processes (`raytrain.testing.multiprocess.run_world`, no Ray) train the same block model (an
`nn.Sequential`: in-projection, residual MLP blocks, head; AdamW in fp32) for a few optimizer steps of the same
global batch under six layouts of W = 4: dp 4 with ddp (the baseline), with zero2 and with zero3 (the sharded
data-parallel alternatives a user would weigh tp/pp against), tp 2 x dp 2, pp 2 x dp 2 and tp 2 x pp 2. Each
rank counts every tensor allocation with `raytrain.memory_tracker.LiveBytes` (DTensor shards, the by-hand gradient
all-reduce's buffers, pipeline activations, optimizer state) from before the model is built to the end of the last
step, and times each step. The table gives, per layout, the largest rank's peak bytes and its model state at rest
(parameters + gradients + AdamW state, from the live tensors), the parameters it holds, and the median step time.
Printed last, as one JSON line (ratios against dp 4 in the same run):

    state_ratio_<layout>     model state at rest on the largest rank / dp 4's (expect ~1/tp, ~1/pp, ~1/(tp pp);
                             zero2 shards the optimizer state and the gradients, zero3 the parameters too)
    peak_ratio_<layout>      peak bytes of the largest rank / dp 4's
    peak_ratio_<layout>_vs_zero3  the same against zero3 at dp 4: what tp/pp buy over sharding alone
    step_time_ratio_<layout> median step time / dp 4's (2 CPU cores for 4 processes: communication-bound)
    losses_equal             every layout's loss curve equals dp 4's (rel. 1e-4, the elastic tests' tolerance: fp32
                             sums in another order); max_loss_rel_diff gives the largest difference

Pipeline schedules: the same model cut into 4 stages (pp 4, dp 1), 8 micro-batches a step, under GPipe and 1F1B.
Per stage: the activation peak (LiveBytes' peak during a step's forwards and backwards, less the bytes still live
after them, i.e. the gradients: what the schedule holds in flight) and the bubble (seconds the stage was blocked
waiting for a neighbour / its step time, `raytrain.parallel.pipeline.PipelineStats`):

    activation_peak_ratio_1f1b   1F1B's largest stage activation peak / GPipe's (1F1B holds at most pp = 4 of the 8
                                 micro-batches on stage 0, GPipe all 8: expect about 4/8)
    bubble_gpipe, bubble_1f1b    the largest stage's idle fraction (the same schedule length in theory: (pp - 1) /
                                 (micro + pp - 1) of forward + backward time on each stage; on 2 cores for 4
                                 processes, waits also include the CPU the others hold)
    activation_peak_ratio_interleaved_1f1b, bubble_interleaved_1f1b  the same for interleaved 1F1B (2 chunks per
                                 stage: 8 virtual stages of one block each)
    schedule_losses_equal        all schedules train the same loss curve (rel. 1e-6)

Sequence parallel: transformers' Llama (tiny config, 4 layers, width 256, sequence 128; skipped without
transformers) at tp 4, one step of 8 sequences with and without `sequence_parallel`. Per rank, the activation
peak of the step's forward and backward (as above):

    activation_peak_ratio_sp     with / without sequence parallel on the largest rank (the residual stream and the
                                 norms hold T / 4 positions; attention and MLP activations are split by tp anyway)
    sp_losses_equal              both compute the same loss (rel. 1e-6)
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from _common import machine_line, print_headline, quiet_fsdp_warnings, table

from raytrain.batch_plan import plan_batch
from raytrain.memory_tracker import LiveBytes
from raytrain.model_init import record_build
from raytrain.optim import build_optimizer
from raytrain.parallel.apply import apply_parallelism, step_policy
from raytrain.parallel.dims import ParallelDims
from raytrain.parallel.pipeline import PipelineStats
from raytrain.parallel.tensor import resolve_plan
from raytrain.step import Step
from raytrain.testing.multiprocess import run_world
from raytrain.toy import adamw, block_mlp, block_mlp_tp_plan, squared_error
from raytrain.worker_loop import train_step

WORLD = 4
# name -> (tp, pp, data-parallel strategy)
LAYOUTS = {
    "dp4": (1, 1, "ddp"),
    "zero2": (1, 1, "zero2"),
    "zero3": (1, 1, "zero3"),
    "tp2": (2, 1, "ddp"),
    "pp2": (1, 2, "ddp"),
    "tp2pp2": (2, 2, "ddp"),
}
MODEL_PARALLEL = ("tp2", "pp2", "tp2pp2")
FEATURES, GLOBAL_BATCH, MICRO_BATCH = 32, 32, 4


def _local_bytes(tensors: list[torch.Tensor]) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def run_layout(rank: int, name: str, width: int, blocks: int, steps: int) -> dict[str, Any]:
    tp, pp, strategy = LAYOUTS[name]
    dims = ParallelDims.of(WORLD, tp=tp, pp=pp)
    coords = dims.coords(rank)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(GLOBAL_BATCH * steps, FEATURES, generator=generator)
    y = torch.tanh(x.sum(dim=1, keepdim=True)).squeeze(1)
    tracker = LiveBytes()
    times, losses = [], []
    with tracker:
        mesh = dims.build_mesh("cpu") if dims.model_parallel else None
        built = record_build(functools.partial(block_mlp, FEATURES, width, blocks))
        model = built.model
        plan = resolve_plan(model, block_mlp_tp_plan(model), tp) if tp > 1 else None
        model = apply_parallelism(
            model, strategy, torch.device("cpu"), dims, mesh=mesh, tp_plan=plan, stage=coords.pp, init=built.trace
        )
        optimizer = build_optimizer(model, adamw, 1e-3, strategy)
        policy = (
            step_policy(strategy, dims, "fp32", "unsharded", mesh, coords)
            if mesh is not None
            else step_policy(strategy, dims, "fp32", "unsharded")
        )
        batch_plan = plan_batch(GLOBAL_BATCH, MICRO_BATCH, dims.dp)
        for step in range(steps):
            start = step * GLOBAL_BATCH + batch_plan.rank_offset(coords.dp)
            micro = []
            for size in batch_plan.micro_batches[coords.dp]:
                micro.append({"x": x[start : start + size], "y": y[start : start + size]})
                start += size
            dist.barrier()
            began = time.perf_counter()
            result = train_step(model, optimizer, squared_error, micro, dims.dp, GLOBAL_BATCH, None, policy)
            times.append(time.perf_counter() - began)
            losses.append(result.loss_sum / GLOBAL_BATCH)
        params = [p for p in model.parameters()]
        grads = [p.grad for p in params if p.grad is not None]
        states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        state = _local_bytes(params) + _local_bytes(grads) + _local_bytes([s for s in states if s.dim() > 0])
        held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)
    del model, optimizer
    return {
        "peak": tracker.peak,
        "state": state,
        "params": held,
        "step_s": statistics.median(times[1:]),
        "losses": losses,
    }


SCHEDULE_MICRO_BATCHES = 8
SCHEDULE_ROWS = {64: 64, 512: 256}  # rows per micro-batch by model width (--quick, full)


SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def run_schedule(rank: int, schedule: str, width: int, blocks: int, steps: int) -> dict[str, Any]:
    """pp = WORLD stages, dp 1, `SCHEDULE_MICRO_BATCHES` micro-batches a step under `schedule` (interleaved: 2
    chunks per stage): this stage's activation peak (the most bytes the forwards and backwards held at once, less
    the gradients they leave), its waits and step times, and the losses."""
    chunks = 2 if schedule == "interleaved_1f1b" else 1
    dims = ParallelDims.of(WORLD, pp=WORLD)
    coords = dims.coords(rank)
    mesh = dims.build_mesh("cpu")
    rows = SCHEDULE_ROWS[width]  # per micro-batch: enough that activations, not parameters, fill a stage
    batch = rows * SCHEDULE_MICRO_BATCHES
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch * steps, FEATURES, generator=generator)
    y = torch.tanh(x.sum(dim=1, keepdim=True)).squeeze(1)
    built = record_build(functools.partial(block_mlp, FEATURES, width, blocks))
    model = apply_parallelism(
        built.model, "ddp", torch.device("cpu"), dims, mesh=mesh, stage=coords.pp, pp_chunks=chunks, init=built.trace
    )
    optimizer = build_optimizer(model, adamw, 1e-3, "ddp")
    stats = PipelineStats()
    policy = replace(
        step_policy("ddp", dims, "fp32", "unsharded", mesh, coords, pp_schedule=schedule, pp_chunks=chunks),
        pipeline_stats=stats,
    )
    losses, peaks = [], []
    for step in range(steps):
        start = step * batch
        micro = [{"x": x[s : s + rows], "y": y[s : s + rows]} for s in range(start, start + batch, rows)]
        dist.barrier()
        tracker = LiveBytes()
        with tracker:
            walk = Step(model, optimizer, micro, 1, batch, None, policy)
            walk.pipeline(squared_error)
            tracker.mark("walked")
        after, peak = tracker.marks["walked"]  # after the walk only the gradients it made are left
        peaks.append(peak - after)
        losses.append(walk.optimizer_step().loss_sum / batch)
    return {
        "activation_peak": max(peaks),
        "bubble": stats.wait_s / stats.step_s,
        "in_flight": stats.most_in_flight,
        "losses": losses,
    }


SP_SHAPES = {64: {"width": 64, "sequence": 32, "rows": 4}, 512: {"width": 256, "sequence": 128, "rows": 8}}


def run_sequence(rank: int, sequence_parallel: bool, shape: dict[str, int]) -> dict[str, Any]:
    """tp = WORLD, dp 1: one step of Llama (tiny config) of `shape` (`SP_SHAPES`, by the --quick or full block width)
    with or without sequence parallel; this rank's activation peak (the most bytes its forward and backward held
    at once, less the gradients they leave) and the loss. None of it without transformers."""
    try:
        import transformers
    except ImportError:
        return {}
    config = transformers.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=shape["width"],
        intermediate_size=2 * shape["width"],
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=256,
        max_position_embeddings=shape["sequence"],
    )
    dims = ParallelDims.of(WORLD, tp=WORLD)
    coords, mesh = dims.coords(rank), dims.build_mesh("cpu")
    built = record_build(functools.partial(transformers.LlamaForCausalLM, config))
    plan = {
        **{f"model.layers.*.self_attn.{n}_proj": "colwise" for n in "qkv"},
        "model.layers.*.self_attn.o_proj": "rowwise",
        **{f"model.layers.*.mlp.{n}_proj": "colwise" for n in ("gate", "up")},
        "model.layers.*.mlp.down_proj": "rowwise",
    }
    model = apply_parallelism(
        built.model,
        "ddp",
        torch.device("cpu"),
        dims,
        mesh=mesh,
        tp_plan=resolve_plan(built.model, plan, WORLD),
        sequence_parallel=sequence_parallel,
        init=built.trace,
    )
    optimizer = build_optimizer(model, adamw, 1e-3, "ddp")
    policy = step_policy("ddp", dims, "fp32", "unsharded", mesh, coords, sequence_parallel=sequence_parallel)
    tokens = torch.randint(0, 256, (shape["rows"], shape["sequence"] + 1), generator=torch.Generator().manual_seed(0))

    def loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(input_ids=batch["x"]).logits
        losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["y"].flatten(), reduction="none")
        return losses.view(batch["y"].shape).mean(dim=1)

    batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    dist.barrier()
    tracker = LiveBytes()
    with tracker:
        walk = Step(model, optimizer, [batch], 1, shape["rows"], None, policy)
        for micro in walk.micro_batches():
            walk.backward(loss(model, micro))
        tracker.mark("walked")
    after, peak = tracker.marks["walked"]
    return {"activation_peak": peak - after, "loss": walk.optimizer_step().loss_sum / shape["rows"]}


def rank_main(rank: int, world: int, width: int, blocks: int, steps: int) -> dict[str, dict[str, Any]]:
    quiet_fsdp_warnings()
    torch.manual_seed(0)
    results = {}
    for name in LAYOUTS:
        results[name] = run_layout(rank, name, width, blocks, steps)
        dist.barrier()
    for schedule in SCHEDULES:  # enough blocks for 2 chunks per stage
        results[f"schedule-{schedule}"] = run_schedule(rank, schedule, width, max(blocks, 2 * WORLD), steps)
        dist.barrier()
    for sequence_parallel in (False, True):
        results[f"sp-{sequence_parallel}"] = run_sequence(rank, sequence_parallel, SP_SHAPES[width])
        dist.barrier()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, 3 steps (a smoke run)")
    args = parser.parse_args()
    width, blocks, steps = (64, 4, 3) if args.quick else (512, 8, 8)
    began = time.perf_counter()
    per_rank = run_world(rank_main, WORLD, width, blocks, steps, preload=("torch", "raytrain.worker_loop"))
    total_params = sum(p.numel() for p in block_mlp(FEATURES, width, blocks).parameters())
    rows, worst = [], {}
    for name in LAYOUTS:
        ranks = [r[name] for r in per_rank]
        worst[name] = {
            "peak": max(r["peak"] for r in ranks),
            "state": max(r["state"] for r in ranks),
            "params": max(r["params"] for r in ranks),
            "step_s": max(r["step_s"] for r in ranks),
            "losses": ranks[0]["losses"],
        }
    base, zero3 = worst["dp4"], worst["zero3"]
    for name, w in worst.items():
        tp, pp, strategy = LAYOUTS[name]
        rows.append(
            [
                f"{name} ({strategy}, dp {WORLD // (tp * pp)}, tp {tp}, pp {pp})",
                f"{w['params']:,}",
                f"{w['state'] / 1e6:.2f}",
                f"{w['state'] / base['state']:.3f}",
                f"{w['peak'] / 1e6:.2f}",
                f"{w['peak'] / base['peak']:.3f}",
                f"{w['peak'] / zero3['peak']:.3f}",
                f"{w['step_s'] * 1000:.1f}",
                f"{w['step_s'] / base['step_s']:.2f}",
            ]
        )
    print(machine_line())
    print(
        f"W = {WORLD} gloo processes, block model of {total_params:,} fp32 parameters (width {width}, {blocks} "
        f"blocks), AdamW, global batch {GLOBAL_BATCH}, micro-batch {MICRO_BATCH}, {steps} steps; the largest rank"
    )
    headers = ["layout", "params held", "state MB", "vs dp4", "peak MB", "vs dp4", "vs zero3", "step ms", "vs dp4"]
    print(table(headers, rows))
    worst_diff = max(
        abs(a - b) / abs(b) for w in worst.values() for a, b in zip(w["losses"], base["losses"], strict=True)
    )
    result: dict[str, Any] = {
        "world": WORLD,
        "params": total_params,
        "losses_equal": worst_diff <= 1e-4,
        "max_loss_rel_diff": float(f"{worst_diff:.2g}"),
    }
    for name in ("zero2", "zero3", *MODEL_PARALLEL):
        result[f"state_ratio_{name}"] = round(worst[name]["state"] / base["state"], 3)
        result[f"peak_ratio_{name}"] = round(worst[name]["peak"] / base["peak"], 3)
        result[f"step_time_ratio_{name}"] = round(worst[name]["step_s"] / base["step_s"], 2)
    for name in MODEL_PARALLEL:
        result[f"peak_ratio_{name}_vs_zero3"] = round(worst[name]["peak"] / zero3["peak"], 3)
    schedules = {s: [r[f"schedule-{s}"] for r in per_rank] for s in SCHEDULES}
    print(
        f"pipeline schedules: pp {WORLD}, dp 1, {SCHEDULE_MICRO_BATCHES} micro-batches of {SCHEDULE_ROWS[width]} "
        f"rows a step, {max(blocks, 2 * WORLD)} blocks; per stage: activation peak MB (the most bytes the forwards "
        "and backwards held at once, less the gradients they leave), most micro-batches in flight (interleaved: "
        "micro-batch chunks, each half a stage), bubble (waiting / step time)"
    )
    schedule_rows = [
        [s, *(f"{r['activation_peak'] / 1e6:.2f} / {r['in_flight']} / {r['bubble']:.2f}" for r in ranks)]
        for s, ranks in schedules.items()
    ]
    print(table(["schedule", *(f"stage {stage}" for stage in range(WORLD))], schedule_rows))
    gpipe_peak = max(r["activation_peak"] for r in schedules["gpipe"])
    for s in SCHEDULES[1:]:
        result[f"activation_peak_ratio_{s}"] = round(max(r["activation_peak"] for r in schedules[s]) / gpipe_peak, 3)
    for s, ranks in schedules.items():
        result[f"bubble_{s}"] = round(max(r["bubble"] for r in ranks), 3)
    gpipe_losses = schedules["gpipe"][-1]["losses"]
    result["schedule_losses_equal"] = all(
        abs(a - b) <= 1e-6 * abs(b)
        for s in SCHEDULES[1:]
        for a, b in zip(schedules[s][-1]["losses"], gpipe_losses, strict=True)
    )
    plain, split = ([r[f"sp-{on}"] for r in per_rank] for on in (False, True))
    shape = SP_SHAPES[width]
    if plain[0]:
        print(
            f"sequence parallel: Llama (4 layers, width {shape['width']}), tp {WORLD}, {shape['rows']} sequences "
            f"of {shape['sequence']}; activation peak MB per rank without / with: "
            + ", ".join(
                f"{a['activation_peak'] / 1e6:.2f} / {b['activation_peak'] / 1e6:.2f}"
                for a, b in zip(plain, split, strict=True)
            )
        )
        worst = max(r["activation_peak"] for r in plain)
        result["activation_peak_ratio_sp"] = round(max(r["activation_peak"] for r in split) / worst, 3)
        result["sp_losses_equal"] = abs(split[0]["loss"] - plain[0]["loss"]) <= 1e-6 * abs(plain[0]["loss"])
    print(f"wall time {time.perf_counter() - began:.1f} s")
    print_headline(result)


if __name__ == "__main__":
    main()
