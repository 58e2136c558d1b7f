"""python benchmarks/gpu.py [--quick] [--steps 20] [--micro-batch 16] [--accumulation 4] [--peak-tflops X]

GPU variant: tokens/s, model FLOPs utilisation (MFU), peak memory and gradient-sync counts of a GPT-small-sized
language model (12 layers, d_model 768, 12 heads, context 1024, vocabulary 32768, untied embeddings: 136 M
parameters, a minimal GPT written in this file) trained with raytrain's `train_step` (bf16 autocast, fp32 master
weights, AdamW) on all visible GPUs: one process per GPU started with torch.multiprocessing (no torchrun, no
Ray), nccl. Strategies: ddp and zero3 (FSDP2 `fully_shard` per block, as raytrain's `apply_parallelism` wraps
every direct child; the GPT is an nn.Sequential of embedding, 12 blocks and head for that reason), and the
baseline **"FSDP2 by hand"**: the loop a user writes without raytrain (`fully_shard` per block and the root, bf16
autocast, loss / k, `set_requires_gradient_sync(False)` on all but the last micro-batch, `clip_grad_norm_`, AdamW),
the same work as raytrain's zero3 row (`raytrain_over_hand_zero3` is their tokens/s ratio). At W >= 2 raytrain's
rows wrap with its `apply_parallelism`; at W = 1 raytrain runs the model unwrapped (the "plain" row: raytrain's own
step), so its ddp / zero3 rows wrap it the same way by hand to show the wrapper's cost.

Data are random tokens generated on the GPU (this measures the training step, not a data pipeline). Every
optimizer step runs k micro-batches; raytrain synchronises only the last one. Counts come from a DDP comm hook
around the default all-reduce hook and from wrapping torch.distributed's reduce-scatter entry points.
MFU = model FLOPs per token x tokens/s / (W x peak), with model FLOPs per token = 6 N + 6 L d T (N the
parameters in matrix multiplies, i.e. without the embedding tables; the second term causal attention: the
non-causal 12 L d T halved, since a causal kernel computes only the lower triangle of QK^T and of its product with
V; `mfu_noncausal_*` gives the PaLM-style figure beside it), and the peak bf16 dense FLOP/s of the card actually
found, from its datasheet by its device name (H100/H200 SXM 989, H100/H200 NVL 835, H100 PCIe 756, A100 312,
L40S 362 TFLOP/s; pass --peak-tflops for another card).

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

# Dense bf16 TFLOP/s per card from NVIDIA's datasheets (half the "with sparsity" figure), matched against
# torch.cuda.get_device_name() in this order: the PCIe / NVL variants before the SXM default of the same chip.
PEAK_BF16_TFLOPS = [
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.5),
    ("H200 NVL", 835.5),
    ("H100", 989.4),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H200", 989.4),  # SXM ("NVIDIA H200")
    ("A100", 312.0),  # SXM and PCIe alike
    ("L40S", 362.0),
]


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


def hand_fsdp2(model: nn.Module, device: torch.device) -> nn.Module:
    """FSDP2 as a user wraps it without raytrain: `fully_shard` on each block (every child with parameters) and
    on the root."""
    from torch.distributed.fsdp import fully_shard

    model = model.to(device)
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child)
    fully_shard(model)
    return model


def hand_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[dict[str, torch.Tensor]], device_type: str
) -> float:
    """One optimizer step of the loop a user writes without raytrain: per-token mean loss / k, gradient sync on
    the last micro-batch only, clipping at 1.0, AdamW; returns the step's mean loss (a local float, no
    all-reduce: the usual loop logs rank 0's)."""
    k = len(batches)
    total = 0.0
    for j, batch in enumerate(batches):
        model.set_requires_gradient_sync(j == k - 1)  # type: ignore[operator]
        with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
            logits = model(batch["tokens"][:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch["tokens"][:, 1:].flatten())
        (loss / k).backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total / k


def wrap(model: nn.Module, strategy: str, device: torch.device, world: int) -> nn.Module:
    """raytrain's `apply_parallelism`; at W = 1 (where raytrain wraps nothing) the same wrapping by hand."""
    from raytrain.parallel.apply import apply_parallelism

    if strategy == "plain":
        return model.to(device)
    if strategy == "hand_fsdp2":
        return hand_fsdp2(model, device)
    if world > 1:
        return apply_parallelism(model, strategy, device, world)
    if strategy == "ddp":
        model = model.to(device)
        return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return hand_fsdp2(model, device)  # zero3 at W = 1: FSDP2 per block and root, as apply_parallelism wraps


def run_strategy(strategy: str, rank: int, world: int, device: torch.device, args: dict[str, Any]) -> dict[str, Any]:
    # raytrain is imported here, not at the top, so that the "no CUDA" answer needs nothing beyond torch.
    from raytrain.optim import build_optimizer
    from raytrain.step import train_step

    c = GPTConfig(**args["gpt"])
    model = build_gpt(c)
    n_params = sum(p.numel() for p in model.parameters())
    n_matmul = matmul_params(model)
    model = wrap(model, strategy, device, world)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model.register_comm_hook(COUNTER, ddp_counting_hook)
    if strategy == "hand_fsdp2":
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    else:
        optimizer = build_optimizer(model, torch.optim.AdamW, 3e-4, "zero3" if strategy == "zero3" else "ddp")
    mb, k = args["micro_batch"], args["accumulation"]
    loss_fn = functools.partial(lm_loss, device_type=device.type)

    def step(model: nn.Module, optimizer: torch.optim.Optimizer, step_batches: list[dict[str, torch.Tensor]]) -> float:
        """The global mean loss of raytrain's step, or rank 0's mean loss of the hand-written one."""
        if strategy == "hand_fsdp2":
            return hand_step(model, optimizer, step_batches, device.type)
        return train_step(model, optimizer, loss_fn, step_batches, world, world * k * mb).loss_sum / (world * k * mb)

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
        loss = step(model, optimizer, batches())
    data = [batches() for _ in range(args["steps"])]
    if cuda:
        torch.cuda.synchronize(device)
    dist.barrier()
    COUNTER.calls.clear()
    started = time.perf_counter()
    for step_batches in data:
        loss = step(model, optimizer, step_batches)
    if cuda:
        torch.cuda.synchronize(device)
    dist.barrier()
    elapsed = time.perf_counter() - started
    tokens = args["steps"] * world * k * mb * c.context
    flops_per_token = 6 * n_matmul + 6 * c.layers * c.d_model * c.context  # causal attention: half of 12 L d T
    result = {
        "strategy": strategy,
        "params": n_params,
        "tokens_per_s": tokens / elapsed,
        "step_s": elapsed / args["steps"],
        "flops_per_token": flops_per_token,
        "flops_per_token_noncausal": flops_per_token + 6 * c.layers * c.d_model * c.context,
        "all_reduce_per_step": COUNTER.calls.get("all_reduce", 0) / args["steps"],
        "reduce_scatter_per_step": COUNTER.calls.get("reduce_scatter", 0) / args["steps"],
        "all_gather_per_step": COUNTER.calls.get("all_gather", 0) / args["steps"],
        "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 1e9 if cuda else float("nan"),
        "last_loss": loss,
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
    """The dense bf16 peak of the card named `name` (`torch.cuda.get_device_name`), or NaN when unknown."""
    for key, value in PEAK_BF16_TFLOPS:
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
        "strategies": ["plain", "ddp", "zero3", "hand_fsdp2"] if world == 1 else ["ddp", "zero3", "hand_fsdp2"],
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
    labels = {"plain": "raytrain, unwrapped (W = 1)", "hand_fsdp2": "FSDP2 by hand (no raytrain)"}
    for r in results:

        def mfu_of(flops: float, r: dict[str, Any] = r) -> float:
            return flops * r["tokens_per_s"] / (world * peak * 1e12) if not math.isnan(peak) else float("nan")

        mfu = r["mfu"] = mfu_of(r["flops_per_token"])
        r["mfu_noncausal"] = mfu_of(r["flops_per_token_noncausal"])
        label = labels.get(r["strategy"], "raytrain " + r["strategy"])
        if world == 1 and r["strategy"] in ("ddp", "zero3"):
            label += " (wrapped by hand at W=1)"
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
            "mfu_noncausal_zero3": None if math.isnan(by["zero3"]["mfu"]) else round(by["zero3"]["mfu_noncausal"], 4),
            "tokens_per_s_hand_fsdp2": round(by["hand_fsdp2"]["tokens_per_s"]),
            "raytrain_over_hand_zero3": round(by["zero3"]["tokens_per_s"] / by["hand_fsdp2"]["tokens_per_s"], 3),
            "peak_tflops": None if math.isnan(peak) else peak,
            "all_reduces_per_step_ddp": by["ddp"]["all_reduce_per_step"],
            "reduce_scatters_per_step_zero3": by["zero3"]["reduce_scatter_per_step"],
            "accumulation": args.accumulation,
        }
    )


if __name__ == "__main__":
    main()
