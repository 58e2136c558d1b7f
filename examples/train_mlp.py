"""Train a small MLP regressor on Parquet files with raytrain's ElasticTrainer (CPU workers, gloo).

    python examples/train_mlp.py [--workers 2] [--steps N] [--storage DIR] [--strategy ddp|zero1|zero2|zero3|auto]
    python examples/train_mlp.py --recovery live     # pip install -e '.[live]': a lost worker is replaced live

With RAY_ADDRESS set it joins that cluster; otherwise it starts a local Ray instance. The run goes to
<storage>/<run-name> (default ./raytrain_runs/mlp): metrics.jsonl (one line per optimizer step), samples.jsonl
(the sample ids of every step), events.jsonl (one line per start of the worker group) and the checkpoints.
Running the same command again resumes from the latest checkpoint there (pass a larger --steps to train
further, or another --run-name to start over).

Reads top to bottom: write a synthetic data set as Parquet, read it back with Ray Data, describe the model,
the per-sample loss and the optimizer as plain functions, fix the global batch and the LR rule, train, and
report from the metrics file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn

from raytrain.config import STRATEGIES, BatchConfig, CheckpointConfig, ClusterConfig, LoopConfig, LRConfig
from raytrain.trainer import ElasticTrainer, connect_ray

FEATURES = 16


# --- The data: a noisy nonlinear regression problem, written as Parquet files ---------------------------------
def write_parquet_dataset(directory: str, rows: int, files: int = 4, seed: int = 0) -> None:
    """Write `rows` samples as `files` Parquet files: "id" (int64), "x" (float32 [FEATURES]) and "y" (float32)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from ray.data.extensions import ArrowTensorArray

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    w1, w2 = rng.normal(size=FEATURES) / math.sqrt(FEATURES), rng.normal(size=FEATURES) / math.sqrt(FEATURES)
    y = (np.tanh(2 * x @ w1) + 0.5 * np.sin(3 * x @ w2) + 0.1 * rng.normal(size=rows)).astype(np.float32)
    os.makedirs(directory, exist_ok=True)
    for part, rows_of_part in enumerate(np.array_split(np.arange(rows), files)):
        table = pa.table(
            {
                # raytrain: a unique integer id per sample. The epoch order, the data position saved in each
                # checkpoint and the sample audit (samples.jsonl) refer to samples by this id, so "every sample
                # exactly once per epoch" can be checked, whatever the world size did meanwhile.
                "id": pa.array(rows_of_part.astype(np.int64)),
                # The feature vectors as Ray's tensor extension type, so they come back as a float32 [n, 16]
                # array. (A plain fixed_size_list column would arrive as an object array, and raytrain passes
                # only numeric columns to loss_fn.)
                "x": ArrowTensorArray.from_numpy(x[rows_of_part]),
                "y": pa.array(y[rows_of_part]),
            }
        )
        pq.write_table(table, os.path.join(directory, f"part-{part:03d}.parquet"))


# --- What every worker runs: model, per-sample loss, optimizer ---------------------------------------------
# Module-level functions (and partials of them): Ray pickles them and ships them to every worker.
def build_mlp(features: int, hidden: int) -> nn.Module:
    """The model. raytrain calls this in each worker after torch.manual_seed(seed): equal weights on every rank."""
    return nn.Sequential(
        nn.Linear(features, hidden),
        nn.GELU(),
        nn.Linear(hidden, hidden),
        nn.GELU(),
        nn.Linear(hidden, 1),
        nn.Flatten(0),
    )


def per_sample_squared_error(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """raytrain's loss contract: one loss per sample, shape [n]. raytrain sums them over the micro-batches of
    all workers and divides by the global batch, so the gradient is the mean over exactly `global_batch`
    samples at every world size (a mean inside loss_fn would weight micro-batches of unequal size wrongly)."""
    return (model(batch["x"]) - batch["y"]) ** 2


def adamw(params: Any, lr: float) -> torch.optim.Optimizer:
    """raytrain calls optimizer_fn(params, lr=...) with the peak LR from LRConfig; it sets the LR every step."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="training workers, 1 CPU each (default 2)")
    parser.add_argument(
        "--min-workers", type=int, default=None, help="allow the run to shrink to this many workers (default: fixed)"
    )
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps in total (default 60)")
    parser.add_argument("--storage", default="raytrain_runs", help="runs (and the data) go here")
    parser.add_argument("--run-name", default="mlp", help="run directory under --storage; reusing it resumes")
    parser.add_argument("--strategy", default="ddp", choices=STRATEGIES, help="ddp or ZeRO stage (default ddp)")
    parser.add_argument("--rows", type=int, default=4000, help="samples in the synthetic data set")
    parser.add_argument("--global-batch", type=int, default=128, help="samples per optimizer step, all workers")
    parser.add_argument(
        "--recovery",
        default="restart",
        choices=["restart", "live"],
        help="restart: Ray Train restarts the group from the latest checkpoint after a failure (default); live: "
        "each worker is a torchft replica group, the others finish the step with the same batch and go on",
    )
    args = parser.parse_args()

    import ray

    # Join RAY_ADDRESS's cluster (checked to answer within seconds), or start a local Ray instance of our own
    # (never the cluster another process started on this machine): each worker takes one CPU, two more are left
    # for Ray Data and the Ray Train controller. Ray's own output stays in its log files unless RAYTRAIN_VERBOSE=1.
    connect_ray(local_cpus=max(4, args.workers + 2))

    data_dir = os.path.join(os.path.abspath(args.storage), "data", "regression")
    write_parquet_dataset(data_dir, args.rows)
    dataset = ray.data.read_parquet(data_dir)

    # The global batch is the one batch number: samples per optimizer step, summed over workers and
    # micro-steps. raytrain keeps it fixed when workers join or leave and re-splits it as
    # world size x micro-batches x accumulation steps, so the optimisation (and the LR) ignores the cluster size.
    # micro_batch only caps what one worker processes per forward/backward (memory): at 2 workers, each rank
    # takes 64 samples per step in 2 micro-steps of 32; at 1 worker, 4 micro-steps.
    batch = BatchConfig(global_batch=args.global_batch, micro_batch=32)
    # The LR is fitted to the global batch, never to the world size: 3e-3 is right at batch 64, and the "sqrt"
    # rule (suited to Adam) scales it to the configured batch, reached after 5 steps of linear warmup.
    lr = LRConfig(base_lr=3e-3, base_batch=64, rule="sqrt", warmup_steps=5)
    steps_per_epoch = math.ceil(args.rows / args.global_batch)  # each epoch's last step holds the remainder
    loop = LoopConfig(
        epochs=math.ceil(args.steps / steps_per_epoch),
        max_steps=args.steps,
        strategy=args.strategy,  # ddp; zero1 shards optimizer state; zero2 + gradients; zero3 + parameters
        seed=0,  # seeds the weights and the per-epoch sample order, which is the same at any world size
        id_column="id",  # the Parquet column holding the unique sample ids (see write_parquet_dataset)
        audit_samples=True,  # rank 0 writes the ids of every step to samples.jsonl
        log_every=10,
    )
    # A checkpoint every 20 steps (and at the end) bounds the work lost to a failure or a resize: Ray Train
    # restarts the whole worker group and every worker resumes from the latest checkpoint. Saving is
    # collective: every rank writes its shard (DCP) and calls ray.train.report, which is also a barrier, so all
    # ranks report the same number of times; rank 0 adds the data position and the batch plan.
    checkpoint = CheckpointConfig(storage_path=args.storage, run_name=args.run_name, every_steps=20, keep=2)
    # min_workers < max_workers makes the run elastic: Ray Train starts with as many workers as fit and
    # restarts the group from the latest checkpoint whenever that number changes. With recovery="live" nothing
    # restarts when a worker dies: the others train the same step's global batch among themselves and go on, a
    # replacement copies the weights from a peer (data parallel, CPU, deterministic mode; see the README).
    cluster = ClusterConfig(
        min_workers=args.min_workers or args.workers,
        max_workers=args.workers,
        max_failures=3,
        recovery=args.recovery,
    )

    trainer = ElasticTrainer(
        model_fn=partial(build_mlp, FEATURES, 64),
        loss_fn=per_sample_squared_error,
        optimizer_fn=adamw,
        datasets={"train": dataset},
        batch=batch,
        lr=lr,
        loop=loop,
        checkpoint=checkpoint,
        cluster=cluster,
        # Checked on the driver before any worker starts: a missing column fails here, naming the columns.
        required_columns=("x", "y"),
    )
    result = trainer.fit()  # blocks; survives worker failures and resizes up to max_failures

    # Only rank 0 writes metrics.jsonl, one line per optimizer step (lines of steps replayed after a restart
    # are replaced, so the file describes one history).
    metrics = read_jsonl(result.metrics_path)
    print(f"metrics:    {result.metrics_path}")
    print(f"checkpoint: {result.checkpoint.path if result.checkpoint else None}")
    if metrics:
        first, last = metrics[0], metrics[-1]
        print(
            f"steps {len(metrics)}: loss {first['loss']:.4f} at step {first['step']} -> {last['loss']:.4f} at step "
            f"{last['step']} (world size {last['world_size']}, {last['accumulation_steps']} micro-steps per rank)"
        )
    if result.samples_path and os.path.exists(result.samples_path):
        # The audit: every id at most once per epoch, and a full epoch uses all of them.
        by_epoch: dict[int, list[int]] = {}
        for record in read_jsonl(result.samples_path):
            by_epoch.setdefault(record["epoch"], []).extend(record["ids"])
        for epoch, ids in sorted(by_epoch.items()):
            print(f"epoch {epoch}: {len(ids)} samples, {len(set(ids))} distinct ids")
    ray.shutdown()


if __name__ == "__main__":
    main()
