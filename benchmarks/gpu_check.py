"""python benchmarks/gpu_check.py [--steps 12] [--cpu-check]

A correctness check for the day a GPU machine is lent (not a speed benchmark): the whole `ElasticTrainer` loop on
one GPU through Ray Train, i.e. W = 1 with the nccl process group Ray Train creates for `use_gpu=True`. raytrain's
own collectives run whenever a process group exists, at W = 1 too, so every one of them meets nccl's rule (CUDA
tensors only): the loss all-reduce, `strategy="auto"`'s memory all-reduce, the start-up pid gathering, the
validation all-reduce, and in streaming mode the step agreement all-gathers and the audit gathering.

Runs, each to the end with a finite, falling loss:
    ddp      deterministic data, AdamW with parameter groups, cosine schedule, clipping, validation set, audit
    zero1    the same with the optimizer state sharded (ZeroRedundancyOptimizer over the groups)
    auto     the planner's choice (its memory all-reduce on the GPU)
    stream   streaming mode (deterministic=False): step agreement and audit gathers on the GPU

Without CUDA it prints {"skipped": true, "reason": "no CUDA"} and exits 0. `--cpu-check` runs the same runs on CPU
workers (gloo) to test the script itself. One JSON line last.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from typing import Any

import torch
from _common import print_headline, read_jsonl, start_ray, stop_ray, table

RUNS = {
    "ddp": {"strategy": "ddp", "deterministic": True},
    "zero1": {"strategy": "zero1", "deterministic": True},
    "auto": {"strategy": "auto", "deterministic": True},
    "stream": {"strategy": "ddp", "deterministic": False},
}


def run_one(name: str, storage: str, steps: int, use_gpu: bool) -> dict[str, Any]:
    from raytrain.config import BatchConfig, CheckpointConfig, ClusterConfig, LoopConfig, LRConfig
    from raytrain.toy import adamw_groups, mlp_factory, regression_dataset, squared_error
    from raytrain.trainer import ElasticTrainer

    options = RUNS[name]
    trainer = ElasticTrainer(
        model_fn=mlp_factory(16, 64),
        loss_fn=squared_error,
        optimizer_fn=adamw_groups,
        datasets={"train": regression_dataset(64 * steps, 16, seed=0), "val": regression_dataset(100, 16, seed=1)},
        batch=BatchConfig(global_batch=64, micro_batch=16),
        lr=LRConfig(base_lr=3e-3, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1),
        loop=LoopConfig(
            epochs=2,
            max_steps=steps,
            strategy=str(options["strategy"]),
            deterministic=bool(options["deterministic"]),
            id_column="id",
            audit_samples=True,
            max_grad_norm=1.0,
            log_every=10**6,
        ),
        checkpoint=CheckpointConfig(storage_path=storage, run_name=name, every_steps=max(1, steps // 2)),
        cluster=ClusterConfig(
            min_workers=1,
            max_workers=1,
            use_gpu=use_gpu,
            resources_per_worker={"CPU": 1.0, **({"GPU": 1.0} if use_gpu else {})},
            max_failures=0,
        ),
        required_columns=("x", "y"),
    )
    started = time.perf_counter()
    result = trainer.fit()
    metrics = read_jsonl(result.metrics_path)
    events = read_jsonl(result.events_path)
    losses = [m["loss"] for m in metrics]
    return {
        "run": name,
        "steps": len(metrics),
        "strategy": events[0]["strategy"] if events else "-",
        "first_loss": losses[0] if losses else float("nan"),
        "last_loss": losses[-1] if losses else float("nan"),
        "val_loss": next((m["val_loss"] for m in reversed(metrics) if "val_loss" in m), float("nan")),
        "wall_s": time.perf_counter() - started,
        "ok": len(metrics) == steps
        and all(math.isfinite(v) for v in losses)
        and losses[-1] < losses[0]
        and all("grad_norm" in m for m in metrics),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="the default run (accepted for symmetry)")
    parser.add_argument("--cpu-check", action="store_true", help="run on CPU workers (gloo) to test the script")
    args = parser.parse_args()
    use_gpu = not args.cpu_check
    if use_gpu and not torch.cuda.is_available():
        print(table(["check", "result"], [["whole ElasticTrainer loop on 1 GPU (nccl)", "skipped: no CUDA"]]))
        print_headline({"skipped": True, "reason": "no CUDA"})
        return
    start_ray(num_cpus=4)
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    with tempfile.TemporaryDirectory(prefix="raytrain-gpu-check-") as storage:
        rows = [run_one(name, storage, args.steps, use_gpu) for name in RUNS]
    stop_ray()
    keys = ["run", "steps", "strategy", "first_loss", "last_loss", "val_loss", "wall_s", "ok"]
    print(f"backend {'nccl on ' + torch.cuda.get_device_name(0) if use_gpu else 'gloo (CPU check)'}, W = 1")
    print(table(keys, [[row[k] for k in keys] for row in rows]))
    print_headline(
        {
            "skipped": False,
            "backend": "nccl" if use_gpu else "gloo",
            "all_ok": all(row["ok"] for row in rows),
            **{f"ok_{row['run']}": row["ok"] for row in rows},
        }
    )


if __name__ == "__main__":
    main()
