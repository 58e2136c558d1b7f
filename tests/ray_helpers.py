"""Helpers shared by the Ray tests: one way to build a small `ElasticTrainer` and to read a run's files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from raytrain.config import BatchConfig, CheckpointConfig, ClusterConfig, LoopConfig, LRConfig
from raytrain.toy import mlp_factory, regression_dataset, sgd, squared_error
from raytrain.trainer import ElasticTrainer

ROWS = 90  # 90 rows at global batch 20: 5 steps per epoch, the last one partial (10 samples)


def make_trainer(
    tmp: Path,
    run: str,
    *,
    workers: int,
    strategy: str = "ddp",
    steps: int | None = None,
    epochs: int = 2,
    every: int = 100,
    audit: bool = False,
    rows: int = ROWS,
    global_batch: int = 20,
    micro_batch: int = 4,
    deterministic: bool = True,
    model_fn: Any = None,
    optimizer_fn: Any = sgd,
    lr: LRConfig | None = None,
    max_grad_norm: float | None = None,
    drop_last: bool = False,
    loss_fn: Any = squared_error,
    max_failures: int = 0,
    **kwargs: Any,
) -> ElasticTrainer:
    """A trainer on the regression toy data with `workers` fixed workers and no retries (a failure fails)."""
    return ElasticTrainer(
        model_fn=model_fn or mlp_factory(8, 16),
        loss_fn=loss_fn,
        optimizer_fn=optimizer_fn,
        datasets={"train": regression_dataset(rows)},
        batch=BatchConfig(global_batch=global_batch, micro_batch=micro_batch, drop_last=drop_last),
        lr=lr or LRConfig(base_lr=0.2, warmup_steps=2),
        loop=LoopConfig(
            epochs=epochs,
            max_steps=steps,
            strategy=strategy,
            audit_samples=audit,
            id_column="id",
            deterministic=deterministic,
            shuffle_buffer=16,
            max_grad_norm=max_grad_norm,
        ),
        checkpoint=CheckpointConfig(storage_path=str(tmp), run_name=run, every_steps=every),
        cluster=ClusterConfig(min_workers=workers, max_workers=workers, max_failures=max_failures),
        required_columns=("x", "y"),
        **kwargs,
    )


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a JSON-lines file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def ids_by_epoch(samples_path: str | Path) -> dict[int, list[int]]:
    """The audited sample ids of every epoch, in training order."""
    by_epoch: dict[int, list[int]] = {}
    for record in read_jsonl(samples_path):
        by_epoch.setdefault(record["epoch"], []).extend(record["ids"])
    return by_epoch
