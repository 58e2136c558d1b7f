"""The loop every Ray Train worker runs. Ray Train restarts it from the top on every resize or failure.

At each (re)start: read the world size, compute the batch plan for it, build and wrap the model, restore the
latest checkpoint (model, optimizer, step, data position), log the resize line on rank 0, then train.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from raytrain.checkpoint import TrainState, load_checkpoint, save_checkpoint
from raytrain.collectives import all_gather_objects, all_reduce_sum
from raytrain.config import TrainSpec
from raytrain.data import IndexedSteps, to_tensors
from raytrain.lr_rules import lr_at_step, lr_change_on_resume
from raytrain.parallelize import apply_parallelism, build_optimizer, gradient_sync
from raytrain.rank0 import Rank0Log
from raytrain.strategy import resolve_strategy
from raytrain.streaming import StreamingSteps

LossFn = Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
Batch = dict[str, torch.Tensor]


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    micro_batches: list[Batch],
    world_size: int,
    step_total: int,
) -> float:
    """One optimizer step over this rank's micro-batches; returns the rank's summed per-sample loss.

    Each backward() adds to the gradients, so normalise by the step's global sample count here: the summed
    per-sample loss times W / B, because DDP/FSDP then average over W. Only the last micro-step syncs.
    """
    optimizer.zero_grad(set_to_none=True)
    scale = world_size / step_total
    local_sum = 0.0
    for j, batch in enumerate(micro_batches):
        with gradient_sync(model, enabled=j == len(micro_batches) - 1):
            losses = loss_fn(model, batch)
            rows = len(next(iter(batch.values())))
            if losses.dim() != 1 or losses.shape[0] != rows:
                raise ValueError(
                    f"loss_fn must return one loss per sample (shape [{rows}]), got shape {tuple(losses.shape)}"
                )
            (losses.sum() * scale).backward()
        local_sum += float(losses.detach().sum())
    optimizer.step()
    return local_sum


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loss_fn: LossFn,
    columns: dict[str, np.ndarray],
    rank: int,
    world_size: int,
    micro_batch: int,
    device: torch.device,
) -> float:
    """Mean per-sample loss over a validation set (collective). Rank r takes rows r, r+W, ...; every rank runs the
    same number of forwards (some on empty batches), because FSDP's forward needs all ranks."""
    rows = len(next(iter(columns.values())))
    mine = np.arange(rank, rows, world_size)
    largest_share = math.ceil(rows / world_size)
    chunks = max(1, math.ceil(largest_share / micro_batch))
    was_training = model.training
    model.eval()
    total = 0.0
    for j in range(chunks):
        picked = mine[j * micro_batch : (j + 1) * micro_batch]
        total += float(loss_fn(model, to_tensors({k: v[picked] for k, v in columns.items()}, device)).sum())
    model.train(was_training)
    return all_reduce_sum(total) / rows


def _device(use_gpu: bool, local_rank: int) -> torch.device:
    """The device of this worker, from its LOCAL rank (the global rank is wrong beyond one node)."""
    if use_gpu:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _report(metrics: dict[str, Any], directory: str, wait_for_commit: bool) -> None:
    """Every rank reports (a barrier) with its checkpoint shard directory; Ray merges them into one checkpoint."""
    import ray.train
    from ray.train import Checkpoint, CheckpointConsistencyMode

    ray.train.report(
        metrics, checkpoint=Checkpoint.from_directory(directory), delete_local_checkpoint_after_upload=True
    )
    if wait_for_commit:
        # Without this, a restart right after a report often restores the previous checkpoint.
        ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Entry point given to `TorchTrainer`; `config` is built by `raytrain.trainer.ElasticTrainer`."""
    import ray.train

    spec: TrainSpec = config["spec"]
    loss_fn: LossFn = config["loss_fn"]
    context = ray.train.get_context()
    world, rank = context.get_world_size(), context.get_world_rank()
    device = _device(spec.cluster.use_gpu, context.get_local_rank())
    log = Rank0Log(rank, config.get("run_dir"), audit=spec.loop.audit_samples, log_every=spec.loop.log_every)

    plan = spec.batch.plan(world)
    global_batch = spec.batch.global_batch
    peak = spec.lr.peak_lr(global_batch)
    torch.manual_seed(spec.loop.seed)  # identical initial weights on every rank
    model = config["model_fn"]()
    strategy = resolve_strategy(spec.loop.strategy, model, world, device)
    model = apply_parallelism(model, strategy, device, world)
    optimizer = build_optimizer(model, config["optimizer_fn"], peak, strategy)

    state, consumed = TrainState(), np.zeros(0, dtype=np.int64)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            state, consumed = load_checkpoint(directory, model, optimizer)
    warning = lr_change_on_resume(
        spec.lr.base_lr,
        spec.lr.base_batch or global_batch,
        spec.lr.rule,
        state.global_batch or global_batch,
        global_batch,
    )
    if warning:
        log.print(f"WARNING: {warning}")
    log.start(
        restored_step=state.step,
        event={
            "step": state.step,
            "world_size": world,
            "plan": plan.to_dict(),
            "lr": peak,
            "strategy": strategy,
            "restored": checkpoint is not None,
            "pids": all_gather_objects(os.getpid()),  # lets a test or the demo SIGKILL a worker
        },
    )

    source: IndexedSteps | StreamingSteps
    if spec.loop.deterministic:
        source = IndexedSteps(
            config["data"], seed=spec.loop.seed, plan=plan, rank=rank, device=device, drop_last=spec.batch.drop_last
        )
    else:
        source = StreamingSteps(
            id_column=spec.loop.id_column or "",
            seed=spec.loop.seed,
            plan=plan,
            rank=rank,
            device=device,
            shuffle_buffer=spec.loop.shuffle_buffer,
            consumed=consumed,
            drop_last=spec.batch.drop_last,
            empty=config["empty_batch"],
        )
    val_data = config.get("val_data")
    val_columns = val_data.load_columns() if val_data is not None else None
    max_steps = spec.loop.max_steps or 2**62
    if isinstance(source, IndexedSteps):
        log.total_steps = min(max_steps, source.steps_per_epoch * spec.loop.epochs)
    elif spec.loop.max_steps:
        log.total_steps = spec.loop.max_steps
    metrics: dict[str, Any] = {}
    committed = state.step
    while state.step < max_steps and state.epoch < spec.loop.epochs:
        step = source.next_step(state.epoch, state.step_in_epoch)
        if step is None:  # the epoch is used up; nothing is carried into the next one
            state.epoch, state.step_in_epoch = state.epoch + 1, 0
            continue
        lr = lr_at_step(state.step, peak, spec.lr.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        torch.manual_seed(hash((spec.loop.seed, state.step, rank)) & 0x7FFF_FFFF)  # per-step RNG, restart-proof

        started = time.perf_counter()
        total = step.plan.global_batch
        loss_sum = all_reduce_sum(train_step(model, optimizer, loss_fn, step.micro_batches, world, total))
        state.step, state.step_in_epoch = state.step + 1, state.step_in_epoch + 1
        state.samples_seen += total
        metrics = {
            "step": state.step,
            "epoch": state.epoch,
            "world_size": world,
            "accumulation_steps": step.plan.accumulation_steps,
            "per_rank_samples": list(step.plan.per_rank_samples),
            "global_batch_size": total,
            "samples_seen": state.samples_seen,
            "lr": lr,
            "loss": loss_sum / total,
            "step_time_s": time.perf_counter() - started,
            "time": time.time(),
        }
        ids = source.global_ids(step) if spec.loop.audit_samples else None
        checkpoint_now = state.step % spec.checkpoint.every_steps == 0 or state.step == max_steps
        if checkpoint_now and val_columns is not None:
            metrics["val_loss"] = evaluate(model, loss_fn, val_columns, rank, world, plan.micro_batch_cap, device)
        log.step(metrics, ids)  # converted to a list on rank 0 only
        if checkpoint_now:
            committed = _commit(model, optimizer, state, rank, source, metrics, spec, world, plan.to_dict())
    if state.step != committed and metrics:  # the last epoch ended between checkpoints
        _commit(model, optimizer, state, rank, source, metrics, spec, world, plan.to_dict())
    if metrics:
        log.finish({"steps": state.step, "epochs": state.epoch, "final loss": round(metrics["loss"], 6)})
    else:
        log.print(f"nothing left to train: the checkpoint is at step {state.step}, epoch {state.epoch}")


def _commit(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
    rank: int,
    source: IndexedSteps | StreamingSteps,
    metrics: dict[str, Any],
    spec: TrainSpec,
    world: int,
    plan: dict[str, Any],
) -> int:
    """Save and report a checkpoint of `state` (collective); returns the committed step."""
    state.world_size, state.global_batch, state.plan, state.config = (
        world,
        spec.batch.global_batch,
        plan,
        spec.to_dict(),
    )
    directory = save_checkpoint(model, optimizer, state, rank, source.consumed_ids())
    _report(metrics, directory, spec.checkpoint.wait_for_commit)
    return state.step
