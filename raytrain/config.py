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
from raytrain.lr_rules import lr_factor, peak_lr, validate_lr_rule, validate_schedule

StrategyName = Literal["auto", "ddp", "zero1", "zero2", "zero3"]
STRATEGIES: tuple[str, ...] = get_args(StrategyName)
RECOVERY_MODES = ("restart", "live")  # ClusterConfig.recovery
Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
GradAccumulation = Literal["auto", "unsharded", "sharded"]
GRAD_ACCUMULATIONS: tuple[str, ...] = get_args(GradAccumulation)
InitMode = Literal["auto", "meta", "full"]
INIT_MODES: tuple[str, ...] = get_args(InitMode)
PPSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
PP_SCHEDULES: tuple[str, ...] = get_args(PPSchedule)  # raytrain.parallel.pipeline.SCHEDULES


def _one_of(name: str, value: Any, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ConfigError(f"{name} must be one of {', '.join(valid)}, got {value!r}")


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
    """The learning rate, fitted to the global batch (never to the world size), and its schedule over the steps.

    Attributes:
        base_lr: an LR known to be right at `base_batch` (> 0).
        base_batch: the global batch at which `base_lr` is right. Default: the global batch of the run's first
            start, which checkpoints keep, so resuming with another global batch rescales the LR by `rule`.
        rule: how the peak LR follows the global batch: "linear", "sqrt" or "none".
        warmup_steps: optimizer steps of linear warmup to the peak LR (>= 0).
        schedule: after warmup, "constant" (the peak), or "cosine" / "linear" decay to `min_lr_ratio` x peak
            at the end of the run (see `raytrain.lr_rules`). Every parameter group's own LR is multiplied by the
            same factor, so groups keep their ratios.
        min_lr_ratio: the decaying schedules' final LR as a fraction of the peak, in [0, 1].
        decay_steps: the steps the decay spans (>= 1); default: the run's total steps (`max_steps`, or the steps
            `epochs` take at the global batch). When a resume with another global batch changes the run's length in
            steps, the schedule continues from where it was and ends with the run (`raytrain.lr_rules.ScheduleClock`).
    """

    base_lr: float
    base_batch: int | None = None
    rule: str = "linear"
    warmup_steps: int = 0
    schedule: str = "constant"
    min_lr_ratio: float = 0.0
    decay_steps: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.base_lr, bool) or not isinstance(self.base_lr, int | float) or not self.base_lr > 0:
            raise ConfigError(f"base_lr must be a number > 0, got {self.base_lr!r}")
        if self.base_batch is not None:
            _int_at_least("base_batch", self.base_batch, 1)
        validate_lr_rule(self.rule)
        _int_at_least("warmup_steps", self.warmup_steps, 0)
        validate_schedule(self.schedule)
        if (
            isinstance(self.min_lr_ratio, bool)
            or not isinstance(self.min_lr_ratio, int | float)
            or not 0.0 <= self.min_lr_ratio <= 1.0
        ):
            raise ConfigError(f"min_lr_ratio must be a number in [0, 1], got {self.min_lr_ratio!r}")
        if self.decay_steps is not None:
            _int_at_least("decay_steps", self.decay_steps, 1)

    def peak_lr(self, global_batch: int, base_batch: int | None = None) -> float:
        """The LR after warmup for `global_batch` under `rule`; `base_batch` (e.g. a checkpoint's) is used when
        the config gives none, else the global batch itself."""
        return peak_lr(self.base_lr, self.base_batch or base_batch or global_batch, global_batch, self.rule)

    def factor(self, step: float, total_steps: int | None) -> float:
        """The LR of schedule step `step` as a fraction of the peak (warmup, then the schedule)."""
        return lr_factor(
            step,
            warmup_steps=self.warmup_steps,
            schedule=self.schedule,
            total_steps=self.decay_steps or total_steps,
            min_lr_ratio=self.min_lr_ratio,
        )


UNBOUNDED_EPOCHS = 2**31 - 1  # `LoopConfig.epoch_limit` when only max_steps bounds the run


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    """How long and how to train.

    Attributes:
        epochs: passes over the training set (>= 1); training stops at whichever of epochs/max_steps comes first.
            None (default): 1 epoch without `max_steps`; with `max_steps`, as many epochs as those steps take (the
            steps asked for are trained). `epoch_limit` is the number in force.
        max_steps: optimizer steps to run in total (>= 1), or None for `epochs` only.
        strategy: "ddp", "zero1" (sharded optimizer state), "zero2" (+ gradients), "zero3" (+ parameters, FSDP
            full shard) or "auto" (the memory planner's choice for the model and devices).
        seed: seeds the model initialisation, the per-epoch sample order and each micro-batch's random ops.
        deterministic: sample order is a function of (seed, epoch) only, independent of the world size, so loss
            curves at different world sizes agree step by step for models without random operations in training;
            dropout and other random ops draw from a generator seeded per micro-batch by its place in the step,
            so they agree too when the micro-batches are cut alike (see `raytrain.rng`). Parquet files
            (`raytrain.ParquetSource` or a path) are read in place, each rank the row groups its samples are in,
            with bounded memory; a `ray.data.Dataset` is materialized once in the object store (it must fit
            there). False streams a `ray.data.Dataset`'s shards with `get_dataset_shard` (any size; the order then
            depends on the world size; needs `id_column`).
        id_column: a column holding a unique integer id per sample (the ids the sample audit and the
            checkpoint's data position use). Without it raytrain numbers the rows itself: Parquet rows by their
            place in the files, a `ray.data.Dataset`'s rows in their order once materialized. Required with
            `deterministic=False`.
        max_grad_norm: clip the gradient of each step's whole global batch to this 2-norm (> 0), as one process
            on one big batch would; None (default) does not clip. The norm is reported as `grad_norm`.
        on_nonfinite: what a step whose loss or gradient is NaN or Inf does (detected on every rank alike, before
            the optimizer step, so the model is untouched): "stop" (default) ends the run naming the step, the last
            good checkpoint stays the latest; "skip" drops the step's update and goes on (counted as
            `skipped_steps` in the metrics; its samples count as seen).
        audit_samples: rank 0 writes the ids of every committed step to `<run>/samples.jsonl`.
        shuffle_buffer: local shuffle buffer (rows) per worker in streaming mode.
        log_every: progress line on rank 0 every this many steps (>= 1).
    """

    epochs: int | None = None
    max_steps: int | None = None
    strategy: str = "ddp"
    seed: int = 0
    deterministic: bool = True
    id_column: str | None = None
    max_grad_norm: float | None = None
    on_nonfinite: str = "stop"
    audit_samples: bool = False
    shuffle_buffer: int = 1024
    log_every: int = 10

    def __post_init__(self) -> None:
        if self.epochs is not None:
            _int_at_least("epochs", self.epochs, 1)
        if self.max_steps is not None:
            _int_at_least("max_steps", self.max_steps, 1)
        _one_of("strategy", self.strategy, STRATEGIES)
        _int_at_least("seed", self.seed, 0)
        if self.max_grad_norm is not None and (
            isinstance(self.max_grad_norm, bool)
            or not isinstance(self.max_grad_norm, int | float)
            or not 0 < self.max_grad_norm < float("inf")
        ):
            raise ConfigError(f"max_grad_norm must be a finite number > 0 or None, got {self.max_grad_norm!r}")
        _one_of("on_nonfinite", self.on_nonfinite, ("stop", "skip"))
        _int_at_least("shuffle_buffer", self.shuffle_buffer, 1)
        _int_at_least("log_every", self.log_every, 1)

    @property
    def epoch_limit(self) -> int:
        """The epochs the run may take: `epochs`, else 1 without `max_steps`, else unbounded (max_steps ends it)."""
        if self.epochs is not None:
            return self.epochs
        return 1 if self.max_steps is None else UNBOUNDED_EPOCHS


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the model is built, sharded and computed, beside the strategy (`LoopConfig.strategy`).

    Attributes:
        init: "full" builds the model whole on every rank (`torch.manual_seed(seed); model_fn()`) and then shards
            it: exactly the model `model_fn` builds. "meta" records `model_fn()` without memory and has each rank
            replay only the operations its shard depends on (`raytrain.model_init`): ties, buffers and the
            model's own init code (`apply(_init_weights)`, `reset_parameters`) are kept, random draws come from
            the same distributions with values of their own; refused, naming the tensor, when a replay cannot
            reproduce the model. "auto" (default): a model of at most 1 GiB of parameters and buffers is
            built "full"; a larger one, or one whose weights a pretrained checkpoint replaces (`init_from`),
            "meta" when the replay reproduces it, else "full"; the choice and its reason are logged. Either way
            the initial weights are the same at every world size, strategy and layout.
        precision: "fp32"; "bf16" computes in bfloat16 with fp32 master weights and fp32 gradient reduction
            (FSDP2's MixedPrecisionPolicy for zero2/zero3, autocast otherwise); "fp16" the same in float16 with
            dynamic loss scaling (ddp and zero1 only: their gradients are whole on every rank).
        grad_accumulation: for zero2/zero3 with accumulation (k > 1): "unsharded" accumulates the full gradient
            and reduce-scatters it once per step (1x gradient communication, the full gradient held while
            accumulating); "sharded" reduce-scatters after every micro-step (k x communication, only the shard
            held); "auto" (default) takes "unsharded" when the worker's memory holds the full gradient beside
            the rest, else "sharded", and logs why. zero2 keeps parameters gathered across micro-steps (ZeRO-2
            holds them whole), zero3 re-gathers them in every micro-step.
        activation_checkpointing: recompute each block's activations in the backward instead of keeping them.
        compile: `torch.compile` each block (needs a C++ compiler on CPU; first steps pay the compilation).
        tp: tensor-parallel degree (>= 1): each block's linear layers are split over `tp` consecutive workers of
            one node (`raytrain.parallel.tensor`; the plan comes from `ElasticTrainer(tp_plan_fn=...)` or the
            model's `tp_plan()`). The workers form dp = W / tp data-parallel replicas; the batch plan, the data
            and elasticity are per replica, so W grows and shrinks in whole replicas (min_workers and max_workers
            must be multiples of tp, and every node must hold a multiple of tp workers). The dp axis runs the
            strategy: ddp (one gradient all-reduce per step), zero2 or zero3 (FSDP2 over dp; 2-D); not zero1.
        pp: pipeline stages (>= 1): the model is cut into `pp` stages of balanced parameter counts between its
            blocks (an `nn.Sequential`, a transformers decoder, a model with `pipeline_split()`:
            `raytrain.parallel.pipeline`), one per worker of a replica, and raytrain's accumulation micro-batches
            flow through them (`pp_schedule`). A replica is tp * pp workers (TP innermost, stages across nodes);
            the same rules as for tp apply to min_workers, max_workers, the strategy and the precision.
            tp and pp may both be "auto": the driver applies `raytrain plan`'s recommendation for the model at
            `min_workers` before any worker starts (`raytrain.parallel.layout`); needs `device_memory_gb` and
            `workers_per_node`.
        pp_schedule: the pipeline's schedule: "gpipe" (default: every micro-batch's forward, then every backward;
            holds all the step's micro-batches' activations), "1f1b" (a forward and a backward in turn once the
            pipeline is full: at most pp micro-batches in flight per stage, the same bubble) or "interleaved_1f1b"
            (Megatron's: each worker holds `pp_chunks` non-adjacent chunks of the model, the bubble about
            `pp_chunks` times smaller, more activations in flight than 1f1b). A schedule other than gpipe needs
            pp > 1 (or "auto", where a layout without a pipeline leaves it off).
        pp_chunks: model chunks per pipeline stage (interleaved_1f1b only; default 2 there, 1 otherwise): the
            model is cut into pp * pp_chunks virtual stages and worker s holds s, s + pp, ...; needs at least that
            many blocks.
        sequence_parallel: with tp > 1, cut the activations between the split layers (residual stream, norms,
            dropout) along the sequence over the tp ranks (Megatron-SP: `raytrain.parallel.sequence`): their memory
            falls by tp, for an all-gather and a reduce-scatter per split pair in place of an all-reduce. Needs the
            model's block list (a transformers decoder, or `pipeline_split()`) with each block's colwise layers in a
            submodule (attention, MLP), and a sequence length divisible by tp.
        device_memory_gb: memory of one worker's device in GB (1e9 bytes), for tp/pp "auto" (> 0).
        workers_per_node: workers one node holds (its GPUs), for tp/pp "auto": a TP group stays inside a node (>= 1).
        dp_shard: data ranks per replica group in live recovery (`ClusterConfig(recovery="live")`, >= 1, default
            1): the group shards the model among them (strategy zero2 or zero3: FSDP2 over the group) and torchft
            replicates across groups (HSDP); with tp > 1 each data rank is tp workers splitting the layers. The
            world is dp_replicate x dp_shard x tp workers and grows and shrinks by whole groups (one node each):
            min_workers and max_workers must be multiples of dp_shard x tp; losing any worker of a group loses
            the group, and the others finish the step with the same global batch. The restart path shards
            zero2/zero3 over every worker and takes dp_shard 1 only.
    """

    init: str = "auto"
    precision: str = "fp32"
    grad_accumulation: str = "auto"
    activation_checkpointing: bool = False
    compile: bool = False
    tp: int | Literal["auto"] = 1
    pp: int | Literal["auto"] = 1
    pp_schedule: str = "gpipe"
    pp_chunks: int | None = None
    sequence_parallel: bool = False
    device_memory_gb: float | None = None
    workers_per_node: int | None = None
    dp_shard: int = 1

    def __post_init__(self) -> None:
        _int_at_least("dp_shard", self.dp_shard, 1)
        for name in ("tp", "pp"):
            value = getattr(self, name)
            if value != "auto" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{name} must be an integer >= 1 or 'auto', got {value!r}")
        if (self.tp == "auto") != (self.pp == "auto"):
            raise ConfigError(
                f"tp and pp are chosen together: set both to 'auto' or both to integers, got tp={self.tp!r}, "
                f"pp={self.pp!r}"
            )
        if self.device_memory_gb is not None and (
            isinstance(self.device_memory_gb, bool)
            or not isinstance(self.device_memory_gb, int | float)
            or not 0 < self.device_memory_gb < float("inf")
        ):
            raise ConfigError(f"device_memory_gb must be a number > 0 or None, got {self.device_memory_gb!r}")
        if self.workers_per_node is not None:
            _int_at_least("workers_per_node", self.workers_per_node, 1)
        if self.tp == "auto":
            for name in ("device_memory_gb", "workers_per_node"):
                if getattr(self, name) is None:
                    raise ConfigError(
                        f"tp/pp 'auto' chooses the layout from the model's size and the devices: set {name} "
                        "(device_memory_gb: memory of one worker's device in GB, e.g. 80; workers_per_node: e.g. 8)"
                    )
        _one_of("init", self.init, INIT_MODES)
        _one_of("precision", self.precision, PRECISIONS)
        _one_of("grad_accumulation", self.grad_accumulation, GRAD_ACCUMULATIONS)
        _one_of("pp_schedule", self.pp_schedule, PP_SCHEDULES)
        if self.pp_chunks is not None:
            interleaved = self.pp_schedule == "interleaved_1f1b"
            _int_at_least("pp_chunks", self.pp_chunks, 2 if interleaved else 1)
            if not interleaved and self.pp_chunks != 1:
                raise ConfigError(
                    f"pp_chunks={self.pp_chunks} needs pp_schedule 'interleaved_1f1b' (the {self.pp_schedule} "
                    "schedule runs one chunk per stage)"
                )
        if self.pp == 1 and self.pp_schedule != "gpipe":  # pp_chunks > 1 implies interleaving (checked above)
            raise ConfigError(
                f"pp_schedule={self.pp_schedule!r} orders the micro-batches of a pipeline: it needs pp > 1, got "
                "pp = 1 (set pp to the pipeline's stage count, or leave pp_schedule and pp_chunks unset)"
            )
        for name in ("activation_checkpointing", "compile", "sequence_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel cuts the activations over the tp ranks: it needs tp > 1, got tp = 1")

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline stage: `pp_chunks`, or its default for the schedule (2 for
        interleaved_1f1b, else 1)."""
        if self.pp_chunks is not None:
            return self.pp_chunks
        return 2 if self.pp_schedule == "interleaved_1f1b" else 1

    @property
    def degrees(self) -> tuple[int, int]:
        """(tp, pp) as integers; `ConfigError` while they are "auto" (resolved on the driver first, by
        `raytrain.parallel.layout.resolve_parallel`)."""
        if self.tp == "auto" or self.pp == "auto":
            raise ConfigError("tp/pp 'auto' is resolved on the driver first (raytrain.parallel.layout)")
        return self.tp, self.pp

    @property
    def replica(self) -> int:
        """Workers per data-parallel replica: tp * pp (resolved)."""
        tp, pp = self.degrees
        return tp * pp

    @property
    def live_group(self) -> int:
        """Workers per replica group of live recovery: dp_shard x tp (resolved; the world grows and shrinks by
        whole groups, each on one node)."""
        return self.dp_shard * self.degrees[0]


def check_whole_replicas(min_workers: int, max_workers: int, global_batch: int, tp: int, pp: int) -> None:
    """The elastic range in whole model-parallel replicas of tp * pp workers: both ends multiples of it, and at
    most `global_batch` replicas (each trains at least one sample). `ConfigError` naming the bad end."""
    replica = tp * pp
    if max_workers // replica > global_batch:
        raise ConfigError(
            f"max_workers must be <= global_batch ({global_batch})"
            + (f" times tp * pp ({replica})" if replica > 1 else "")
            + f", got {max_workers}"
        )
    for name, value in (("min_workers", min_workers), ("max_workers", max_workers)):
        if value % replica:
            raise ConfigError(
                f"{name} must be a multiple of tp * pp ({tp} * {pp} = {replica}): the world grows and shrinks in "
                f"whole model-parallel replicas, got {value}"
            )


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where results go and how often training state is committed.

    Attributes:
        storage_path: where checkpoints go: a local or shared directory (created if missing; must be writable), or
            object storage as a URI pyarrow opens (`s3://bucket/prefix`, `gs://...`; options such as
            `?endpoint_override=host:port&scheme=http` in the URI, credentials from the environment; or pass
            `ElasticTrainer(storage_filesystem=...)`). On a multi-node cluster: shared or object storage.
        run_name: the run directory under `storage_path`; a rerun with the same name resumes from its latest
            checkpoint.
        log_dir: where the run's own files go when `storage_path` is a URI: `<log_dir>/<run_name>` holds
            metrics.jsonl, events.jsonl, samples.jsonl, raytrain.log and the run lock (appended line by line,
            which object storage cannot do). Rank 0 writes the metrics on its node: on a multi-node cluster make
            it a shared directory. Unused for a local `storage_path` (the run directory holds them).
        every_steps: commit a checkpoint every this many optimizer steps, and always at the end (>= 1). At most
            this many steps of work are lost to a failure, plus the steps trained while the latest checkpoint was
            being written and committed (usually one, see `background_save`).
        keep: checkpoints kept (>= 1); older ones are deleted by Ray Train.
        wait_for_commit: have every checkpoint committed by Ray before the next one is written, before a drained
            node is let go and at the end (a background wait; training goes on meanwhile). A failure while the
            latest checkpoint commits (well under a second) restores the one before it. False: never wait.
        background_save: write checkpoint files in a background thread (DCP async save on a gloo group of its
            own): the step that checkpoints only copies this rank's model and optimizer shard to host memory
            (one extra copy of the shard in host RAM while it is written); the checkpoint is reported after the
            first step at whose end every rank's files are written. False: write them before training goes on.
    """

    storage_path: str = "raytrain_runs"
    run_name: str = "run"
    log_dir: str = "raytrain_runs"
    every_steps: int = 50
    keep: int = 2
    wait_for_commit: bool = True
    background_save: bool = True

    def __post_init__(self) -> None:
        if not self.run_name or "/" in self.run_name or self.run_name in (".", ".."):
            raise ConfigError(f"run_name must be a non-empty name without '/', got {self.run_name!r}")
        if not self.is_local and "@" in self.storage_path.split("://", 1)[1].split("?", 1)[0]:
            scheme = self.storage_path.split("://", 1)[0]
            raise ConfigError(  # the value is not echoed: it holds a secret, and checkpoints store the config
                f"storage_path must not hold credentials (a '{scheme}://USER:SECRET@...' URI): put them in the "
                "environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, an instance role) or pass "
                "ElasticTrainer(storage_filesystem=...)"
            )
        if not self.log_dir or "://" in self.log_dir:
            raise ConfigError(f"log_dir must be a local or shared directory, got {self.log_dir!r}")
        _int_at_least("every_steps", self.every_steps, 1)
        _int_at_least("keep", self.keep, 1)

    @property
    def is_local(self) -> bool:
        """True when `storage_path` is a local directory, not a URI such as s3://."""
        return "://" not in self.storage_path

    def run_dir(self) -> str:
        """Absolute path of the run's local directory: its files (metrics, events, log, lock) and, for a local
        `storage_path`, its checkpoints."""
        return os.path.join(os.path.abspath(self.storage_path if self.is_local else self.log_dir), self.run_name)


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """The worker group and how it reacts to membership changes.

    Attributes:
        min_workers: the fewest workers the run trains with (>= 1). Ray Train runs with as many workers as the
            cluster can place in [min_workers, max_workers] and restarts the group when that number changes; a
            cluster that can never place min_workers is refused before any worker starts, when raytrain started
            it (no autoscaler could add nodes).
        max_workers: the most workers (>= min_workers); a local Ray instance raytrain starts declares logical
            CPUs for this many (and one for Ray Data), whatever the machine's cores.
        use_gpu: one GPU per worker (nccl); otherwise CPU workers (gloo).
        resources_per_worker: Ray resources each worker needs, e.g. {"CPU": 1} or {"worker_slot": 1}.
        resize_monitor_interval_s: how often Ray Train checks for room to grow (seconds, >= 0.1).
        max_failures: worker-group failures tolerated before the run fails (-1 = unlimited).
        recovery: "restart" (default): Ray Train restarts the worker group from the last checkpoint after a
            failure or a resize. "live": each worker is a torchft replica group; when one dies the others finish
            the step among themselves with the same global batch and go on, never restarting, and a replacement
            joins with a peer's weights (`raytrain.live`; needs the `live` extra, pp = 1, fp32 or bf16, CPU,
            deterministic mode; a group is `parallel.dp_shard` x `parallel.tp` workers of one node). Below
            min_workers with no room for a replacement it falls back to a restart from its newest checkpoint,
            saying why.
    """

    min_workers: int = 1
    max_workers: int = 2
    use_gpu: bool = False
    resources_per_worker: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    resize_monitor_interval_s: float = 5.0
    max_failures: int = 10
    recovery: str = "restart"

    def __post_init__(self) -> None:
        _one_of("recovery", self.recovery, RECOVERY_MODES)
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
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.parallel.precision == "fp16" and self.loop.strategy in ("zero2", "zero3", "auto"):
            raise ConfigError(
                f"precision 'fp16' needs strategy ddp or zero1 (loss scaling needs whole gradients on every rank), "
                f"got strategy {self.loop.strategy!r}; use precision 'bf16' with zero2/zero3"
            )
        if self.parallel.tp == "auto":
            raise ConfigError(
                "TrainSpec takes a resolved layout: tp/pp 'auto' is chosen by ElasticTrainer / raytrain fit "
                "(raytrain.parallel.layout.resolve_parallel)"
            )
        tp, pp = self.parallel.degrees
        check_whole_replicas(self.cluster.min_workers, self.cluster.max_workers, self.batch.global_batch, tp, pp)
        if tp * pp > 1:
            if self.loop.strategy == "zero1":
                raise ConfigError(
                    "strategy 'zero1' cannot be combined with tp or pp > 1 (ZeroRedundancyOptimizer takes plain "
                    "tensors of the whole model): use ddp, zero2 or zero3"
                )
            if self.parallel.precision == "fp16":
                raise ConfigError("precision 'fp16' is not supported with tp or pp > 1; use precision 'bf16'")

        if self.cluster.recovery == "live":
            check_live(self)
        elif self.parallel.dp_shard != 1:
            raise ConfigError(
                f"parallel.dp_shard={self.parallel.dp_shard} sizes live recovery's replica groups: it needs "
                'ClusterConfig(recovery="live") (the restart path shards zero2/zero3 over every worker: leave '
                "dp_shard at 1)"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form, stored in every checkpoint."""
        return asdict(self)


def check_live(spec: TrainSpec) -> None:
    """What `ClusterConfig(recovery="live")` runs, checked before any worker starts; `ConfigError` naming each
    field otherwise: replica groups of `parallel.dp_shard` x `parallel.tp` workers (pp 1; a group with one data
    rank: strategy ddp or auto, run as ddp, the group holding the whole model, split by tp when tp > 1; more:
    zero2 or zero3 over the group's dp_shard data ranks), min_workers and max_workers multiples of the group,
    fp32 or bf16, CPU workers (gloo), deterministic mode (the step number gives the data position), a local or
    shared storage path."""
    problems = []
    shard = spec.parallel.dp_shard
    tp, pp = spec.parallel.degrees
    group = spec.parallel.live_group
    if pp != 1:
        problems.append(
            f"parallel.pp must be 1 (a replica group is dp_shard x tp workers of one node; pipeline stages are not "
            f"run live), got pp={pp}"
        )
    if shard == 1 and spec.loop.strategy not in ("ddp", "auto"):
        problems.append(
            f"loop.strategy must be 'ddp' or 'auto' with parallel.dp_shard=1 (each replica group holds the whole "
            f"model; set dp_shard > 1 to shard it within replica groups), got {spec.loop.strategy!r}"
        )
    if shard > 1 and spec.loop.strategy not in ("zero2", "zero3"):
        problems.append(
            f"loop.strategy must be 'zero2' or 'zero3' with parallel.dp_shard={shard} (the group shards the model), "
            f"got {spec.loop.strategy!r}"
        )
    size = f"parallel.dp_shard={shard}" if tp == 1 else f"parallel.dp_shard x tp = {shard} x {tp} = {group}"
    for name in ("min_workers", "max_workers"):
        value = getattr(spec.cluster, name)
        if value % group:
            problems.append(
                f"cluster.{name}={value} must be a multiple of {size} (the world grows and shrinks by whole "
                f"replica groups: e.g. {max(group, value - value % group)})"
            )
    if spec.parallel.precision not in ("fp32", "bf16"):
        problems.append(f"parallel.precision must be 'fp32' or 'bf16', got {spec.parallel.precision!r}")
    if spec.cluster.use_gpu:
        problems.append("cluster.use_gpu must be False (live replicas run gloo on CPU; not tried on GPUs)")
    if not spec.loop.deterministic:
        problems.append("loop.deterministic must be True (a replacement finds its data position from the step)")
    if not spec.checkpoint.is_local:
        problems.append(
            f"checkpoint.storage_path must be a local or shared directory (the driver's node writes the live "
            f"checkpoints), got {spec.checkpoint.storage_path!r}"
        )
    if problems:
        raise ConfigError(
            'ClusterConfig(recovery="live") runs replica groups of dp_shard x tp workers: '
            + "; ".join(problems)
            + ' (or use recovery="restart")'
        )
