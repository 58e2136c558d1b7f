"""python benchmarks/input_pipeline.py [--quick] [--reps 2]

Input pipeline: how much of the step time raytrain's loop spends outside the training computation, i.e.
waiting for the next step's data from Ray Data (plus a little bookkeeping), on a Parquet data set the script
writes (64 float32 features as Ray's tensor type, an int64 id, a float32 target; 8 files). ElasticTrainer,
W = 2 CPU workers (gloo), MLP 64 -> 512 -> 512 -> 1, global batch 512 = 2 workers x 4 micro-batches x 64, two
epochs, in both data modes:
    streaming      deterministic=False, id_column="id": every step reads from `get_dataset_shard("train")`
                   (raytrain's exact streaming split + local shuffle buffer) and agrees the step collectively;
    deterministic  deterministic=True (the default): the Parquet set is read and materialized once before the
                   workers start; steps are sliced from in-memory numpy columns (the in-memory baseline).

Method (raytrain exposes no data-wait metric, and this script does not modify raytrain): rank 0 writes one
metrics line per step with "time" (wall clock when the step finished) and "step_time_s" (the step's forward,
backward, gradient sync, optimizer step and loss all-reduce). For consecutive steps,
    wait = (time[s] - time[s-1]) - step_time_s[s]
is everything in the loop between two training computations: fetching and agreeing the step's data
(`source.next_step`), the LR update, the per-step seed and the metrics write. It is therefore an upper bound on
the data wait; the deterministic mode's wait (no Ray Data per step) shows the bookkeeping floor.
    data_wait_fraction = sum(wait) / sum(time[s] - time[s-1])
over the steady state: after the first `skip` steps, without the intervals that contain a checkpoint and
without the first step of the second epoch (each epoch restarts the Ray Data split; that wait is reported
separately in seconds, and a fraction including it is printed too). The headline is the streaming mode's.
A wait fraction does not show CPU contention: on this 2-core machine Ray Data's read and split work runs beside
the training processes and slows the computation itself, so streaming steps/s / deterministic steps/s is
printed as well.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from typing import Any

import numpy as np
import torch
from _common import machine_line, median, print_headline, read_jsonl, start_ray, stop_ray, table
from torch import nn

FEATURES, HIDDEN = 64, 512
WORKERS, MICRO_BATCH, ACCUMULATION = 2, 64, 4
GLOBAL_BATCH = WORKERS * MICRO_BATCH * ACCUMULATION
FILES = 8


def build_model() -> nn.Module:
    """MLP 64 -> 512 -> 512 -> 1 (296,449 parameters)."""
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, 1),
        nn.Flatten(0),
    )


def sgd(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def write_parquet(directory: str, rows: int) -> None:
    """`rows` samples in FILES Parquet files: "id" int64, "x" float32 [FEATURES] (tensor type), "y" float32."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from ray.data.extensions import ArrowTensorArray

    from raytrain.toy import regression_arrays

    arrays = regression_arrays(rows, FEATURES, seed=0)
    os.makedirs(directory, exist_ok=True)
    for part, index in enumerate(np.array_split(np.arange(rows), FILES)):
        table_ = pa.table(
            {
                "id": pa.array(arrays["id"][index]),
                "x": ArrowTensorArray.from_numpy(arrays["x"][index]),
                "y": pa.array(arrays["y"][index]),
            }
        )
        pq.write_table(table_, os.path.join(directory, f"part-{part:02d}.parquet"))


def run(storage: str, data_dir: str, name: str, deterministic: bool, epochs: int, every: int) -> dict[str, Any]:
    import ray.data

    from raytrain.config import BatchConfig, CheckpointConfig, ClusterConfig, LoopConfig, LRConfig
    from raytrain.toy import squared_error
    from raytrain.trainer import ElasticTrainer

    trainer = ElasticTrainer(
        model_fn=build_model,
        loss_fn=squared_error,
        optimizer_fn=sgd,
        datasets={"train": ray.data.read_parquet(data_dir)},
        batch=BatchConfig(global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH),
        lr=LRConfig(base_lr=0.01),
        loop=LoopConfig(epochs=epochs, strategy="ddp", deterministic=deterministic, id_column="id", log_every=10**6),
        checkpoint=CheckpointConfig(storage_path=storage, run_name=name, every_steps=every, keep=2),
        cluster=ClusterConfig(min_workers=WORKERS, max_workers=WORKERS, max_failures=0),
        required_columns=("x", "y"),
    )
    started = time.time()
    result = trainer.fit()
    return {"records": read_jsonl(result.metrics_path), "started": started, "ended": time.time()}


def summarise(run_: dict[str, Any], skip: int, every: int) -> dict[str, float]:
    records = run_["records"]
    steady_wait = steady_total = epoch_wait = epoch_total = 0.0
    waits: list[float] = []
    for prev, cur in zip(records[skip:], records[skip + 1 :], strict=False):
        interval = cur["time"] - prev["time"]
        wait = interval - cur["step_time_s"]
        if prev["step"] % every == 0:  # this interval contains a checkpoint
            continue
        if cur["epoch"] != prev["epoch"]:
            epoch_wait += wait
            epoch_total += interval
            continue
        steady_wait += wait
        steady_total += interval
        waits.append(wait)
    return {
        "steps": len(records),
        "steps_per_s": len(waits) / steady_total if steady_total else float("nan"),
        "step_time_ms": 1000 * median([r["step_time_s"] for r in records[skip:]]),
        "wait_ms": 1000 * median(waits),
        "wait_fraction": steady_wait / steady_total if steady_total else float("nan"),
        "wait_fraction_with_epoch_start": (steady_wait + epoch_wait) / (steady_total + epoch_total)
        if steady_total + epoch_total
        else float("nan"),
        "epoch_start_wait_s": epoch_wait,
        "startup_s": records[0]["time"] - run_["started"] if records else float("nan"),
        "wall_s": run_["ended"] - run_["started"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one short run of each mode (a smoke run)")
    parser.add_argument("--reps", type=int, default=2, help="repetitions of each mode (default 2)")
    args = parser.parse_args()
    if args.quick:  # streaming only (the headline), one epoch
        reps, steps_per_epoch, every, skip, epochs, modes = 1, 15, 100, 3, 1, ["streaming"]
    else:
        reps, steps_per_epoch, every, skip, epochs = args.reps, 60, 50, 10, 2
        modes = ["streaming", "deterministic"]
    rows = steps_per_epoch * GLOBAL_BATCH
    wall = time.perf_counter()
    start_ray()
    print(machine_line())
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="raytrain-bench-") as storage:
        data_dir = os.path.join(storage, "data")
        write_parquet(data_dir, rows)
        for rep in range(reps):
            for mode in modes if rep % 2 == 0 else modes[::-1]:
                run_ = run(storage, data_dir, f"{mode}-{rep}", mode == "deterministic", epochs, every)
                results[mode].append(summarise(run_, skip, every))
                print(f"  done {mode}-{rep}: wait fraction {results[mode][-1]['wait_fraction']:.3f}", flush=True)
    print(machine_line())
    stop_ray()
    print(
        f"\nInput pipeline, W = {WORKERS} CPU workers, Parquet {rows:,} rows x {FEATURES} float32 features in "
        f"{FILES} files, global batch {GLOBAL_BATCH} ({WORKERS} x {ACCUMULATION} x {MICRO_BATCH}), {epochs} epochs "
        f"of {steps_per_epoch} steps, checkpoint every {every} steps, steady state after step {skip}"
    )
    keys = [
        "wait_fraction",
        "wait_fraction_with_epoch_start",
        "epoch_start_wait_s",
        "wait_ms",
        "step_time_ms",
        "steps_per_s",
        "startup_s",
        "wall_s",
    ]
    headers = [
        "mode",
        "run",
        "wait fraction",
        "incl. epoch start",
        "epoch start wait s",
        "wait median ms",
        "step_time_s median ms",
        "steady steps/s",
        "start-up s",
        "run wall s",
    ]
    out_rows: list[list[Any]] = []
    medians: dict[str, dict[str, float]] = {}
    for mode in modes:
        for i, s in enumerate(results[mode]):
            out_rows.append([mode, i, *(s[k] for k in keys)])
        medians[mode] = {k: median([s[k] for s in results[mode]]) for k in keys}
        out_rows.append([mode, "median", *(medians[mode][k] for k in keys)])
    print(table(headers, out_rows))
    ratio = float("nan")
    if "deterministic" in medians:
        ratio = medians["streaming"]["steps_per_s"] / medians["deterministic"]["steps_per_s"]
        print(f"steady-state streaming steps/s / deterministic (in-memory) steps/s = {ratio:.3f}")
    print(
        "goal for the wait fraction: <= 5 %.\n"
        "note: wait = interval between two metrics timestamps minus the step's step_time_s: data fetch and the "
        "collective agreement of the step (streaming), LR update, per-step seed and metrics write; an upper bound "
        "on the data wait. Start-up (before the first step) is not included."
    )
    print(f"wall time {time.perf_counter() - wall:.1f} s")
    print_headline(
        {
            "data_wait_fraction": round(medians["streaming"]["wait_fraction"], 4),
            "data_wait_fraction_with_epoch_start": round(medians["streaming"]["wait_fraction_with_epoch_start"], 4),
            "data_wait_fraction_deterministic": round(medians["deterministic"]["wait_fraction"], 4)
            if "deterministic" in medians
            else None,
            "epoch_start_wait_s_streaming": round(medians["streaming"]["epoch_start_wait_s"], 3),
            "streaming_over_in_memory_steps_per_s": None if math.isnan(ratio) else round(ratio, 3),
            "mode": "streaming (deterministic=False)",
            "reps": reps,
        }
    )


if __name__ == "__main__":
    main()
