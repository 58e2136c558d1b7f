"""python benchmarks/gpu.py [--quick] [--steps 20] [--micro-batch 16] [--accumulation 4] [--peak-tflops X]

GPU variant: tokens/s, model FLOPs utilisation (MFU), peak memory and gradient-sync counts of a GPT-small-sized
language model (12 layers, d_model 768, 12 heads, context 1024, vocabulary 32768, untied embeddings: 136 M
parameters, a minimal GPT written in this file) trained with raytrain's `train_step` (bf16 autocast, fp32 master
weights, AdamW) on all visible GPUs: one process per GPU started with torch.multiprocessing (no torchrun, no
Ray), nccl. Strategies: ddp and zero3 (FSDP2 `fully_shard` per block, as raytrain's `apply_parallelism` wraps
every direct child; the GPT is an nn.Sequential of embedding, 12 blocks and head for that reason), and the plain
unwrapped model. At W >= 2 the wrapping is raytrain's `apply_parallelism`; at W = 1 raytrain runs the model
unwrapped (the "plain" row), so the ddp / zero3 rows wrap it the same way by hand to show the wrapper's cost.

Data are random tokens generated on the GPU (this measures the training step, not a data pipeline). Every
optimizer step runs k micro-batches; raytrain synchronises only the last one. Counts come from a DDP comm hook
around the default all-reduce hook and from wrapping torch.distributed's reduce-scatter entry points.
MFU = model FLOPs per token x tokens/s / (W x peak), with model FLOPs per token = 6 N + 12 L d T (N the
parameters in matrix multiplies, i.e. without the embedding tables; the second term attention), and the peak
bf16 dense FLOP/s of the device from its datasheet (H100 / H200 SXM 989 TFLOP/s; pass --peak-tflops otherwise).

Without CUDA it prints a table saying "skipped: no CUDA" and {"skipped": true, "reason": "no CUDA"}, and exits
0. `--cpu-check` runs the same code on CPU with gloo and a tiny GPT (W = 2), to test the script itself.
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import print_headline, quiet_fsdp_warnings, table
from torch import nn

from raytrain.testing.multiprocess import run_world

PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


@dataclass(frozen=True)
class GPTConfig:
    layers: int = 12
    d_model: int = 768
    heads: int = 12
    context: int = 1024
    vocab: int = 32768


# ---------------------------------------------------------------- a minimal GPT


class Embed(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(c.vocab, c.d_model)
        self.positions = nn.Embedding(c.context, c.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.ln1, self.ln2 = nn.LayerNorm(c.d_model), nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.fc = nn.Linear(c.d_model, 4 * c.d_model)
        self.out = nn.Linear(4 * c.d_model, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Head(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(c.d_model)
        self.lm_head = nn.Linear(c.d_model, c.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln(x))


def build_gpt(c: GPTConfig) -> nn.Sequential:
    """Embedding, blocks and head as direct children, so FSDP2 wraps one unit per block."""
    torch.manual_seed(0)
    return nn.Sequential(Embed(c), *(Block(c) for _ in range(c.layers)), Head(c))


def matmul_params(model: nn.Module) -> int:
    """Parameters used in matrix multiplies: everything but the embedding tables."""
    embeddings = sum(p.numel() for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters())
    return sum(p.numel() for p in model.parameters()) - embeddings


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor], device_type: str = "cuda") -> torch.Tensor:
    """Per-sequence mean next-token cross entropy (raytrain's contract: one loss per sample), bf16 autocast."""
    with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
        logits = model(batch["tokens"][:, :-1])
    losses = F.cross_entropy(logits.float().flatten(0, 1), batch["tokens"][:, 1:].flatten(), reduction="none").view(
        logits.shape[0], -1
    )
    return losses.mean(dim=1)


# ---------------------------------------------------------------- counting collectives


class Counter:
    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def add(self, kind: str) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1


COUNTER = Counter()
_DEPTH = [0]


def _counting(kind: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _DEPTH[0] == 0:
            COUNTER.add(kind)
        _DEPTH[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _DEPTH[0] -= 1

    return wrapper


def patch_collectives() -> None:
    for name, kind in (
        ("reduce_scatter_single", "reduce_scatter"),
        ("reduce_scatter_tensor", "reduce_scatter"),
        ("all_gather_single", "all_gather"),
        ("all_gather_into_tensor", "all_gather"),
    ):
        if hasattr(dist, name):
            setattr(dist, name, _counting(kind, getattr(dist, name)))


def ddp_counting_hook(counter, bucket):  # no annotations: DDP checks them against the real classes
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    counter.add("all_reduce")
    return allreduce_hook(None, bucket)


# ---------------------------------------------------------------- one rank


def wrap(model: nn.Module, strategy: str, device: torch.device, world: int) -> nn.Module:
    """raytrain's `apply_parallelism`; at W = 1 (where raytrain wraps nothing) the same wrapping by hand."""
    from raytrain.parallel.apply import apply_parallelism

    if strategy == "plain":
        return model.to(device)
    if world > 1:
        return apply_parallelism(model, strategy, device, world)
    model = model.to(device)
    if strategy == "ddp":
        return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    return model


def run_strategy(strategy: str, rank: int, world: int, device: torch.device, args: dict[str, Any]) -> dict[str, Any]:
    # raytrain is imported here, not at the top, so that the "no CUDA" answer needs nothing beyond torch.
    from raytrain.optim import build_optimizer
    from raytrain.worker_loop import train_step

    c = GPTConfig(**args["gpt"])
    model = build_gpt(c)
    n_params = sum(p.numel() for p in model.parameters())
    n_matmul = matmul_params(model)
    model = wrap(model, strategy, device, world)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model.register_comm_hook(COUNTER, ddp_counting_hook)
    optimizer = build_optimizer(model, torch.optim.AdamW, 3e-4, "zero3" if strategy == "zero3" else "ddp")
    mb, k = args["micro_batch"], args["accumulation"]
    loss_fn = functools.partial(lm_loss, device_type=device.type)
    generator = torch.Generator(device=device).manual_seed(1234 + rank)

    def batches() -> list[dict[str, torch.Tensor]]:
        return [
            {"tokens": torch.randint(0, c.vocab, (mb, c.context + 1), device=device, generator=generator)}
            for _ in range(k)
        ]

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args["warmup"]):
        loss = train_step(model, optimizer, loss_fn, batches(), world, world * k * mb).loss_sum
    data = [batches() for _ in range(args["steps"])]
    if cuda:
        torch.cuda.synchronize(device)
    dist.barrier()
    COUNTER.calls.clear()
    started = time.perf_counter()
    for step_batches in data:
        loss = train_step(model, optimizer, loss_fn, step_batches, world, world * k * mb).loss_sum
    if cuda:
        torch.cuda.synchronize(device)
    dist.barrier()
    elapsed = time.perf_counter() - started
    tokens = args["steps"] * world * k * mb * c.context
    flops_per_token = 6 * n_matmul + 12 * c.layers * c.d_model * c.context
    result = {
        "strategy": strategy,
        "params": n_params,
        "tokens_per_s": tokens / elapsed,
        "step_s": elapsed / args["steps"],
        "flops_per_token": flops_per_token,
        "all_reduce_per_step": COUNTER.calls.get("all_reduce", 0) / args["steps"],
        "reduce_scatter_per_step": COUNTER.calls.get("reduce_scatter", 0) / args["steps"],
        "all_gather_per_step": COUNTER.calls.get("all_gather", 0) / args["steps"],
        "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 1e9 if cuda else float("nan"),
        "last_loss": loss / (world * k * mb),  # train_step's loss sum is global
    }
    del model, optimizer, data
    if cuda:
        torch.cuda.empty_cache()
    return result


def rank_main(rank: int, world: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    """One rank (its process group joined by `run_world`: gloo for --cpu-check, else nccl on CUDA device `rank`)."""
    quiet_fsdp_warnings()
    if args["cpu"]:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", rank)
        torch.backends.cuda.matmul.allow_tf32 = True
    patch_collectives()
    return [run_strategy(s, rank, world, device, args) for s in args["strategies"]]


# ---------------------------------------------------------------- driver


def peak_tflops(name: str) -> float:
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name:
            return value
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps, small micro-batch (a smoke run)")
    parser.add_argument("--steps", type=int, default=20, help="measured optimizer steps per strategy")
    parser.add_argument("--micro-batch", type=int, default=16, help="sequences per micro-batch per GPU")
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per optimizer step (k)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="peak bf16 TFLOP/s per device for MFU")
    parser.add_argument("--cpu-check", action="store_true", help="run the code on CPU/gloo with a tiny GPT (W=2)")
    args = parser.parse_args()

    if not torch.cuda.is_available() and not args.cpu_check:
        print(
            table(["benchmark", "status"], [["gpu.py (GPT-small, DDP / FSDP2 zero3, nccl, bf16)", "skipped: no CUDA"]])
        )
        print_headline({"skipped": True, "reason": "no CUDA"})
        return

    started = time.perf_counter()
    if args.cpu_check:
        world, device_name, gpt = 2, "CPU (gloo check)", GPTConfig(layers=2, d_model=64, heads=4, context=64, vocab=256)
        steps, warmup, micro_batch = 2, 1, 2
    else:
        world, device_name, gpt = torch.cuda.device_count(), torch.cuda.get_device_name(0), GPTConfig()
        steps, warmup, micro_batch = (3, 2, 4) if args.quick else (args.steps, 5, args.micro_batch)
    peak = args.peak_tflops if args.peak_tflops else peak_tflops(device_name)
    run_args = {
        "cpu": args.cpu_check,
        "gpt": asdict(gpt),
        "steps": steps,
        "warmup": warmup,
        "micro_batch": micro_batch,
        "accumulation": args.accumulation,
        "strategies": ["plain", "ddp", "zero3"] if world == 1 else ["ddp", "zero3"],
    }
    backend = "gloo" if args.cpu_check else "nccl"
    results = run_world(rank_main, world, run_args, backend=backend, preload=("torch", "raytrain.worker_loop"))[0]

    tokens_per_step = world * args.accumulation * micro_batch * gpt.context
    print(
        f"GPT {results[0]['params'] / 1e6:.1f} M parameters ({gpt.layers} layers, d {gpt.d_model}, {gpt.heads} heads, "
        f"context {gpt.context}, vocab {gpt.vocab}), W = {world} x {device_name}, bf16 autocast, "
        f"{tokens_per_step:,} tokens per optimizer step (k = {args.accumulation} micro-batches of {micro_batch}), "
        f"{steps} measured steps after {warmup} warm-up; peak {peak} TFLOP/s per device"
    )
    rows = []
    for r in results:
        mfu = r["flops_per_token"] * r["tokens_per_s"] / (world * peak * 1e12) if not math.isnan(peak) else float("nan")
        r["mfu"] = mfu
        label = r["strategy"] + (" (wrapped by hand at W=1)" if world == 1 and r["strategy"] != "plain" else "")
        rows.append(
            [
                label,
                f"{r['tokens_per_s']:,.0f}",
                f"{100 * mfu:.1f} %" if not math.isnan(mfu) else "-",
                f"{r['step_s'] * 1000:.1f}",
                r["all_reduce_per_step"],
                r["reduce_scatter_per_step"],
                r["all_gather_per_step"],
                f"{r['peak_mem_gb']:.1f}" if not math.isnan(r["peak_mem_gb"]) else "-",
                f"{r['last_loss']:.3f}",
            ]
        )
    print(
        table(
            [
                "strategy",
                "tokens/s",
                "MFU",
                "ms/step",
                "all-reduces/step",
                "reduce-scatters/step",
                "all-gathers/step",
                "peak GB",
                "loss",
            ],
            rows,
        )
    )
    print(
        "note: syncs are per optimizer step of k micro-batches; raytrain reduces gradients in the last micro-batch "
        "only (DDP: one all-reduce per bucket; FSDP2: one reduce-scatter per unit), while zero3 all-gathers each "
        "unit in every micro-batch's forward and backward."
    )
    if world == 1:
        print("note: at W = 1 FSDP2 issues no reduce-scatter or all-gather (one shard); DDP still calls its hook.")
    print(f"wall time {time.perf_counter() - started:.1f} s")
    by = {r["strategy"]: r for r in results}
    print_headline(
        {
            "skipped": False,
            "device": device_name,
            "world_size": world,
            "params": results[0]["params"],
            "tokens_per_s_ddp": round(by["ddp"]["tokens_per_s"]),
            "tokens_per_s_zero3": round(by["zero3"]["tokens_per_s"]),
            "mfu_ddp": None if math.isnan(by["ddp"]["mfu"]) else round(by["ddp"]["mfu"], 4),
            "mfu_zero3": None if math.isnan(by["zero3"]["mfu"]) else round(by["zero3"]["mfu"], 4),
            "all_reduces_per_step_ddp": by["ddp"]["all_reduce_per_step"],
            "reduce_scatters_per_step_zero3": by["zero3"]["reduce_scatter_per_step"],
            "accumulation": args.accumulation,
        }
    )


if __name__ == "__main__":
    main()
