"""python benchmarks/communication.py [--quick]

Gradient synchronisation per optimizer step with k accumulation micro-steps. Every loop is raytrain's own
`train_step` (the same forward, backward, loss all-reduce, gradient norm and optimizer step); only the micro-step
policy differs:
    raytrain          the default (unsharded accumulation): DDP `no_sync` / FSDP2 `set_requires_gradient_sync(False)`
                      on all but the last micro-step, zero2's parameters kept gathered until the last backward;
    raytrain-sharded  zero2/zero3 with `grad_accumulation="sharded"` (what "auto" picks when the full gradient does
                      not fit beside the rest): a reduce-scatter after every micro-step, only the shard held;
    naive             a sync on every micro-step's backward and parameters resharded after each (the usual loop
                      without `no_sync`).
At k = 1 the three run identical code, so their ms/step differ by this machine's timing noise only.

How it counts (W = 2 gloo processes started with torch.multiprocessing, no Ray; the models are wrapped by
raytrain's own `apply_parallelism`):
    ddp          a DDP communication hook (`register_comm_hook`) that wraps torch's default `allreduce_hook` and
                 counts calls and bucket bytes (every all-reduce DDP issues for gradients goes through it).
    zero2/zero3  FSDP2 issues its collectives through `torch.distributed.reduce_scatter_single` and
                 `all_gather_single` in torch 2.13 (not `reduce_scatter_tensor`); the script wraps every
                 reduce-scatter / all-gather entry point of `torch.distributed` and counts calls and input bytes
                 (the outermost call only). It checks that the counters really saw traffic.
"syncs/step" is gradient bytes reduced per optimizer step divided by the bytes of one full fp32 gradient: 1.0
means one gradient synchronisation per step whatever k is; a naive loop pays k. Reduce-scatters are counted by
their (padded, full-size) input, so FSDP2's value can exceed 1.0 by its padding. FSDP2 parameter all-gathers
are reported beside it: raytrain's zero2 keeps parameters gathered from the first micro-step to the last
(`set_reshard_after_backward(False)` until the last), so it gathers each unit once per step whatever k is; zero3
re-gathers every unit in every micro-step's forward and backward (that is ZeRO-3's memory promise).
ms/step is the median wall time of a step on rank 0 (CPU/gloo), the two loops' steps interleaved; for the
side-by-side ratio only.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from _common import machine_line, print_headline, quiet_fsdp_warnings, table
from torch import nn

from raytrain.optim import build_optimizer
from raytrain.parallel.apply import apply_parallelism, step_policy
from raytrain.testing.multiprocess import run_world
from raytrain.worker_loop import train_step

WORLD = 2
FEATURES = 256
MICRO_BATCH = 32
STRATEGIES = ("ddp", "zero2", "zero3")
LOOPS = ("raytrain", "raytrain-sharded", "naive")


def build_model() -> nn.Module:
    """About 0.79 M float32 parameters in three Linear layers (DDP puts them in more than one bucket)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, 1024), nn.Tanh(), nn.Linear(1024, 512), nn.Tanh(), nn.Linear(512, 1), nn.Flatten(0)
    )


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (model(batch["x"]) - batch["y"]) ** 2


class Counter:
    """Calls and bytes per collective kind."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def add(self, kind: str, num_bytes: int) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + num_bytes

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()


COUNTER = Counter()
_DEPTH = [0]


def _counting(kind: str, fn, tensor_arg: str, position: int):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        outermost = _DEPTH[0] == 0
        _DEPTH[0] += 1
        try:
            if outermost:
                tensor = kwargs.get(tensor_arg, args[position] if len(args) > position else None)
                if isinstance(tensor, torch.Tensor):
                    COUNTER.add(kind, tensor.numel() * tensor.element_size())
            return fn(*args, **kwargs)
        finally:
            _DEPTH[0] -= 1

    return wrapper


def patch_collectives() -> None:
    """Count reduce-scatters (by input) and all-gathers (by output) issued through torch.distributed."""
    for name, kind, arg, pos in (
        ("reduce_scatter_single", "reduce_scatter", "input", 1),
        ("reduce_scatter_tensor", "reduce_scatter", "input", 1),
        ("all_gather_single", "all_gather", "output_tensor", 0),
        ("all_gather_into_tensor", "all_gather", "output_tensor", 0),
    ):
        if hasattr(dist, name):
            setattr(dist, name, _counting(kind, getattr(dist, name), arg, pos))


def ddp_counting_hook(counter, bucket):  # no annotations: DDP checks them against the real classes
    """Count one gradient bucket, then all-reduce it exactly as DDP's default does."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    buffer = bucket.buffer()
    counter.add("all_reduce", buffer.numel() * buffer.element_size())
    return allreduce_hook(None, bucket)  # type: ignore[arg-type]  # None: the default process group


def micro_batches(rank: int, k: int, step: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1000 * step + 10 * rank + k)
    return [
        {
            "x": torch.randn(MICRO_BATCH, FEATURES, generator=generator),
            "y": torch.randn(MICRO_BATCH, generator=generator),
        }
        for _ in range(k)
    ]


def measure(rank: int, strategy: str, k: int, steps: int) -> list[dict[str, Any]]:
    """Both loops on two identical models, their steps interleaved (alternating order), so that the machine's
    load drifts equally over both; collectives are attributed to the loop whose step issued them."""
    device = torch.device("cpu")
    loops = [loop for loop in LOOPS if loop != "raytrain-sharded" or strategy != "ddp"]  # ddp has no sharded mode
    setups = {}
    for loop in loops:
        model = apply_parallelism(build_model(), strategy, device, WORLD)
        optimizer = build_optimizer(model, torch.optim.AdamW, 1e-3, strategy)
        if strategy == "ddp":
            model.register_comm_hook(COUNTER, ddp_counting_hook)
        policy = step_policy(strategy, WORLD, "fp32", "sharded" if loop == "raytrain-sharded" else "unsharded")
        if loop == "naive":
            policy = replace(policy, reduce_every_micro_step=True, keep_params_gathered=False)
        setups[loop] = (model, optimizer, functools.partial(train_step, policy=policy))
    step_total = WORLD * k * MICRO_BATCH
    for model, optimizer, step_fn in setups.values():  # warm-up (DDP builds its buckets in the first step)
        step_fn(model, optimizer, loss_fn, micro_batches(rank, k, -1), WORLD, step_total)
    seconds: dict[str, list[float]] = {loop: [] for loop in loops}
    calls: dict[str, dict[str, int]] = {loop: {} for loop in loops}
    nbytes: dict[str, dict[str, int]] = {loop: {} for loop in loops}
    for step in range(steps):
        for loop in loops if step % 2 == 0 else loops[::-1]:
            model, optimizer, step_fn = setups[loop]
            dist.barrier()
            COUNTER.reset()
            started = time.perf_counter()
            step_fn(model, optimizer, loss_fn, micro_batches(rank, k, step), WORLD, step_total)
            seconds[loop].append(time.perf_counter() - started)
            for kind, n in COUNTER.calls.items():
                calls[loop][kind] = calls[loop].get(kind, 0) + n
            for kind, n in COUNTER.bytes.items():
                nbytes[loop][kind] = nbytes[loop].get(kind, 0) + n
    dist.barrier()
    grad_bytes = sum(p.numel() * 4 for p in build_model().parameters())
    reduce_kind = "all_reduce" if strategy == "ddp" else "reduce_scatter"
    return [
        {
            "strategy": strategy,
            "loop": loop,
            "k": k,
            "reduce_calls_per_step": calls[loop].get(reduce_kind, 0) / steps,
            "reduced_mb_per_step": nbytes[loop].get(reduce_kind, 0) / steps / 1e6,
            "syncs_per_step": nbytes[loop].get(reduce_kind, 0) / steps / grad_bytes,
            "all_gathers_per_step": calls[loop].get("all_gather", 0) / steps,
            "gathered_mb_per_step": nbytes[loop].get("all_gather", 0) / steps / 1e6,
            "ms_per_step": 1000 * statistics.median(seconds[loop]),
        }
        for loop in loops
    ]


def rank_main(rank: int, world: int, ks: list[int], steps: int) -> list[dict[str, Any]]:
    quiet_fsdp_warnings()
    patch_collectives()
    rows = []
    for strategy in STRATEGIES:
        for k in ks:
            rows.extend(measure(rank, strategy, k, steps))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="k in {1, 8}, one measured step (a smoke run)")
    args = parser.parse_args()
    ks = [1, 8] if args.quick else [1, 2, 4, 8]
    steps = 1 if args.quick else 12
    started = time.perf_counter()
    rows = run_world(rank_main, WORLD, ks, steps, preload=["torch", "torch.distributed.fsdp", "raytrain"])[0]
    params = sum(p.numel() for p in build_model().parameters())
    print(machine_line())
    print(
        f"Gradient sync per optimizer step, W = {WORLD} (gloo), {params:,} fp32 parameters "
        f"({params * 4 / 1e6:.2f} MB of gradients), micro-batch {MICRO_BATCH}, "
        f"{steps} measured steps of each loop, interleaved"
    )
    by_key = {(r["strategy"], r["loop"], r["k"]): r for r in rows}
    table_rows = []
    for r in rows:
        naive = by_key[(r["strategy"], "naive", r["k"])]
        table_rows.append(
            [
                r["strategy"],
                r["k"],
                r["loop"],
                r["reduce_calls_per_step"],
                f"{r['reduced_mb_per_step']:.2f}",
                f"{r['syncs_per_step']:.2f}",
                r["all_gathers_per_step"],
                f"{r['gathered_mb_per_step']:.2f}",
                f"{r['ms_per_step']:.1f}",
                f"{naive['ms_per_step'] / r['ms_per_step']:.2f}",
            ]
        )
    print(
        table(
            [
                "strategy",
                "k",
                "loop",
                "reduce calls/step",
                "reduced MB/step",
                "syncs/step",
                "all-gathers/step",
                "gathered MB/step",
                "ms/step",
                "naive ms / this ms",
            ],
            table_rows,
        )
    )
    print("reduce = DDP all-reduce (comm hook) or FSDP2 reduce-scatter (wrapped torch.distributed entry points)")
    print(
        "note: DDP splits the gradients into 2 buckets here (its first bucket is capped at 1 MB), so one sync is 2 "
        "all-reduce calls. Every loop is raytrain's train_step; only the micro-step sync policy differs, so at k = 1 "
        "they run the same code and their ms/step differ by timing noise. raytrain's zero2 gathers each unit once "
        "per step at any k (parameters kept gathered across micro-steps); zero3 re-gathers in every micro-step. "
        "raytrain-sharded (grad_accumulation='sharded') reduce-scatters every micro-step: k syncs per step, like "
        "the naive loop, in exchange for holding only the gradient shard."
    )
    for strategy in STRATEGIES:
        seen = sum(r["reduce_calls_per_step"] for r in rows if r["strategy"] == strategy)
        if seen <= 0:
            print(f"ERROR: no gradient reduction was counted for {strategy}: the counter does not see it")
            sys.exit(1)
    top = max(ks)
    print(f"wall time {time.perf_counter() - started:.1f} s")
    print_headline(
        {
            "syncs_per_step_raytrain": round(by_key[("ddp", "raytrain", top)]["syncs_per_step"], 3),
            "syncs_per_step_naive": round(by_key[("ddp", "naive", top)]["syncs_per_step"], 3),
            "k": top,
            "zero3_syncs_per_step_raytrain": round(by_key[("zero3", "raytrain", top)]["syncs_per_step"], 3),
            "zero3_syncs_per_step_naive": round(by_key[("zero3", "naive", top)]["syncs_per_step"], 3),
            "zero3_syncs_per_step_raytrain_sharded": round(
                by_key[("zero3", "raytrain-sharded", top)]["syncs_per_step"], 3
            ),
            "zero2_all_gathers_per_step_raytrain_sharded": by_key[("zero2", "raytrain-sharded", top)][
                "all_gathers_per_step"
            ],
            "zero3_all_gathers_per_step_raytrain": by_key[("zero3", "raytrain", top)]["all_gathers_per_step"],
            "zero2_all_gathers_per_step_raytrain": by_key[("zero2", "raytrain", top)]["all_gathers_per_step"],
            "zero2_all_gathers_per_step_raytrain_k1": by_key[("zero2", "raytrain", min(ks))]["all_gathers_per_step"],
            "ddp_step_time_ratio_naive_over_raytrain": round(
                by_key[("ddp", "naive", top)]["ms_per_step"] / by_key[("ddp", "raytrain", top)]["ms_per_step"], 3
            ),
        }
    )


if __name__ == "__main__":
    main()
