"""python benchmarks/checkpoint_cost.py [--quick] [--reps 3] [--only none,background]

What checkpoints cost a run whose steps are real compute: raytrain's ElasticTrainer at a fixed W = 2 (CPU
workers, gloo), an MLP 64 -> 2048 -> 2048 -> 2048 -> 1 (8.5 M parameters; with SGD momentum a checkpoint holds
68 MB), global batch 1024 in micro-batches of 128: about 0.3-0.6 s of matrix multiplies per step on this machine, no
sleep. Four runs, alternated per repetition, each 60 steps on a Ray dataset in deterministic mode:
    none         no checkpoint before the end (every_steps above the run's length): the baseline;
    background   a checkpoint every 10 steps, raytrain's default: the step that checkpoints copies the state to
                 host memory, a thread writes the files (DCP async save on a gloo group of its own), the
                 checkpoint is reported once every rank has written its files;
    sync         the same, written on the training thread (`CheckpointConfig(background_save=False)`);
    control      "none" again: two runs of identical settings, whose difference is the machine's noise.
Measured from rank 0's metrics.jsonl (the "time" each step finished), steps 11-60 (50 intervals: checkpoints at
steps 10, 20, 30, 40 and 50 fall inside; the one at step 60 ends the run and is not counted):
    checkpoint_overhead_fraction   (wall time of those steps with background checkpoints - without) / without,
                                   the median over repetitions (min and max across `run_all.py`'s runs);
    ..._sync                       the same for sync;
    checkpoint_control_fraction    the same for control: what the fraction reads when checkpoints cost nothing;
    checkpoint_stall_s             the training thread's time in checkpoint work per checkpoint (raytrain's own
                                   `checkpoint_stall_s` field: the copy to host memory, the report, a wait for
                                   the previous commit), the median over the run's checkpoints;
    checkpoint_bytes               the size of a real checkpoint directory of the run.
On this 2-core machine the two workers use both cores for the matrix multiplies, so the background write (pickling
and writing 68 MB) competes with them for CPU; the stall is what the training thread itself spends. On a node
whose workers have cores to spare (or GPUs, where the compute is not on the CPU), the write overlaps the steps.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import torch
from _common import first_rep, machine_line, median, print_headline, read_jsonl, start_ray, stop_ray, table
from torch import nn

FEATURES, HIDDEN = 64, 2048
GLOBAL_BATCH, MICRO_BATCH, WORKERS = 1024, 128, 2
STEPS, EVERY, SKIP = 60, 10, 10
MODES = {"none": (10**6, True), "background": (EVERY, True), "sync": (EVERY, False), "control": (10**6, True)}


def build_model() -> nn.Module:
    """MLP 64 -> 2048 -> 2048 -> 2048 -> 1 (8,536,065 parameters)."""
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, 1),
        nn.Flatten(0),
    )


def sgd(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def run(storage: str, name: str, steps: int, every: int, background: bool) -> dict[str, Any]:
    """One fixed-W run; returns rank 0's metrics records and the bytes of its last checkpoint directory."""
    from raytrain.config import BatchConfig, CheckpointConfig, ClusterConfig, LoopConfig, LRConfig
    from raytrain.toy import regression_dataset, squared_error
    from raytrain.trainer import ElasticTrainer

    trainer = ElasticTrainer(
        model_fn=build_model,
        loss_fn=squared_error,
        optimizer_fn=sgd,
        datasets={"train": regression_dataset(GLOBAL_BATCH * steps, FEATURES, seed=0)},
        batch=BatchConfig(global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH),
        lr=LRConfig(base_lr=0.01),
        loop=LoopConfig(epochs=1, max_steps=steps, strategy="ddp", seed=0, id_column="id", log_every=10**6),
        checkpoint=CheckpointConfig(
            storage_path=storage, run_name=name, every_steps=every, keep=2, background_save=background
        ),
        cluster=ClusterConfig(min_workers=WORKERS, max_workers=WORKERS, max_failures=0),
        required_columns=("x", "y"),
    )
    result = trainer.fit()
    size = 0.0
    if result.checkpoint is not None:
        with result.checkpoint.as_directory() as directory:
            size = float(sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(directory) for f in fs))
    return {"records": read_jsonl(result.metrics_path), "bytes": size}


def summarise(found: dict[str, Any], skip: int) -> dict[str, float]:
    """Wall time of steps skip+1 .. end (from the step before), the median step interval, and the median stall
    per checkpoint (lines whose `checkpoint_stall_s` is above 0: the line after a checkpoint, and the line
    reporting it)."""
    records = found["records"]
    times = [r["time"] for r in records]
    intervals = [b - a for a, b in zip(times[skip - 1 : -1], times[skip:], strict=True)]
    stalls = [r.get("checkpoint_stall_s", 0.0) for r in records[skip:]]
    checkpoints = sum(1 for r in records[skip - 1 : -1] if r["step"] % EVERY == 0)
    return {
        "wall_s": sum(intervals),
        "median_step_s": median(intervals),
        "stall_per_checkpoint_s": sum(stalls) / checkpoints if checkpoints else 0.0,
        "bytes": found["bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repetition of 25 steps (a smoke run)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each run (default 3)")
    parser.add_argument("--only", default=",".join(MODES), help='runs, "none" among them (default: all four)')
    args = parser.parse_args()
    modes = {mode: MODES[mode] for mode in MODES if mode in args.only.split(",")}
    if "none" not in modes or set(args.only.split(",")) - set(MODES):
        parser.error(f"--only takes none and any of background,sync,control; got {args.only!r}")
    reps, steps = (1, 25) if args.quick else (args.reps, STEPS)
    wall = time.perf_counter()
    start_ray()
    print(machine_line(), flush=True)
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(prefix="raytrain-bench-ckpt-") as storage:
        for rep in range(reps):
            order = list(modes) if (first_rep() + rep) % 2 == 0 else list(modes)[::-1]
            for mode in order:
                every, background = modes[mode]
                found = run(storage, f"{mode}-{rep}", steps, every, background)
                results[mode].append(summarise(found, SKIP))
                print(f"  done {mode} rep {rep}: {results[mode][-1]}", flush=True)
    print(machine_line())
    stop_ray()
    fractions = {
        mode: [(r["wall_s"] - b["wall_s"]) / b["wall_s"] for r, b in zip(results[mode], results["none"], strict=True)]
        for mode in ("background", "sync", "control")
        if mode in results
    }
    print(
        f"\nCheckpoint cost: MLP 64 -> {HIDDEN} x3 -> 1, W = {WORKERS}, global batch {GLOBAL_BATCH}, steps "
        f"{SKIP + 1}-{steps}, a checkpoint every {EVERY} steps"
    )
    rows = []
    for mode, runs in results.items():
        for i, r in enumerate(runs):
            extra = fractions[mode][i] if mode in fractions else 0.0
            rows.append(
                [mode, i, r["wall_s"], r["median_step_s"], extra, r["stall_per_checkpoint_s"], r["bytes"] / 1e6]
            )
    print(table(["run", "rep", "wall s", "median step s", "overhead", "stall s / checkpoint", "checkpoint MB"], rows))
    print("goal: checkpoint_overhead_fraction <= 0.05 (every 10 steps, steps of >= 0.3 s of compute)")
    print(f"wall time {time.perf_counter() - wall:.1f} s")
    headline: dict[str, Any] = {
        f"checkpoint_{name}": round(median(fractions[mode]), 4)
        for name, mode in (
            ("overhead_fraction", "background"),
            ("overhead_fraction_sync", "sync"),
            # "none" run twice (A/A): the fraction between two runs of identical settings, the noise floor
            ("control_fraction", "control"),
        )
        if mode in fractions
    }
    headline |= {
        name: round(median([r["stall_per_checkpoint_s"] for r in results[mode]]), 4)
        for name, mode in (("checkpoint_stall_s", "background"), ("checkpoint_stall_s_sync", "sync"))
        if mode in results
    }
    headline["checkpoint_step_s"] = round(median([r["median_step_s"] for r in results["none"]]), 4)
    if "background" in results:
        headline["checkpoint_bytes"] = median([r["bytes"] for r in results["background"]])
    print_headline(headline)


if __name__ == "__main__":
    main()
