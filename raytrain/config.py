"""Keyword-only configuration dataclasses, one per concern, validated when built (before any worker starts).

Every error names the field, the value and the valid range. Derived quantities are methods, e.g.
`BatchConfig.plan(world_size)` and `LRConfig.peak_lr(global_batch)`.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

from raytrain.batch_plan import BatchPlan, plan_batch
from raytrain.errors import ConfigError
from raytrain.lr_rules import peak_lr, validate_lr_rule

StrategyName = Literal["auto", "ddp", "zero1", "zero2", "zero3"]
STRATEGIES: tuple[str, ...] = get_args(StrategyName)


def _int_at_least(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class BatchConfig:
    """The effective batch, fixed by the user, and the per-worker memory cap.

    Attributes:
        global_batch: samples per optimizer step, summed over all workers and micro-steps (>= 1). Stays exactly
            this number at every world size.
        micro_batch: most samples one worker processes in one forward/backward (>= 1).
        drop_last: drop an epoch's final partial global batch instead of training on it (normalised by its
            true size). Default False: every sample of every epoch is used once.
    """

    global_batch: int
    micro_batch: int
    drop_last: bool = False

    def __post_init__(self) -> None:
        _int_at_least("global_batch", self.global_batch, 1)
        _int_at_least("micro_batch", self.micro_batch, 1)

    def plan(self, world_size: int) -> BatchPlan:
        """The batch plan at `world_size` workers (see `raytrain.batch_plan`)."""
        return plan_batch(self.global_batch, self.micro_batch, world_size)


@dataclass(frozen=True, kw_only=True)
class LRConfig:
    """The learning rate, fitted to the global batch (never to the world size).

    Attributes:
        base_lr: an LR known to be right at `base_batch` (> 0).
        base_batch: the global batch at which `base_lr` is right; defaults to the configured global batch.
        rule: how the LR follows the global batch: "linear", "sqrt" or "none".
        warmup_steps: optimizer steps of linear warmup to the peak LR (>= 0).
    """

    base_lr: float
    base_batch: int | None = None
    rule: str = "linear"
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.base_lr, bool) or not isinstance(self.base_lr, int | float) or not self.base_lr > 0:
            raise ConfigError(f"base_lr must be a number > 0, got {self.base_lr!r}")
        if self.base_batch is not None:
            _int_at_least("base_batch", self.base_batch, 1)
        validate_lr_rule(self.rule)
        _int_at_least("warmup_steps", self.warmup_steps, 0)

    def peak_lr(self, global_batch: int) -> float:
        """The LR after warmup for `global_batch` under `rule`."""
        return peak_lr(self.base_lr, self.base_batch or global_batch, global_batch, self.rule)


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    """How long and how to train.

    Attributes:
        epochs: passes over the training set (>= 1); training stops at whichever of epochs/max_steps comes first.
        max_steps: optimizer steps to run in total (>= 1), or None for `epochs` only.
        strategy: "ddp", "zero1" (sharded optimizer state), "zero2" (+ gradients), "zero3" (+ parameters, FSDP
            full shard) or "auto" (the memory planner's choice for the model and devices).
        seed: seeds the model initialisation, the per-epoch sample order and the per-step RNG.
        deterministic: sample order is a function of (seed, epoch) only, independent of the world size, so loss
            curves at different world sizes agree step by step. Needs the training set to fit in the object
            store (it is materialized once). False streams shards with `get_dataset_shard` (any size).
        id_column: a column holding a unique integer id per sample. Without it raytrain numbers the rows itself
            (this materializes the dataset once on the driver).
        audit_samples: rank 0 writes the ids of every committed step to `<run>/samples.jsonl`.
        shuffle_buffer: local shuffle buffer (rows) per worker in streaming mode.
        log_every: progress line on rank 0 every this many steps (>= 1).
    """

    epochs: int = 1
    max_steps: int | None = None
    strategy: str = "ddp"
    seed: int = 0
    deterministic: bool = True
    id_column: str | None = None
    audit_samples: bool = False
    shuffle_buffer: int = 1024
    log_every: int = 10

    def __post_init__(self) -> None:
        _int_at_least("epochs", self.epochs, 1)
        if self.max_steps is not None:
            _int_at_least("max_steps", self.max_steps, 1)
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        _int_at_least("seed", self.seed, 0)
        _int_at_least("shuffle_buffer", self.shuffle_buffer, 1)
        _int_at_least("log_every", self.log_every, 1)


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where results go and how often training state is committed.

    Attributes:
        storage_path: a local directory (created if missing; must be writable) or a URI Ray Train accepts.
        run_name: the run directory under `storage_path`; a rerun with the same name resumes from its latest
            checkpoint.
        every_steps: commit a checkpoint every this many optimizer steps, and always at the end (>= 1). At most
            this many steps of work are lost to a failure.
        keep: checkpoints kept (>= 1); older ones are deleted by Ray Train.
        wait_for_commit: after each checkpoint, block until Ray has committed it, so a restart always restores
            the latest one (costs a few seconds per checkpoint).
    """

    storage_path: str = "raytrain_runs"
    run_name: str = "run"
    every_steps: int = 50
    keep: int = 2
    wait_for_commit: bool = True

    def __post_init__(self) -> None:
        if not self.run_name or "/" in self.run_name or self.run_name in (".", ".."):
            raise ConfigError(f"run_name must be a non-empty name without '/', got {self.run_name!r}")
        _int_at_least("every_steps", self.every_steps, 1)
        _int_at_least("keep", self.keep, 1)

    @property
    def is_local(self) -> bool:
        """True when `storage_path` is a local directory, not a URI such as s3://."""
        return "://" not in self.storage_path

    def run_dir(self) -> str:
        """Absolute path of the run directory (local storage only)."""
        return os.path.join(os.path.abspath(self.storage_path), self.run_name)


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """The worker group and how it reacts to membership changes.

    Attributes:
        min_workers / max_workers: the elastic range (1 <= min <= max). Ray Train runs with as many workers as
            the cluster can place in this range and restarts the group when that number changes.
        use_gpu: one GPU per worker (nccl); otherwise CPU workers (gloo).
        resources_per_worker: Ray resources each worker needs, e.g. {"CPU": 1} or {"worker_slot": 1}.
        resize_monitor_interval_s: how often Ray Train checks for room to grow (seconds, >= 0.1).
        max_failures: worker-group failures tolerated before the run fails (-1 = unlimited).
    """

    min_workers: int = 1
    max_workers: int = 2
    use_gpu: bool = False
    resources_per_worker: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    resize_monitor_interval_s: float = 5.0
    max_failures: int = 10

    def __post_init__(self) -> None:
        _int_at_least("min_workers", self.min_workers, 1)
        _int_at_least("max_workers", self.max_workers, 1)
        if self.min_workers > self.max_workers:
            raise ConfigError(
                f"min_workers must be <= max_workers, got min_workers={self.min_workers} > "
                f"max_workers={self.max_workers}"
            )
        for name, amount in self.resources_per_worker.items():
            if not isinstance(amount, int | float) or amount < 0:
                raise ConfigError(f"resources_per_worker[{name!r}] must be a number >= 0, got {amount!r}")
        if not self.resize_monitor_interval_s >= 0.1:
            raise ConfigError(
                f"resize_monitor_interval_s must be >= 0.1 seconds, got {self.resize_monitor_interval_s!r}"
            )
        if isinstance(self.max_failures, bool) or not isinstance(self.max_failures, int) or self.max_failures < -1:
            raise ConfigError(f"max_failures must be an integer >= -1 (-1 = unlimited), got {self.max_failures!r}")


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """Everything a worker needs besides the user's functions; built and checked on the driver."""

    batch: BatchConfig
    lr: LRConfig
    loop: LoopConfig
    checkpoint: CheckpointConfig
    cluster: ClusterConfig

    def __post_init__(self) -> None:
        if self.cluster.max_workers > self.batch.global_batch:
            raise ConfigError(
                f"max_workers must be <= global_batch ({self.batch.global_batch}), got {self.cluster.max_workers}"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form, stored in every checkpoint."""
        return asdict(self)
