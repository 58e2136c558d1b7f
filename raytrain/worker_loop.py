"""The loop every Ray Train worker runs. Ray Train restarts it from the top on every resize or failure.

At each (re)start `start_run` reads the world size, computes the batch plan for it, builds and wraps the model,
restores the latest checkpoint (model, optimizer, step, data position, LR base) and logs the resize line on
rank 0; everything it builds is one typed `Run`. The step loop then reads in a few lines.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import posixpath
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from raytrain import faults
from raytrain.agreement import AgreementClock
from raytrain.batch_plan import BatchPlan
from raytrain.checkpoint import PendingSave, TrainState, checkpoint_group, finish_save, load_checkpoint, start_save
from raytrain.checkpoint_files import (
    read_step,
    remove_uncommitted,
    restore_candidates,
    verify,
)
from raytrain.collectives import all_gather_objects, all_reduce_sum
from raytrain.config import TrainSpec
from raytrain.data.id_ranges import IdRanges
from raytrain.data.materialized import ColumnData, IndexedData, IndexedSteps, StepData, run_total_steps, to_tensors
from raytrain.data.parquet import ParquetIndex, ParquetSteps
from raytrain.data.streaming import StreamingSteps
from raytrain.errors import DamagedCheckpointsError, NonFiniteError, OutOfMemory
from raytrain.failures import mark, out_of_memory
from raytrain.faults import fault_point
from raytrain.lr_rules import ScheduleClock, describe_lr_on_resume, describe_schedule_on_resume
from raytrain.model_init import InitTrace, record_build, refuse_lazy
from raytrain.model_record import model_record
from raytrain.model_tensors import tie_aliases
from raytrain.optim import OptimizerFactory, build_optimizer, lr_ratios, set_lr
from raytrain.parallel.apply import SYNC_LAST_MICRO_STEP, StepPolicy, UnitsFn, apply_parallelism, step_policy
from raytrain.parallel.dims import ParallelDims, check_tp_within_nodes
from raytrain.parallel.pipeline import pipeline_step, stage_ties
from raytrain.parallel.strategy import resolve_layout
from raytrain.parallel.tensor import TPPlanFn, plan_of
from raytrain.rank0 import Rank0Log
from raytrain.ray_hooks import preemption_deadline_ms
from raytrain.rng import MicroBatchSeeds
from raytrain.step import Step, StepResult, train_step
from raytrain.storage import node_local_copy

StepSource = ParquetSteps | IndexedSteps | StreamingSteps

__all__ = ["Run", "Step", "StepResult", "WorkerJob", "start_run", "steps", "train_step"]

LossFn = Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
LRScheduleFn = Callable[[int, int], float]
Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class WorkerJob:
    """What the driver hands every worker (inside Ray Train's `train_loop_config` as `{"job": ...}`)."""

    spec: TrainSpec
    run_dir: str | None
    model_fn: Callable[[], nn.Module]
    loss_fn: LossFn
    optimizer_fn: OptimizerFactory
    lr_schedule_fn: LRScheduleFn | None = None
    units_fn: UnitsFn | None = None
    tp_plan_fn: TPPlanFn | None = None
    trackers: tuple[Any, ...] = ()  # experiment trackers (`raytrain.trackers`), used on rank 0
    meta_init: bool = False  # decided on the driver (`raytrain.model_init.choose_init`)
    pretrained: Any = None  # `raytrain.pretrained.Pretrained`: the weights to start from (checked on the driver)
    data: ParquetIndex | IndexedData | ColumnData | None = (
        None  # a ParquetSource's partition, or deterministic mode's data
    )
    val_data: IndexedData | None = None
    empty_batch: dict[str, np.ndarray] | None = None  # streaming mode: zero-row columns
    resume_from: str | None = None  # a newer checkpoint than Ray Train's latest: the newest live one
    conditional_modules: tuple[str, ...] = ()  # called on some forwards only: never FSDP units (`parallel.idle`)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loss_fn: LossFn,
    columns: dict[str, np.ndarray],
    rank: int,
    world_size: int,
    micro_batch: int,
    device: torch.device,
    policy: StepPolicy = SYNC_LAST_MICRO_STEP,
) -> float:
    """Mean per-sample loss over a validation set (collective). Replica r of `world_size` takes rows r, r+W, ...
    (`rank` and `world_size` count data-parallel replicas; `policy` says which ranks' sums count and whether the
    forward is a pipeline's); every rank runs the same number of forwards (some on empty batches), because the
    forwards of FSDP, tensor and pipeline parallelism need all ranks."""
    rows = len(next(iter(columns.values())))
    mine = np.arange(rank, rows, world_size)
    largest_share = math.ceil(rows / world_size)
    chunks = max(1, math.ceil(largest_share / micro_batch))
    was_training = model.training
    model.eval()
    total = 0.0
    for j in range(chunks):
        picked = mine[j * micro_batch : (j + 1) * micro_batch]
        batch = to_tensors({k: v[picked] for k, v in columns.items()}, device)
        if policy.pipeline is not None:
            total += pipeline_step(model, [batch], loss_fn, 1.0, policy.pipeline, device, backward=False)
        else:
            total += float(loss_fn(model, batch).sum())
    model.train(was_training)
    return all_reduce_sum(total if policy.counts_loss else 0.0) / rows


def _device(use_gpu: bool, local_rank: int) -> torch.device:
    """The device of this worker, from its LOCAL rank (the global rank is wrong beyond one node)."""
    if use_gpu:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


@dataclass
class Run:
    """The typed state of one worker-group start: built once by `start_run`, then advanced step by step by `steps`."""

    job: WorkerJob
    rank: int
    world: int
    dims: ParallelDims  # the layout: dp replicas of tp workers (dims.dp is what the batch plan is computed for)
    replica: int  # this rank's data-parallel replica (its index in the batch plan)
    stage: int  # this rank's pipeline stage (0 without pipeline parallelism)
    device: torch.device
    plan: BatchPlan
    strategy: str
    policy: StepPolicy
    scaler: torch.amp.GradScaler | None
    model: nn.Module
    optimizer: torch.optim.Optimizer
    lr_ratios: list[float]  # each parameter group's LR relative to the peak
    peak_lr: float
    base_batch: int  # the global batch at which base_lr is right (config, else checkpoint, else this run's)
    source: StepSource
    val_columns: dict[str, np.ndarray] | None
    log: Rank0Log
    state: TrainState
    restored: bool
    total_steps: int | None  # the run's length in steps, when known (deterministic mode, or max_steps)
    clock: ScheduleClock  # optimizer step -> schedule step (continuous across a resume with another global batch)
    saves: Any = None  # the process group of background checkpoint writes (None: written on the training thread)
    pending: PendingSave | None = None  # a checkpoint being written; reported once every rank has written it
    commit: PendingCommit = field(default_factory=lambda: PendingCommit())
    restored_from: tuple[str, Any] | None = None  # the checkpoint this start restored: (path, pyarrow filesystem)
    extras: dict[str, Any] = field(default_factory=dict)  # the user's own state in every checkpoint (`Session.track`)
    user_metrics: dict[str, Any] = field(default_factory=dict)  # added to the current step's line (`Session.report`)
    checkpoint_stall_s: float = 0.0  # the training thread's time in checkpoints since the last metrics line
    agreement: AgreementClock = field(default_factory=AgreementClock)  # when the ranks next agree (`_agreement`)
    model_record: dict[str, Any] = field(default_factory=dict)  # in every checkpoint (`raytrain.model_record`)

    @property
    def spec(self) -> TrainSpec:
        """The run's validated configuration."""
        return self.job.spec

    def lr_at(self, step: int) -> float:
        """The LR of optimizer step `step` (`scheduled_lr` on this run's peak and clock)."""
        return scheduled_lr(self.job, self.peak_lr, self.clock, step)


def scheduled_lr(job: WorkerJob, peak_lr: float, clock: ScheduleClock, step: int) -> float:
    """The peak-relative LR of optimizer step `step` times `peak_lr`: the user's schedule hook (given the step and
    the run's length now), or warmup and the configured schedule at the step's schedule position (`clock`).
    Depends on the step and the global batch only; both recovery modes' loops take it from here."""
    if job.lr_schedule_fn is not None:  # the optimizer step and the run's length now, both integers
        length = clock.end if clock.end is not None else clock.total
        return peak_lr * float(job.lr_schedule_fn(step, length or 0))
    return peak_lr * job.spec.lr.factor(clock.position(step), clock.total)


def build_model(job: WorkerJob) -> tuple[nn.Module, InitTrace | None]:
    """The user's model and how to initialise it: on the meta device with the trace of its construction when the
    driver chose the sharded build (each rank then materializes only its shard, `raytrain.model_init`), else whole
    on the CPU after `torch.manual_seed(seed)` with no trace; the same weights at every W either way."""
    if job.meta_init:
        built = record_build(job.model_fn)
        return built.model, built.trace
    torch.manual_seed(job.spec.loop.seed)
    model = job.model_fn()
    refuse_lazy(model)  # the own loop's first check of model_fn (ElasticTrainer's driver checked it already)
    return model, None


def _run_dir_of(checkpoint_path: str) -> str:
    """The run directory holding a checkpoint directory (Ray Train keeps them side by side)."""
    return posixpath.dirname(checkpoint_path.rstrip("/"))


def _intact_since(checkpoint: Any, step: int) -> bool:
    """Whether Ray's latest committed `checkpoint` (a `ray.train.Checkpoint`, or None), or one before it, is intact
    (`verify`) and at `step` or later: a checkpoint of the restart path to resume from instead of a live one."""
    if checkpoint is None:
        return False
    for path in restore_candidates(checkpoint.path, checkpoint.filesystem):
        try:
            if read_step(path, checkpoint.filesystem) < step:
                return False  # the candidates go back in steps: none later is left
        except (OSError, ValueError):
            continue
        if verify(path, checkpoint.filesystem) is None:
            return True
    return False


def _restore(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    log: Rank0Log,
    aliases: dict[str, list[str]] | None = None,
    resume_from: str | None = None,
) -> tuple[TrainState, IdRanges, tuple[str, Any] | None]:
    """The newest intact checkpoint loaded into `model` and `optimizer` (collective): (state, consumed ids, its
    (path, filesystem)), or a fresh state and None when there is none. `aliases`: the tied parameters' other names
    (`raytrain.checkpoint.load_checkpoint`).

    First rank 0 removes what Ray never committed (directories newer than Ray's latest checkpoint). A damaged
    checkpoint (a file missing or cut short: `verify`) is skipped with one warning naming it, and stays in storage
    (Ray deletes it in its turn); when every one is damaged, `DamagedCheckpointsError` stops the run (never a
    partial load). Every rank sees the same files, so every rank chooses the same checkpoint. On object storage
    the chosen checkpoint is downloaded once per node (`node_local_copy`). `resume_from` (a whole live checkpoint,
    local, chosen by the driver: `raytrain.trainer.cross_mode_resume`) is loaded instead when it is at a later step
    than every intact checkpoint of Ray's."""
    import ray
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if resume_from is not None and not _intact_since(checkpoint, read_step(resume_from)):
        return (*load_checkpoint(resume_from, model, optimizer, aliases), (resume_from, None))
    if checkpoint is None:
        return TrainState(), IdRanges(), None
    fs, latest = checkpoint.filesystem, checkpoint.path
    candidates = restore_candidates(latest, fs)
    if log.active:
        try:
            for path in remove_uncommitted(latest, fs):
                log.print(f"removed {posixpath.basename(path)}: written after the latest committed checkpoint")
        except (OSError, ValueError):
            pass  # the latest has no readable state: nothing to compare with (verify names it below)
    damaged: list[tuple[str, str]] = []
    for directory in candidates:
        reason = verify(directory, fs)
        if reason is None:
            for path, why in damaged:
                log.print(
                    f"WARNING: checkpoint {posixpath.basename(path)} is damaged ({why}); resuming from "
                    f"{posixpath.basename(directory)}"
                )
            with local_checkpoint(directory, fs) as local:
                return (*load_checkpoint(local, model, optimizer, aliases), (directory, fs))
        damaged.append((directory, reason))
    raise DamagedCheckpointsError(
        f"no intact checkpoint in {_run_dir_of(latest)} to resume from: "
        + "; ".join(f"{posixpath.basename(path)}: {why}" for path, why in damaged)
        + " (move the run directory away to start over)"
    )


def local_checkpoint(directory: str, fs: Any) -> contextlib.AbstractContextManager[str]:
    """A checkpoint directory as a local path (collective): itself when local, else a copy downloaded once per
    node for the duration of the context (`node_local_copy`)."""
    import ray
    import ray.train

    return node_local_copy(
        directory,
        fs,
        node=ray.get_runtime_context().get_node_id(),
        local_rank=ray.train.get_context().get_local_rank(),
        barrier=lambda: all_reduce_sum(0.0),
    )


def step_source(
    job: WorkerJob,
    plan: BatchPlan,
    dims: ParallelDims,
    rank: int,
    device: torch.device,
    consumed: IdRanges,
    log: Callable[[str], None],
) -> StepSource:
    """The data of every step for this rank: the Parquet order, deterministic mode's indexed order, or the
    streaming shard. Indexed by the data-parallel replica: the ranks of one model-parallel replica read the same
    slice. Live mode's replicas read through the same sources (`set_share` before each step)."""
    replica = dims.coords(rank).dp
    spec = job.spec
    if isinstance(job.data, ParquetIndex):
        return ParquetSteps(
            job.data,
            seed=spec.loop.seed,
            plan=plan,
            rank=replica,
            device=device,
            drop_last=spec.batch.drop_last,
            epochs=spec.loop.epoch_limit,
            log=log,
            replica_ranks=dims.replica_ranks() if dims.model_parallel else None,
        )
    if spec.loop.deterministic:
        assert isinstance(job.data, IndexedData | ColumnData), "deterministic mode needs indexed data"
        return IndexedSteps(
            job.data, seed=spec.loop.seed, plan=plan, rank=replica, device=device, drop_last=spec.batch.drop_last
        )
    return StreamingSteps(
        id_column=spec.loop.id_column or "",
        seed=spec.loop.seed,
        plan=plan,
        rank=rank,
        device=device,
        shuffle_buffer=spec.loop.shuffle_buffer,
        consumed=consumed,
        drop_last=spec.batch.drop_last,
        empty=job.empty_batch or {},
    )


def _total_steps(spec: TrainSpec, source: StepSource, state: TrainState) -> int | None:
    """The run's length in optimizer steps from the restored position: known in deterministic mode (the data
    size and the global batch give it), else `max_steps` (None when unset)."""
    if isinstance(source, IndexedSteps | ParquetSteps):
        return run_total_steps(
            num_rows=source.num_rows,
            global_batch=spec.batch.global_batch,
            drop_last=spec.batch.drop_last,
            epochs=spec.loop.epoch_limit,
            max_steps=spec.loop.max_steps,
            step=state.step,
            epoch=state.epoch,
            sample_in_epoch=state.sample_in_epoch,
        )
    return spec.loop.max_steps


def start_run(job: WorkerJob) -> Run:
    """Everything a worker-group (re)start does before its first step (collective: every rank calls it)."""
    import ray
    import ray.train

    entered = time.time()
    spec = job.spec
    context = ray.train.get_context()
    world, rank = context.get_world_size(), context.get_world_rank()
    device = _device(spec.cluster.use_gpu, context.get_local_rank())
    log = Rank0Log(
        rank, job.run_dir, audit=spec.loop.audit_samples, log_every=spec.loop.log_every, trackers=job.trackers
    )
    dims = ParallelDims.of(world, *spec.parallel.degrees)
    coords = dims.coords(rank)
    mesh = None
    if dims.model_parallel:
        check_tp_within_nodes(all_gather_objects(ray.get_runtime_context().get_node_id()), dims.tp)
        mesh = dims.build_mesh(device.type)
    plan = spec.batch.plan(dims.dp)
    global_batch = spec.batch.global_batch
    faults.arm(job.run_dir, rank, world)

    began = time.perf_counter()
    resuming = ray.train.get_checkpoint() is not None
    pretrained = job.pretrained if not resuming else None  # a checkpoint replaces the weights anyway
    model, trace = build_model(job)
    record = model_record(model) if rank == 0 else {}  # only rank 0 writes the train state
    parallel = spec.parallel
    # of the whole model, before the stage is cut
    ties = stage_ties(model, dims.pp, parallel.chunks) if dims.pp > 1 else []
    # a tied parameter's optimizer state is stored under one of its names: the one this layout may not hold
    aliases = tie_aliases(model)
    tp_plan = plan_of(model, job.tp_plan_fn) if dims.tp > 1 else None  # checked on the driver, resolved per stage
    layout = resolve_layout(
        spec.loop.strategy,
        parallel.grad_accumulation,
        model,
        world_size=dims.dp,
        accumulation_steps=plan.accumulation_steps,
        precision=parallel.precision,
        device=device,
        local_workers=context.get_local_world_size(),
        stages=dims.pp,
        chunks=parallel.chunks,
        units_fn=job.units_fn,
        conditional=job.conditional_modules,
    )
    if layout.reason:
        log.print(layout.reason)
    strategy = layout.strategy
    model = apply_parallelism(
        model,
        strategy,
        device,
        dims,
        mesh=mesh,
        tp_plan=tp_plan,
        stage=coords.pp,
        pp_chunks=parallel.chunks,
        sequence_parallel=parallel.sequence_parallel,
        init=trace,
        seed=spec.loop.seed,
        pretrained=pretrained,
        precision=parallel.precision,
        activation_checkpointing=parallel.activation_checkpointing,
        compile_blocks=parallel.compile,
        units_fn=job.units_fn,
        conditional=job.conditional_modules,
        log=log.print,
    )
    policy = step_policy(
        strategy,
        dims,
        parallel.precision,
        layout.grad_accumulation,
        mesh,
        coords,
        ties,
        parallel.pp_schedule,
        parallel.chunks,
        parallel.sequence_parallel,
        model=model,
    )
    scaler = torch.amp.GradScaler(device.type) if parallel.precision == "fp16" else None
    built_lr = spec.lr.peak_lr(global_batch)
    optimizer = build_optimizer(model, job.optimizer_fn, built_lr, strategy)
    ratios = lr_ratios(optimizer, built_lr)  # before restoring: a checkpoint holds scheduled, not base, LRs
    built = time.perf_counter()
    if pretrained is not None:
        log.print(
            f"{pretrained.uri}: read {pretrained.bytes_read / 2**20:.4g} of {pretrained.nbytes / 2**20:.4g} MiB on "
            f"rank 0 in {built - began:.2f} s (each rank reads its shard)"
        )
    state, consumed, restored_from = _restore(model, optimizer, log, aliases, job.resume_from)
    restored = restored_from is not None
    loaded = time.perf_counter()
    if scaler is not None and state.loss_scale:
        scaler.load_state_dict(state.loss_scale)

    base_batch = spec.lr.base_batch or state.base_batch or global_batch
    peak = spec.lr.peak_lr(global_batch, base_batch)
    warning = describe_lr_on_resume(
        rule=spec.lr.rule,
        base_batch=base_batch,
        old_global_batch=state.global_batch or global_batch,
        new_global_batch=global_batch,
        old_peak=state.peak_lr or peak,
        new_peak=peak,
    )
    if warning:
        log.print(f"WARNING: {warning}")

    source = step_source(job, plan, dims, rank, device, consumed, log.print)
    if isinstance(source, ParquetSteps) and (
        kept := source.keep_order(state.epoch, state.sample_in_epoch, state.data_order)
    ):
        log.print(kept)
    total_steps = _total_steps(spec, source, state)
    decay = spec.lr.decay_steps
    fresh = ScheduleClock(total=decay or total_steps, end=None if decay else total_steps, warmup=spec.lr.warmup_steps)
    stored = ScheduleClock.from_dict(state.schedule) if state.schedule else fresh
    clock = stored.resumed(state.step, fresh)
    decaying = spec.lr.schedule != "constant" and job.lr_schedule_fn is None
    note = describe_schedule_on_resume(stored, clock, state.step, total_steps, decaying) if restored else None
    if note:
        log.print(note)
    run = Run(
        job=job,
        rank=rank,
        world=world,
        dims=dims,
        replica=coords.dp,
        stage=coords.pp,
        device=device,
        plan=plan,
        strategy=strategy,
        policy=policy,
        scaler=scaler,
        model=model,
        optimizer=optimizer,
        lr_ratios=ratios,
        peak_lr=peak,
        base_batch=base_batch,
        source=source,
        val_columns=job.val_data.load_columns() if job.val_data is not None else None,
        log=log,
        state=state,
        restored=restored,
        total_steps=total_steps,
        clock=clock,
        saves=checkpoint_group() if spec.checkpoint.background_save else None,
        restored_from=restored_from,
        model_record=record,
    )
    log.total_steps = run.total_steps
    phases = {"model": built - began, "restore": loaded - built, "data": time.perf_counter() - loaded}
    settle_heap()
    log.start(
        restored_step=state.step,
        event={
            "step": state.step,
            "world_size": world,
            "layout": {"dp": dims.dp, "tp": dims.tp, "pp": dims.pp},
            "plan": plan.to_dict(),
            "lr": peak,
            "strategy": strategy,
            "restored": restored,
            "pids": all_gather_objects(os.getpid()),  # lets a test or the demo SIGKILL a worker
            "entered": entered,  # rank 0 entered the training function (UNIX time)
            "phases_s": {name: round(seconds, 4) for name, seconds in phases.items()},  # rank 0's start work
            "frozen_objects": gc.get_freeze_count(),  # what `settle_heap` moved out of the collector's reach
        },
    )
    return run


def settle_heap() -> None:
    """Move every object alive now (imported modules, the model, the optimizer, the data: what lives for the whole
    run) out of the garbage collector's reach, after a young-generation collection. Python's full collections
    otherwise walk them all, now and then, mid-step: on a 2-core machine one took 0.24 s per rank, at a different
    step on each rank, and the other rank waited for it in the step's collective (found by `benchmarks/overhead.py`
    as a 0.5 s step after the 12th checkpoint). Later collections scan only what the run allocates since."""
    gc.collect(1)
    gc.freeze()


def begin_step(run: Run, data: StepData, lr: float) -> Step:
    """Set up the next optimizer step on `data` (this rank's micro-batches): its LR `lr` (`Run.lr_at`), the seeds of its
    micro-batches (`raytrain.rng.MicroBatchSeeds`: by their place in the step, the same at every W and after a
    restart), the fault points of tests; returns the `Step` to train, whose loss collective also carries the loop's
    agreement (`_agreement`) when one is due (`raytrain.agreement`: about once a second of training)."""
    state, spec = run.state, run.spec
    set_lr(run.optimizer, run.lr_ratios, lr)
    faults.at_step(state.step + 1)
    plan = data.plan
    seeds = MicroBatchSeeds(
        spec.loop.seed,
        state.step,
        plan.rank_offset(run.replica),
        plan.micro_batches[run.replica],
        run.stage,
        run.device,
    )
    return Step(
        run.model,
        run.optimizer,
        data.micro_batches,
        run.dims.dp,
        data.plan.global_batch,
        spec.loop.max_grad_norm,
        run.policy,
        run.scaler,
        # While a checkpoint is being written every step agrees, so it is reported as soon as every rank has
        # written it (a failure then loses at most `every_steps` steps); otherwise about once a second.
        agree=(lambda: _agreement(run)) if run.agreement.due or run.pending is not None else None,
        seeds=seeds,
    )


def end_step(run: Run, step: Step, data: StepData, lr: float, seconds: float) -> dict[str, Any]:
    """Advance the run's state past a trained `step` (at LR `lr`) and return its metrics (the same on every rank);
    `NonFiniteError` when the step held a NaN or Inf and `LoopConfig.on_nonfinite` is "stop"."""
    state, spec = run.state, run.spec
    result = step.result
    if result is None:
        raise RuntimeError(
            f"step {state.step + 1} ended without step.optimizer_step(): call it once per step, after its micro-batches"
        )
    total = data.plan.global_batch
    if not result.stepped:
        if spec.loop.on_nonfinite == "stop":
            raise NonFiniteError.at(state.step + 1, result.loss_sum / total, result.grad_norm)
        state.skipped_steps += 1
    state.step, state.sample_in_epoch, state.samples_seen = (
        state.step + 1,
        state.sample_in_epoch + total,
        state.samples_seen + total,
    )
    metrics: dict[str, Any] = {
        "step": state.step,
        "epoch": state.epoch,
        "world_size": run.world,
        "accumulation_steps": data.plan.accumulation_steps,
        "per_rank_samples": list(data.plan.per_rank_samples),
        "global_batch_size": total,
        "samples_seen": state.samples_seen,
        "lr": lr,
        "loss": result.loss_sum / total,
        "grad_norm": result.grad_norm,
        "step_time_s": seconds,
        "time": time.time(),
    }
    if state.skipped_steps:
        metrics["skipped_steps"] = state.skipped_steps
    return metrics


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Entry point given to `TorchTrainer`; `config["job"]` is the `WorkerJob` built by `ElasticTrainer`.

    An exception that escapes is marked with the step it happened at (`raytrain.failures.mark`), so that the
    controller can tell a bug that recurs at the same step from a failure worth a restart.
    """
    job: WorkerJob = config["job"]
    try:
        run = start_run(job)
    except Exception as err:
        mark(err, _checkpoint_step(), "start")
        raise
    try:
        _train(run)
    except Exception as err:
        mark(err, run.state.step + 1, "step")  # the step being trained, 1-based as in metrics.jsonl
        raise


def _checkpoint_step() -> int:
    """The step of the checkpoint this start resumes from (0 without one, -1 when it cannot be read)."""
    import ray.train

    try:
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return 0
        return read_step(checkpoint.path, checkpoint.filesystem)
    except Exception:
        return -1


def _train(run: Run) -> None:
    """raytrain's own loop: every step of `steps(run)` trained with the job's `loss_fn`."""
    for step in steps(run):
        try:
            step.train(run.job.loss_fn)
        except Exception as err:
            if out_of_memory(err):
                raise OutOfMemory(_memory_advice(run, err)) from err
            raise


def steps(run: Run) -> Iterator[Step]:
    """The step loop of one worker-group start, from the restored position to the end of the run: yields each
    optimizer step for the caller to train (`Step.train`, or the user's own loop over `Step.micro_batches`), then
    advances the data position, logs the step on rank 0, checkpoints when due and answers a drain notice. After
    the last step: the final checkpoint, every checkpoint committed, the run's summary line. Collective: every
    rank walks it to the end, step for step."""
    spec, state = run.spec, run.state
    max_steps = spec.loop.max_steps or 2**62
    metrics: dict[str, Any] = {}
    checkpointed = state.step
    while state.step < max_steps and state.epoch < spec.loop.epoch_limit:
        asked = time.perf_counter()
        data = run.source.next_step(state.epoch, state.sample_in_epoch)
        data_wait = time.perf_counter() - asked
        if data is None:  # the epoch is used up; nothing is carried into the next one
            state.epoch, state.sample_in_epoch = state.epoch + 1, 0
            continue
        run.agreement.waited(data_wait)
        lr = run.lr_at(state.step)  # once per step: a user's schedule hook is called once
        step = begin_step(run, data, lr)
        started = time.perf_counter()
        yield step
        try:
            metrics = end_step(run, step, data, lr, time.perf_counter() - started)
        except NonFiniteError:
            # Found by every rank at the same step (agreed by the norm's all-reduce): the checkpoint being
            # written holds the last good state, so every rank completes and commits it before stopping.
            _settle(run)
            raise
        run.agreement.stepped(step.agreed)
        deadline = None
        if step.agreed is not None:
            deadline, metrics["data_wait_max_s"] = _agree_after_step(run, step.agreed)
        metrics["data_wait_s"] = data_wait
        # Checkpoint work on the training thread since the previous line: the copy to host memory (or the whole
        # write, without background saves) of the last checkpoint, its report, and a wait for the one before.
        metrics["checkpoint_stall_s"], run.checkpoint_stall_s = run.checkpoint_stall_s, 0.0
        if isinstance(run.source, ParquetSteps):
            stats = run.source.stats
            metrics["data_held_bytes"] = stats.held_bytes
            metrics["data_cpu_s"] = stats.load_cpu_s + stats.assemble_cpu_s  # since the source began (rank 0)
        reported = list(run.user_metrics)
        metrics.update(run.user_metrics)
        run.user_metrics.clear()
        # the run's last step (when its length is known) validates and checkpoints with its line: the final
        # validation is in metrics.jsonl, for a fresh and a resumed run alike
        last = state.step in (max_steps, run.total_steps)
        checkpoint_now = state.step % spec.checkpoint.every_steps == 0 or last
        if checkpoint_now:
            _validate(run, metrics)
        run.log.step(metrics, run.source.global_ids(data) if spec.loop.audit_samples else None, shown=reported)
        if checkpoint_now:
            checkpointed = _checkpoint(run, metrics)
        if deadline is not None:  # a node of the group is being drained: save now, train nothing to be lost
            if state.step != checkpointed:
                _validate(run, metrics)
                checkpointed = _checkpoint(run, metrics)
            _settle(run)
            _wait_for_the_drain(run, deadline)
    if state.step != checkpointed and metrics:  # the last epoch ended between checkpoints
        _validate(run, metrics)
        _checkpoint(run, metrics)
    _settle(run)
    if isinstance(run.source, ParquetSteps):
        run.source.close()
    if metrics:
        summary = {"steps": state.step, "last epoch": metrics["epoch"], "final loss": round(metrics["loss"], 6)}
        if "val_loss" in metrics:
            summary["val_loss"] = round(metrics["val_loss"], 6)
        run.log.finish(summary)
    else:
        end = where_the_run_ends(state.epoch, spec.loop.epoch_limit, spec.loop.max_steps)
        run.log.print(f"nothing left to train: the checkpoint is at step {state.step}, {end}")
    run.log.close()


def where_the_run_ends(epoch: int, epoch_limit: int, max_steps: int | None) -> str:
    """Where a resumed run with nothing left to train stopped, in the words of the "done" line ("last epoch",
    epochs counted from 0 as the metrics count them): a checkpoint past the last epoch holds the position of the
    epoch after it (`epoch` == `epoch_limit`), which is the end of epoch `epoch_limit - 1`; otherwise the run was
    ended by `max_steps`, in `epoch`."""
    if epoch >= epoch_limit:
        return f"the end of its last epoch ({epoch_limit - 1}, counted from 0)"
    return f"max_steps={max_steps} (in epoch {epoch}, counted from 0)"


DRAIN_PATIENCE_S = 60.0  # past the deadline (or since the notice, without one): the drain did not happen, go on


def _agreement(run: Run) -> list[float]:
    """This rank's side of an agreement (maxed over ranks, in the step's loss collective; `AgreementClock.values`):
    the deadline (UNIX seconds; 0 when unknown) of a drain announced for a node of this worker group (-1 without
    one), whether this rank's files of the checkpoint in progress are still unwritten, its wait for data since the
    last agreement and the time since then."""
    local = preemption_deadline_ms()
    unwritten = run.pending is not None and not run.pending.written()
    return run.agreement.values(-1.0 if local is None else local / 1000, unwritten)


def _agree_after_step(run: Run, agreed: list[float]) -> tuple[float | None, float]:
    """Act on an agreement (`_agreement`'s values maxed over every rank): a checkpoint whose files every rank has
    written is reported at once (`_report_pending`). Returns (the drain deadline, None without one; the longest
    any rank waited for data in all over the steps since the last agreement: rank 0's own wait is not the
    slowest reader's)."""
    drain, any_unwritten, wait, _ = agreed
    if run.pending is not None and not any_unwritten:
        _report_pending(run)
    return (None if drain < 0 else drain), wait


def _settle(run: Run) -> None:
    """Report the checkpoint in progress (waiting for its files) and wait until Ray has committed every reported
    one: before a drained node is let go and at the end (collective)."""
    _report_pending(run)
    run.commit.wait()


def _wait_for_the_drain(run: Run, deadline: float) -> None:
    """After the just-in-time checkpoint: train nothing that the restart would roll back. Ray Train tears the
    group down at the deadline and restarts at the size that remains, from this checkpoint: no step is lost. If
    nothing happens for `DRAIN_PATIENCE_S` past the deadline (a cancelled drain), training goes on."""
    now = time.time()
    give_up = max(deadline, now) + DRAIN_PATIENCE_S
    left = f"in {deadline - now:.0f} s" if deadline else "without a deadline"
    run.log.print(f"a node is being drained ({left}): checkpoint at step {run.state.step} committed; waiting")
    while time.time() < give_up:
        time.sleep(0.2)
    run.log.print("the drain did not happen; training goes on")


def _memory_advice(run: Run, error: BaseException) -> str:
    """What ran out of memory and what to change: a smaller micro-batch (more accumulation, the same global
    batch), a ZeRO stage that shards more, bf16."""
    spec, plan = run.spec, run.plan
    bigger = {"ddp": "zero2 or zero3", "zero1": "zero2 or zero3", "zero2": "zero3"}.get(run.strategy, "more workers")
    return (
        f"out of memory at step {run.state.step + 1} ({type(error).__name__}: {str(error).splitlines()[0][:120]}) "
        f"with strategy {run.strategy}, micro-batch cap {plan.micro_batch_cap} (largest micro-batch "
        f"{plan.max_micro_batch}), precision {spec.parallel.precision}: lower BatchConfig.micro_batch (accumulation "
        f"keeps the global batch at {spec.batch.global_batch}), or use {bigger}, or precision 'bf16'"
    )


def _validate(run: Run, metrics: dict[str, Any]) -> None:
    """Add `val_loss` to `metrics` when there is a validation set (collective)."""
    if run.val_columns is not None:
        metrics["val_loss"] = evaluate(
            run.model,
            run.job.loss_fn,
            run.val_columns,
            run.replica,
            run.dims.dp,
            run.plan.micro_batch_cap,
            run.device,
            run.policy,
        )


class PendingCommit:
    """Waits, in a background thread, until Ray has committed the checkpoints reported so far, so training goes
    on while the controller registers the latest one. `wait` joins it: called before the next checkpoint is
    written, before a drain is waited out and at the end, so no checkpoint is written, and no worker group is
    left, while an earlier one is still uncommitted."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self) -> None:
        """Begin waiting for the checkpoints reported so far (after `ray.train.report`)."""
        import ray.train
        from ray.train import CheckpointConsistencyMode

        def wait_for_ray() -> None:
            try:
                ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED)
            except BaseException as err:  # re-raised on the training thread by `wait`
                self._error = err

        self.wait()
        self._thread = threading.Thread(target=wait_for_ray, name="raytrain-commit", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the checkpoints reported so far are committed; raise what the wait raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def _report(run: Run, metrics: dict[str, Any], directory: str, step: int) -> None:
    """Every rank reports (a barrier) with its shard directory of the checkpoint of `step`; Ray merges them into
    one checkpoint."""
    import ray.train
    from ray.train import Checkpoint

    ray.train.report(
        metrics, checkpoint=Checkpoint.from_directory(directory), delete_local_checkpoint_after_upload=True
    )
    fault_point("report", step)
    if run.spec.checkpoint.wait_for_commit:
        # Without this, a restart right after a report often restores the previous checkpoint.
        run.commit.start()


def _report_pending(run: Run) -> None:
    """Complete the checkpoint in progress, if any: wait for this rank's files, write the manifest, report it
    (collective)."""
    if run.pending is None:
        return
    began = time.perf_counter()
    pending, run.pending = run.pending, None
    _report(run, pending.metrics, finish_save(pending, run.rank), pending.step)
    run.checkpoint_stall_s += time.perf_counter() - began


def _checkpoint(run: Run, metrics: dict[str, Any]) -> int:
    """Checkpoint the run's state with `metrics` (collective); returns its step. The previous checkpoint is
    reported and committed first. With background saves (`CheckpointConfig.background_save`) it returns once
    the state is copied to host memory; the checkpoint is reported after the step at whose end every rank's
    files are written (`_agree_after_step`), else before it returns."""
    state, spec = run.state, run.spec
    state.world_size, state.global_batch, state.plan, state.config = (
        run.world,
        spec.batch.global_batch,
        run.plan.to_dict(),
        spec.to_dict(),
    )
    state.base_batch, state.peak_lr, state.schedule = run.base_batch, run.peak_lr, run.clock.to_dict()
    state.model = run.model_record
    state.data_order = run.source.order_params(state.epoch) if isinstance(run.source, ParquetSteps) else {}
    state.num_rows = run.source.num_rows if isinstance(run.source, IndexedSteps | ParquetSteps) else 0
    state.loss_scale = run.scaler.state_dict() if run.scaler is not None else {}
    _report_pending(run)
    began = time.perf_counter()
    run.commit.wait()  # the previous checkpoint is committed before this one is written
    run.pending = start_save(
        run.model,
        run.optimizer,
        state,
        run.rank,
        run.source.consumed_ids(),
        metrics=metrics,
        background_group=run.saves,
        flat_optimizer=run.dims.pp > 1,
        extras=run.extras,
    )
    run.checkpoint_stall_s += time.perf_counter() - began
    fault_point("checkpoint")
    if run.saves is None:
        _report_pending(run)
    return state.step
