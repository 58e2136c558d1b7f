"""python benchmarks/memory.py [--quick]

Per-rank memory of raytrain's loop, measured with a tracker of real allocations, against the planner.

How: W gloo processes (torch.multiprocessing, no Ray) each count every tensor allocation from before the model is
built to the end of the second optimizer step with `raytrain.memory_tracker.LiveBytes` (a TorchDispatchMode that
sees allocations from Python and C++ alike: DDP's gradient buckets, FSDP2's all-gather buffers, unsharded gradients,
optimizer states, activations). The model is a small transformer-shaped stack (embedding, 8 repeated MLP blocks,
head: 2.2 M fp32 parameters, AdamW) built the way the loop builds it: on the meta device, sharded with raytrain's
`apply_parallelism` (one FSDP unit per block), then each rank's shard initialised. Activations are kept small
(micro-batches of 2 rows) so the peak is model state, which is what the planner accounts.

For ddp, zero1, zero2, zero3 at W = 2 and 4, accumulation k = 1 and 4, and for zero2/zero3 both gradient
accumulation modes ("unsharded": the whole gradient held while accumulating, synced once; "sharded":
reduce-scattered after every micro-step), the table gives the measured peak of the worst rank and the planner's
figure, `raytrain.memory_plan.loop_memory`, which counts the gathered working set (zero2: every unit; zero3: two
units) and the accumulated gradients. Printed last, as one JSON line:

    planner_counts        what the planner accounts: model state; activations are excluded (and kept small here)
    worst_planner_error   max |measured - planned| / planned over every row of the stack (goal <= 0.10)
    worst_planner_error_out_of_sample
                          the same over torch's nn.TransformerEncoder, a model the planner was not written against
                          (ddp, zero2, zero3; k = 1 and 4), fp32 (goal <= 0.10)
    worst_planner_error_bf16
                          the same model in bf16 (autocast for ddp, FSDP2 mixed precision for zero2/zero3)
    init_peak_fraction    peak bytes per rank while building, sharding and initialising the model at zero3, W = 4,
                          divided by the full model's parameter bytes (goal: near 1/W + largest module / model;
                          the old path, building the whole model on every rank first, is measured beside it)
    budget_check          the transformer's full training state (params + grads + AdamW) is 16 bytes per
                          parameter; with a per-worker budget of half of that, zero3 at W = 4 must fit it
    auto_fits             for every (W, k), the layout `strategy="auto"` picks for that budget fits it when measured
    loss_matches_w1       the zero3 W = 4 loss curve equals the single-process run's (rel. 1e-5)
    pretrained_load_peak_fraction
                          pretrained weights (`init_from`, a safetensors file of a 12-layer 2048-wide stack, 201 MB)
                          loaded at zero3, W = 4: the largest rank's resident-memory growth (RSS high-water mark,
                          read buffers included) from before the model is built (FakeTensorMode's modules already
                          imported: a fixed ~30 MB, not the load's) to after it is loaded, divided by
                          the model's bytes (goal <= 0.5; a rank's shard is 0.25); `_full_build` loads the same file
                          into a model built whole on every rank first (>= 1 by construction of that path)
    export_peak_fraction  `raytrain.export` of a zero3 W = 2 checkpoint of a model of 24 tensors (12 Linear layers,
                          2048 wide: 201 MB; each weight a chunk per rank): the resident-memory growth (high-water
                          mark) of the exporting process ÷ the model's bytes (goal <= 0.25; one weight is 0.083 of
                          the model: the export holds about one chunk of it at a time, read and decoded)
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch
import torch.distributed as dist
from _common import machine_line, print_headline, quiet_fsdp_warnings, table
from torch import nn

from raytrain.errors import ConfigError
from raytrain.memory_plan import loop_memory
from raytrain.memory_tracker import LiveBytes
from raytrain.model_init import record_build
from raytrain.optim import build_optimizer
from raytrain.parallel.apply import apply_parallelism, fsdp_units, step_policy
from raytrain.parallel.strategy import choose_layout, unit_params
from raytrain.testing.multiprocess import run_world
from raytrain.worker_loop import train_step

WIDTH, BLOCKS, VOCAB = 128, 8, 512
MICRO_BATCH = 2
STEPS = 2
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
TRANSFORMER_LAYERS = 4


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Stack(nn.Module):
    """Embedding, `BLOCKS` repeated blocks, a head: the shape of a small transformer without attention."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class TorchTransformer(nn.Module):
    """A classifier on torch's own `nn.TransformerEncoder` (attention, its own layer and init code): a model the
    planner was not written against, to check it out of sample."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, nhead=4, dim_feedforward=4 * WIDTH, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=TRANSFORMER_LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


MODELS: dict[str, type[nn.Module]] = {"stack": Stack, "torch-transformer": TorchTransformer}
SEQ = {"stack": 0, "torch-transformer": 8}  # tokens per sample (0: one token, the stack's input)


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["x"])
    return nn.functional.cross_entropy(logits, batch["y"], reduction="none")


def adamw(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, foreach=False)  # foreach would add a temporary per tensor list


def configs(worlds: list[int], quick: bool = False) -> list[dict[str, Any]]:
    """Every row to measure: the stack (in sample) under each strategy and gradient mode in fp32, and torch's
    transformer (out of sample) under ddp, zero2 and zero3 in fp32 and bf16 (at k = 4 only with `quick`)."""
    rows = []
    for world in worlds:
        for k in (1, 4):
            for strategy in STRATEGIES:
                modes = ("unsharded", "sharded") if strategy in ("zero2", "zero3") and k > 1 else ("unsharded",)
                rows += [
                    {"model": "stack", "precision": "fp32", "world": world, "k": k, "strategy": strategy, "mode": m}
                    for m in modes
                ]
        for precision in ("fp32", "bf16"):
            for k in (4,) if quick else (1, 4):
                for strategy in ("ddp", "zero2", "zero3"):
                    mode = "sharded" if strategy != "ddp" and k > 1 else "unsharded"
                    config = {"world": world, "k": k, "strategy": strategy, "mode": mode}
                    rows.append({"model": "torch-transformer", "precision": precision, **config})
    return rows


def batches(rank: int, world: int, k: int, step: int, seq: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1000 * step + 10 * rank + k)
    out = []
    for _ in range(k):
        x = torch.randint(0, VOCAB, (MICRO_BATCH, seq) if seq else (MICRO_BATCH,), generator=generator)
        out.append({"x": x, "y": torch.randint(0, VOCAB, (MICRO_BATCH,), generator=generator)})
    return out


def run_config(config: dict[str, Any], rank: int, full_init: bool = False) -> dict[str, Any]:
    world, k, strategy = config["world"], config["k"], config["strategy"]
    model_class, precision, seq = MODELS[config["model"]], config["precision"], SEQ[config["model"]]
    tracker = LiveBytes()
    losses = []
    with tracker:
        trace = None
        if full_init:  # the full build: the whole model on every rank, then sharded
            torch.manual_seed(0)
            model = model_class()
        else:  # the sharded build: recorded on meta, each rank replays its shard
            built = record_build(model_class)
            model, trace = built.model, built.trace
        model = apply_parallelism(model, strategy, torch.device("cpu"), world, init=trace, seed=0, precision=precision)
        tracker.mark("init")
        optimizer = build_optimizer(model, adamw, 1e-3, strategy)
        policy = step_policy(strategy, world, precision, config["mode"])
        for step in range(STEPS):
            micro = batches(rank, world, k, step, seq)
            result = train_step(model, optimizer, loss_fn, micro, world, world * k * MICRO_BATCH, None, policy)
            losses.append(result.loss_sum)  # summed over every rank's samples
        tracker.mark("steps")
    del model, optimizer
    return {"init_peak": tracker.marks["init"][1], "peak": tracker.peak, "losses": losses}


def rank_main(rank: int, world: int, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    quiet_fsdp_warnings()
    results = []
    for config in rows:
        if config["world"] != world:
            continue
        results.append({**config, **run_config(config, rank)})
        dist.barrier()
    if world == max(r["world"] for r in rows):
        config = {"model": "stack", "precision": "fp32", "world": world, "k": 1, "strategy": "zero3"}
        old = run_config({**config, "mode": "unsharded"}, rank, full_init=True)
        results.append({**config, "mode": "full-init", **old})
    return results


LOAD_WIDTH, LOAD_LAYERS = 2048, 12  # the pretrained-load model: 50.4 M fp32 parameters, 201 MB


def load_model(width: int = LOAD_WIDTH, layers: int = LOAD_LAYERS) -> nn.Module:
    """A stack of linear layers, each its own FSDP unit (`units_fn` below): the model of the load measurement."""
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _max_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def load_rank(rank: int, world: int, path: str, width: int, layers: int, sharded: bool) -> dict[str, int]:
    """One rank's resident-memory growth while building the model and loading `path` at zero3."""
    import functools

    from raytrain.pretrained import open_pretrained

    pretrained = open_pretrained(path)
    record_build(lambda: nn.Linear(2, 2))  # imports FakeTensorMode's modules first: a fixed cost, not the load's
    before = _rss_bytes()
    assert _max_rss_bytes() <= before + 32 * 2**20, "the high-water mark is above the start: measure in a new process"
    build = functools.partial(load_model, width, layers)
    if sharded:
        built = record_build(build)
        model, trace = built.model, built.trace
    else:
        model, trace = build(), None
    model = apply_parallelism(model, "zero3", torch.device("cpu"), world, init=trace, pretrained=pretrained)
    return {"growth": _max_rss_bytes() - before, "bytes_read": pretrained.bytes_read, "model": pretrained.nbytes}


def measure_pretrained_load(world: int, quick: bool) -> dict[str, float]:
    """Write the load model's weights as safetensors, load them at zero3 on `world` ranks, sharded and full."""
    import tempfile

    from safetensors.torch import save_file

    width, layers = (1024, 6) if quick else (LOAD_WIDTH, LOAD_LAYERS)
    with tempfile.TemporaryDirectory(prefix="raytrain-bench-pretrained-") as directory:
        path = f"{directory}/model.safetensors"
        save_file(dict(load_model(width, layers).state_dict()), path)
        results = {}
        for sharded in (True, False):
            ranks = run_world(load_rank, world, path, width, layers, sharded, preload=["torch", "raytrain"])
            worst = max(r["growth"] for r in ranks)
            results["sharded" if sharded else "full"] = worst / ranks[0]["model"]
            if sharded:
                results["read_fraction"] = max(r["bytes_read"] for r in ranks) / ranks[0]["model"]
        model_mb = ranks[0]["model"] / 1e6
    print(
        f"\npretrained load at zero3 W={world} ({model_mb:.0f} MB of weights): largest rank's RSS growth "
        f"{results['sharded']:.3f} of the model with the sharded build (bytes read {results['read_fraction']:.3f}), "
        f"{results['full']:.3f} with the full build"
    )
    return results


def save_rank(rank: int, world: int, width: int, layers: int) -> str:
    """This rank's directory of a zero3 checkpoint of the load model, with the record an export reads."""
    from raytrain.checkpoint import TrainState, save_checkpoint
    from raytrain.data.id_ranges import IdRanges
    from raytrain.model_record import model_record

    torch.manual_seed(0)
    model = load_model(width, layers)
    record = model_record(model)
    model = apply_parallelism(model, "zero3", torch.device("cpu"), world, units_fn=list)
    optimizer = build_optimizer(model, adamw, 1e-3, "zero3")
    return save_checkpoint(model, optimizer, TrainState(step=1, model=record), rank, IdRanges())


def export_rank(rank: int, world: int, run_dir: str, out_dir: str) -> dict[str, int]:
    """The resident-memory growth of `raytrain.export` in a fresh process (imports done before the start mark)."""
    from raytrain.model_export import CheckpointTensors, choose_checkpoint, export

    chosen = choose_checkpoint(run_dir)
    reader = CheckpointTensors(chosen.path, chosen.fs)
    sizes = [math.prod(reader.shape(n)) * reader.dtype(n).itemsize for n in reader.names]
    before = _rss_bytes()
    assert _max_rss_bytes() <= before + 32 * 2**20, "the high-water mark is above the start: measure in a new process"
    result = export(run_dir, out_dir)
    return {"growth": _max_rss_bytes() - before, "model": result.nbytes, "largest": max(sizes), "tensors": len(sizes)}


def measure_export(quick: bool) -> dict[str, float]:
    """Checkpoint the load model at zero3 on 2 ranks, merge the ranks' files into a run directory as Ray Train
    does, and export it in a fresh process."""
    import os
    import shutil
    import tempfile

    width, layers = (1536, 8) if quick else (LOAD_WIDTH, LOAD_LAYERS)
    with tempfile.TemporaryDirectory(prefix="raytrain-bench-export-") as directory:
        target = os.path.join(directory, "run", "checkpoint_2026-12-07_00-00-01")
        os.makedirs(target)
        for rank_dir in run_world(save_rank, 2, width, layers, preload=["torch", "raytrain"]):
            for name in os.listdir(rank_dir):
                shutil.move(os.path.join(rank_dir, name), os.path.join(target, name))
        (result,) = run_world(export_rank, 1, os.path.join(directory, "run"), os.path.join(directory, "out"))
    fraction = result["growth"] / result["model"]
    print(
        f"\nexport of a zero3 W=2 checkpoint ({result['model'] / 1e6:.0f} MB in {result['tensors']} tensors, the "
        f"largest {result['largest'] / result['model']:.3f} of the model): RSS growth {fraction:.3f} of the model"
    )
    return {"fraction": fraction, "largest": result["largest"] / result["model"], "tensors": result["tensors"]}


def model_shape(model_class: type[nn.Module]) -> tuple[int, int, int, int]:
    """(parameters, largest FSDP unit, root unit, largest single module's own parameters) of a model, from a
    meta-device build and the units raytrain would wrap."""
    with torch.device("meta"):
        meta = model_class()
    units, _ = fsdp_units(meta)
    sizes = unit_params(meta, units)
    largest_module = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in meta.modules())
    return sum(p.numel() for p in meta.parameters()), max(sizes), sizes[-1], largest_module


def single_process_losses(k: int, world: int) -> list[float]:
    """The same steps in one process, unwrapped: every rank's micro-batches in one batch per step."""
    built = record_build(Stack)
    model = apply_parallelism(built.model, "ddp", torch.device("cpu"), 1, init=built.trace, seed=0)
    optimizer = adamw(model.parameters(), 1e-3)
    losses = []
    for step in range(STEPS):
        parts = [b for rank in range(world) for b in batches(rank, world, k, step)]
        batch = {key: torch.cat([b[key] for b in parts]) for key in parts[0]}
        losses.append(train_step(model, optimizer, loss_fn, [batch], 1, world * k * MICRO_BATCH).loss_sum)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="W = 2 only (a smoke run)")
    args = parser.parse_args()
    worlds = [2] if args.quick else [2, 4]
    rows = configs(worlds, args.quick)
    started = time.perf_counter()
    shapes = {name: model_shape(cls) for name, cls in MODELS.items()}
    num_params, largest_unit, root_unit, largest_module = shapes["stack"]
    measured: dict[int, list[list[dict[str, Any]]]] = {}
    for world in worlds:
        measured[world] = run_world(rank_main, world, rows, preload=["torch", "torch.distributed.fsdp", "raytrain"])

    transformer = shapes["torch-transformer"]
    print(
        f"Peak tensor bytes per rank (LiveBytes: every allocation), AdamW, micro-batch {MICRO_BATCH}, gloo on CPU. "
        f"stack: {num_params:,} parameters ({BLOCKS} blocks, largest FSDP unit {largest_unit:,}), the model the "
        f"planner was written against; torch-transformer: {transformer[0]:,} parameters (nn.TransformerEncoder, "
        f"{TRANSFORMER_LAYERS} layers of {transformer[1]:,}), out of sample. The planner counts model state only "
        "(parameters, gradients as views of DDP's buckets, optimizer state, FSDP's gathered units, autocast copies): "
        "activations are excluded, and kept small here"
    )
    print(machine_line())
    table_rows: list[list[Any]] = []
    errors: dict[tuple[str, str], dict[str, float]] = {}  # (model, precision) -> row name -> error
    peaks: dict[tuple[int, int, str, str], int] = {}  # the stack's fp32 rows
    for world in worlds:
        per_rank = measured[world]
        for index, config in enumerate(per_rank[0]):
            if config["mode"] == "full-init":
                continue
            peak = max(r[index]["peak"] for r in per_rank)
            model, precision = config["model"], config["precision"]
            if model == "stack":
                peaks[(world, config["k"], config["strategy"], config["mode"])] = peak
            params, unit, root, _ = shapes[model]
            plan = loop_memory(
                params,
                config["strategy"],
                world,
                largest_unit_params=unit,
                root_unit_params=root,
                optimizer_bytes_per_param=8,
                accumulation_steps=config["k"],
                grad_accumulation=config["mode"],
                precision=precision,
            )
            error = (peak - plan.total) / plan.total
            name = f"{model} {precision} {config['strategy']} W={world} k={config['k']} {config['mode']}"
            errors.setdefault((model, precision), {})[name] = error
            parts = ", ".join(f"{part} {value / 1e6:.2f}" for part, value in plan.parts.items())
            table_rows.append(
                [
                    model,
                    precision,
                    config["strategy"],
                    world,
                    config["k"],
                    config["mode"],
                    peak / 1e6,
                    plan.total / 1e6,
                    f"{100 * error:+.1f} %",
                    parts,
                ]
            )
    columns = ["model", "dtype", "strategy", "W", "k", "grads", "measured MB", "planned MB", "error"]
    print(table([*columns, "planned parts (MB)"], table_rows))

    top = max(worlds)
    full_params = 4 * num_params
    zero3_init = max(
        run["init_peak"]
        for rank in measured[top]
        for run in rank
        if (run["model"], run["strategy"], run["k"], run["mode"]) == ("stack", "zero3", 1, "unsharded")
    )
    old_init = max(r[-1]["init_peak"] for r in measured[top])
    expected_fraction = 1 / top + largest_module / num_params
    print(
        f"\ninit peak at zero3 W={top}: {zero3_init / 1e6:.2f} MB = {zero3_init / full_params:.3f} of the full model's "
        f"parameters (1/W + largest module = {expected_fraction:.3f}); building the whole model first: "
        f"{old_init / 1e6:.2f} MB = {old_init / full_params:.3f}"
    )

    full_state = 16 * num_params  # fp32 params + grads + AdamW's two moments
    budget = full_state // 2
    zero3_peak = peaks[(top, 4, "zero3", "sharded")]
    fits = zero3_peak <= budget
    print(
        f"budget: half the full training state, {budget / 1e6:.2f} MB of {full_state / 1e6:.2f} MB; zero3 W={top} k=4 "
        f"sharded peaks at {zero3_peak / 1e6:.2f} MB: {'fits' if fits else 'DOES NOT FIT'}"
    )
    auto_rows = []
    auto_ok = True
    for world in worlds:
        for k in (1, 4):
            try:
                layout = choose_layout(
                    "auto",
                    "auto",
                    num_params=num_params,
                    largest_unit=largest_unit,
                    root_unit=root_unit,
                    world_size=world,
                    accumulation_steps=k,
                    precision="fp32",
                    memory_bytes=int(budget / 0.8),  # the planner keeps 20 % free: its budget is exactly `budget`
                )
            except ConfigError:  # auto refuses: right only if nothing it could pick fits when measured
                fitting = [s for (w, kk, s, _), p in peaks.items() if (w, kk) == (world, k) and p <= budget]
                auto_ok &= not fitting
                auto_rows.append([world, k, "refused", "-", "-", budget / 1e6, "right" if not fitting else "NO"])
                continue
            mode = layout.grad_accumulation if layout.strategy in ("zero2", "zero3") and k > 1 else "unsharded"
            measured_peak = peaks[(world, k, layout.strategy, mode)]
            ok = measured_peak <= budget
            auto_ok &= ok
            row = [world, k, layout.strategy, mode, measured_peak / 1e6, budget / 1e6, "yes" if ok else "NO"]
            auto_rows.append(row)
    print(table(["W", "k", "auto strategy", "grads", "measured MB", "budget MB", "fits"], auto_rows))

    reference = single_process_losses(4, top)
    wanted = ("stack", "zero3", 4, "sharded")
    runs = [next(r for r in rank if (r["model"], r["strategy"], r["k"], r["mode"]) == wanted) for rank in measured[top]]
    totals = runs[0]["losses"]  # the global sum, the same on every rank
    loss_ok = all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(totals, reference, strict=True))
    print(
        f"loss sums per step, zero3 W={top} k=4: {totals}; one process: {reference}: "
        + ("equal" if loss_ok else "DIFFERENT")
    )
    load = measure_pretrained_load(top if not args.quick else 2, args.quick)
    exported = measure_export(args.quick)
    worst = {group: max(rows_of, key=lambda name: abs(rows_of[name])) for group, rows_of in errors.items()}
    in_sample, out_of_sample, bf16 = (
        ("stack", "fp32"),
        ("torch-transformer", "fp32"),
        ("torch-transformer", "bf16"),
    )
    print(f"wall time {time.perf_counter() - started:.1f} s")
    print_headline(
        {
            "planner_counts": "model state; activations excluded",
            "worst_planner_error": round(abs(errors[in_sample][worst[in_sample]]), 4),
            "worst_planner_error_row": worst[in_sample],
            "worst_planner_error_out_of_sample": round(abs(errors[out_of_sample][worst[out_of_sample]]), 4),
            "worst_planner_error_out_of_sample_row": worst[out_of_sample],
            "worst_planner_error_bf16": round(abs(errors[bf16][worst[bf16]]), 4),
            "worst_planner_error_bf16_row": worst[bf16],
            "init_peak_fraction": round(zero3_init / full_params, 4),
            "init_peak_fraction_expected": round(expected_fraction, 4),
            "init_peak_fraction_full_build": round(old_init / full_params, 4),
            "budget_check": fits,
            "auto_fits": auto_ok,
            "loss_matches_w1": loss_ok,
            "num_params": num_params,
            "pretrained_load_peak_fraction": round(load["sharded"], 4),
            "pretrained_load_read_fraction": round(load["read_fraction"], 4),
            "pretrained_load_peak_fraction_full_build": round(load["full"], 4),
            "export_peak_fraction": round(exported["fraction"], 4),
            "export_largest_tensor_fraction": round(exported["largest"], 4),
            "export_tensors": exported["tensors"],
        }
    )


if __name__ == "__main__":
    main()
