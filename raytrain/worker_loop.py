"""The loop every Ray Train worker runs. Ray Train restarts it from the top on every resize or failure.

At each (re)start: read the world size, compute the batch plan for it, build and wrap the model, restore the
latest checkpoint (model, optimizer, step, data position), log the resize line on rank 0, then train.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from raytrain.batch_plan import BatchPlan, split_step
from raytrain.checkpoint import TrainState, load_checkpoint, save_checkpoint
from raytrain.config import TrainSpec
from raytrain.data import IndexedData, epoch_order, step_positions, steps_per_epoch
from raytrain.lr_rules import lr_at_step, lr_change_on_resume
from raytrain.parallelize import apply_parallelism, build_optimizer, gradient_sync
from raytrain.rank0 import Rank0Log, resize_line
from raytrain.strategy import resolve_strategy

LossFn = Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
Batch = dict[str, torch.Tensor]


def _all_reduce_sum(values: list[float]) -> list[float]:
    """Sum floats over ranks (float64); identity without a process group."""
    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor.tolist()


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


def _rank_micro_batches(
    columns: dict[str, np.ndarray], positions: np.ndarray, plan: BatchPlan, rank: int, device: torch.device
) -> list[Batch]:
    """This rank's contiguous slice of the step's positions, cut into its planned micro-batches."""
    start = plan.rank_offset(rank)
    batches = []
    for size in plan.micro_batches[rank]:
        picked = positions[start : start + size]
        batches.append({name: torch.from_numpy(col[picked]).to(device) for name, col in columns.items()})
        start += size
    return batches


def _device(use_gpu: bool, local_rank: int) -> torch.device:
    """The device of this worker, from its LOCAL rank (the global rank is wrong beyond one node)."""
    if use_gpu:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _report(metrics: dict[str, Any], directory: str | None, wait_for_commit: bool) -> None:
    """Every rank reports (a barrier); each attaches its checkpoint shard directory when there is one."""
    import ray.train
    from ray.train import Checkpoint, CheckpointConsistencyMode

    checkpoint = Checkpoint.from_directory(directory) if directory else None
    ray.train.report(metrics, checkpoint=checkpoint, delete_local_checkpoint_after_upload=checkpoint is not None)
    if checkpoint is not None and wait_for_commit:
        # Without this, a restart right after a report often restores the previous checkpoint.
        ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Entry point given to `TorchTrainer`; `config` is built by `raytrain.trainer.ElasticTrainer`."""
    import ray.train

    spec: TrainSpec = config["spec"]
    data: IndexedData = config["data"]
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

    state = TrainState()
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            state = load_checkpoint(directory, model, optimizer)
    previous_plan = state.plan or None
    previous_lr = spec.lr.peak_lr(state.global_batch) if state.global_batch else None
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
            "previous_world_size": state.world_size or None,
            "plan": plan.to_dict(),
            "strategy": strategy,
            "restored": checkpoint is not None,
        },
        line=resize_line(previous_plan, plan.to_dict(), peak, previous_lr) + f", strategy {strategy}",
    )

    columns = data.load_columns()
    per_epoch = steps_per_epoch(data.num_rows, global_batch, spec.batch.drop_last)
    max_steps = min(spec.loop.max_steps or per_epoch * spec.loop.epochs, per_epoch * spec.loop.epochs)
    metrics: dict[str, Any] = {}
    while state.step < max_steps:
        order = epoch_order(data.num_rows, spec.loop.seed, state.epoch)
        positions = step_positions(order, state.step_in_epoch, global_batch)
        step_plan = plan if len(positions) == global_batch else split_step(len(positions), plan.micro_batch_cap, world)
        lr = lr_at_step(state.step, peak, spec.lr.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        torch.manual_seed(hash((spec.loop.seed, state.step, rank)) & 0x7FFF_FFFF)  # per-step RNG, restart-proof

        started = time.perf_counter()
        micro_batches = _rank_micro_batches(columns, positions, step_plan, rank, device)
        local_sum = train_step(model, optimizer, loss_fn, micro_batches, world, len(positions))
        (loss_sum,) = _all_reduce_sum([local_sum])

        state.step += 1
        state.samples_seen += len(positions)
        metrics = {
            "step": state.step,
            "epoch": state.epoch,
            "world_size": world,
            "accumulation_steps": step_plan.accumulation_steps,
            "per_rank_samples": list(step_plan.per_rank_samples),
            "global_batch_size": len(positions),
            "samples_seen": state.samples_seen,
            "lr": lr,
            "loss": loss_sum / len(positions),
            "step_time_s": time.perf_counter() - started,
        }
        log.step(metrics, data.ids[positions].tolist() if spec.loop.audit_samples else None)
        state.step_in_epoch += 1
        if state.step_in_epoch == per_epoch:
            state.epoch, state.step_in_epoch = state.epoch + 1, 0
        if state.step % spec.checkpoint.every_steps == 0 or state.step == max_steps:
            state.world_size, state.global_batch, state.plan = world, global_batch, plan.to_dict()
            state.config = spec.to_dict()
            directory = save_checkpoint(model, optimizer, state, rank)
            _report(metrics, directory, spec.checkpoint.wait_for_commit)
    log.finish(
        {
            "steps": state.step,
            "epochs": state.epoch,
            "final loss": round(metrics.get("loss", float("nan")), 6),
        }
    )
