"""One live replica: a Ray actor that trains the run's steps as a torchft replica group until the run ends.

The data position is a function of the step number only: step s is at sample (s mod S)·B of epoch s div S, with
S the steps per epoch (`raytrain.data.materialized.steps_per_epoch`). A replacement that healed to step s
therefore knows its data position without any bookkeeping of its own, and every replica agrees on it. The step's
samples come from the restart path's own step source (`raytrain.worker_loop.step_source`: the Parquet windows or
deterministic mode's in-memory order), told before each step how many replicas take part and this one's rank
among them (`set_share`), so a run trains the same samples in the same steps in either recovery mode; the
participant of rank 0 sends the step's record (and each checkpoint) to the run's `LiveLog`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from raytrain import faults
from raytrain.batch_plan import BatchPlan, split_step
from raytrain.config import TrainSpec
from raytrain.data.id_ranges import IdRanges
from raytrain.data.materialized import run_total_steps, step_position, steps_per_epoch
from raytrain.data.parquet import ParquetSteps
from raytrain.errors import NonFiniteError
from raytrain.faults import fault_point
from raytrain.live.log import pack_state
from raytrain.live.replica import FINGERPRINT_EVERY, LiveShare, parameter_checksum
from raytrain.lr_rules import ScheduleClock
from raytrain.model_record import model_record
from raytrain.optim import lr_ratios, set_lr
from raytrain.parallel.dims import ParallelDims
from raytrain.rng import MicroBatchSeeds
from raytrain.worker_loop import WorkerJob, build_model, scheduled_lr, settle_heap, step_source


@dataclass(frozen=True)
class LiveSettings:
    """How a live replica talks to the others: the lighthouse's address, its own replica id, and torchft's
    timeouts (`timeout_s` bounds a collective with a dead peer, `quorum_timeout_s` a quorum that cannot form)."""

    lighthouse: str
    replica_id: str
    group: int = 0  # the driver's group of replicas (a fallback starts the next): the log ignores older groups
    floor: int = 0  # steps the run had committed when this replica started: a quorum behind it had no peer
    timeout_s: float = 10.0
    quorum_timeout_s: float = 60.0
    shard_rank: int = 0  # this worker's rank in its replica group
    dp_shard: int = 1  # data ranks per replica group (they shard the model: zero2/zero3)
    tp: int = 1  # tensor-parallel workers per data rank (they split each block's linear layers)
    # the checkpoint the driver started this group from: {"step", "schedule", "base_batch"} (None: from the start);
    # replacements, which heal from a peer and load no checkpoint, take their LR clock and base batch from it too
    lr_origin: dict[str, Any] | None = None

    @property
    def group_size(self) -> int:
        """Workers per replica group: dp_shard x tp."""
        return self.dp_shard * self.tp


def group_schedule(
    spec: TrainSpec, global_batch: int, total_steps: int, origin: dict[str, Any] | None
) -> tuple[ScheduleClock, int]:
    """Pure: the LR clock and the base batch every replica of a live group trains with, from `origin` (the
    checkpoint the group started from: its step, schedule record and base batch; None: the run's start): the
    replicas that load it and the replacements that heal from a peer alike, so that every group applies one LR to
    the averaged gradients (a replacement with a fresh clock trained at 4.7x the survivors' LR after a resume that
    changed the run's length)."""
    decay = spec.lr.decay_steps
    clock = ScheduleClock(total=decay or total_steps, end=None if decay else total_steps, warmup=spec.lr.warmup_steps)
    if origin is None:
        return clock, spec.lr.base_batch or global_batch
    if origin.get("schedule"):
        clock = ScheduleClock.from_dict(origin["schedule"]).resumed(origin["step"], clock)
    return clock, spec.lr.base_batch or origin.get("base_batch") or global_batch


@dataclass
class LiveOutcome:
    """What one worker of a replica group did: its pid, the first and last step it took part in (committed or not)
    and the steps it saw fail; steps numbered from 1, as in metrics.jsonl."""

    replica_id: str
    pid: int
    first_step: int | None = None
    last_step: int | None = None
    committed: int = 0
    skipped_steps: int = 0  # committed without an update: a non-finite loss or gradient (on_nonfinite="skip")
    failed_steps: list[int] = field(default_factory=list)
    left: bool = False  # it left at a step boundary, asked by the driver (its node is being drained)


class LiveWorker:
    """One worker of a live replica group (rank `settings.shard_rank` of `settings.group_size`). Built by the driver
    as a Ray actor: `address` (rank 0 serves the group's TCP store), then `build` on every rank of the group (its
    process group, the model sharded over it, torchft's manager; `restore`, a checkpoint directory of either
    recovery mode, is loaded
    before the first quorum), then `run`, which trains until the run's last step and returns a `LiveOutcome`."""

    def __init__(self, job: WorkerJob, settings: LiveSettings, log: Any, restore: str | None) -> None:
        from torch.distributed import TCPStore

        from raytrain.data.materialized import IndexedData
        from raytrain.data.parquet import ParquetIndex

        assert isinstance(job.data, IndexedData | ParquetIndex), "live mode reads deterministic mode's step sources"
        self.job, self.settings, self.log, self._restore = job, settings, log, restore
        spec = job.spec
        self.global_batch = spec.batch.global_batch
        self.num_rows = job.data.num_rows
        self.total_steps = run_total_steps(
            num_rows=self.num_rows,
            global_batch=self.global_batch,
            drop_last=spec.batch.drop_last,
            epochs=spec.loop.epoch_limit,
            max_steps=spec.loop.max_steps,
            step=0,
            epoch=0,
            sample_in_epoch=0,
        )
        self._store: Any = None
        if settings.shard_rank == 0:  # the group's rendezvous: its process group and torchft's manager
            import ray

            self._host = ray.util.get_node_ip_address()
            # port 0: the store binds a port the system picks, so no other process can take it first
            self._store = TCPStore(self._host, 0, settings.group_size, is_master=True, wait_for_workers=False)
        # the group's layout, dp_shard data ranks x tp (TP innermost: ranks 2k and 2k + 1 split data rank k at tp 2)
        self.dims = ParallelDims.of(settings.group_size, settings.tp, 1)
        self._coords = self.dims.coords(settings.shard_rank)
        self._leaving = False  # set by `leave` (another thread of this actor): stop at the next step boundary
        # this worker's data rank in the latest quorum; until the first, only the first group's rank 0 logs
        self._rank = 0 if (settings.shard_rank, settings.replica_id) == (0, "r0") else -1

    def address(self) -> tuple[str, int]:
        """The group's TCP store (rank 0 only): this node's IP and the port it listens on."""
        assert self._store is not None, "rank 0 of a replica group serves its store"
        return self._host, int(self._store.port)

    def build(self, store: tuple[str, int]) -> tuple[int, str, int]:
        """Join the group (a collective over its dp_shard x tp workers: `store` is rank 0's `address()`), build the
        model as the restart path builds it (`apply_parallelism` over the group's mesh: tp splits each block's
        linear layers, zero2/zero3 shards over dp_shard, each rank materializing its shard), the optimizer,
        torchft's manager and the step source. Returns this worker's pid, its Ray node id and the run's length in
        optimizer steps (the data size, epochs and max_steps give it)."""
        from datetime import timedelta

        import ray
        import torch.distributed as dist

        from raytrain.checkpoint import load_checkpoint
        from raytrain.data.materialized import IndexedSteps
        from raytrain.live.replica import LiveReplica
        from raytrain.model_tensors import tie_aliases
        from raytrain.optim import build_optimizer
        from raytrain.parallel.apply import apply_parallelism, step_policy
        from raytrain.parallel.strategy import resolve_layout
        from raytrain.parallel.tensor import plan_of

        job, settings, spec = self.job, self.settings, self.job.spec
        size, rank = settings.group_size, settings.shard_rank
        host, port = store
        if size > 1:
            client = dist.TCPStore(
                host, port, size, is_master=False, timeout=timedelta(seconds=settings.quorum_timeout_s)
            )
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore("raytrain/group", client),
                rank=rank,
                world_size=size,
                timeout=timedelta(seconds=settings.quorum_timeout_s),
            )
        cpu = torch.device("cpu")
        dims, coords = self.dims, self._coords
        mesh = dims.build_mesh(cpu.type) if dims.model_parallel else None
        self._dp_group = mesh["dp"].get_group() if mesh is not None else None
        model, trace = build_model(job)
        self.model_record = model_record(model)  # in every checkpoint this group writes (the export reads it)
        strategy = spec.loop.strategy if dims.dp > 1 else "ddp"  # one data rank per group holds the whole model
        parallel = spec.parallel
        least = split_step(self.global_batch, spec.batch.micro_batch, max(1, spec.cluster.min_workers // settings.tp))
        layout = resolve_layout(
            strategy,
            parallel.grad_accumulation,
            model,
            world_size=dims.dp,
            accumulation_steps=least.accumulation_steps,  # the most a step accumulates: at min_workers
            precision=parallel.precision,
            device=cpu,
            units_fn=job.units_fn,
            conditional=job.conditional_modules,
        )
        if layout.reason:
            self._note(layout.reason)
        aliases = tie_aliases(model)  # a tied parameter's optimizer state is stored under one of its names
        self.model = apply_parallelism(
            model,
            layout.strategy,
            cpu,
            dims,
            mesh=mesh,
            tp_plan=plan_of(model, job.tp_plan_fn) if dims.tp > 1 else None,
            sequence_parallel=parallel.sequence_parallel,
            init=trace,
            seed=spec.loop.seed,
            pretrained=job.pretrained if self._restore is None else None,
            precision=parallel.precision,
            activation_checkpointing=parallel.activation_checkpointing,
            compile_blocks=parallel.compile,
            units_fn=job.units_fn,
            conditional=job.conditional_modules,
            log=self._note,
        )
        self.policy = step_policy(
            layout.strategy,
            dims,
            parallel.precision,
            layout.grad_accumulation,
            mesh,
            coords,
            sequence_parallel=parallel.sequence_parallel,
            model=self.model,
        )
        self.optimizer = build_optimizer(
            self.model, job.optimizer_fn, spec.lr.peak_lr(self.global_batch), layout.strategy
        )
        self.ratios = lr_ratios(self.optimizer, spec.lr.peak_lr(self.global_batch))  # before a checkpoint's LRs load
        state = None
        origin = settings.lr_origin
        if self._restore is not None:  # the model and optimizer as the restart path loads them (DCP reshards)
            state, _ = load_checkpoint(self._restore, self.model, self.optimizer, aliases)
            if origin is None:
                origin = {"step": state.step, "schedule": state.schedule, "base_batch": state.base_batch}
        self.clock, self.base_batch = group_schedule(spec, self.global_batch, self.total_steps, origin)
        self.peak_lr = spec.lr.peak_lr(self.global_batch, self.base_batch)
        self.replica = LiveReplica(
            self.model,
            self.optimizer,
            lighthouse=settings.lighthouse,
            replica_id=settings.replica_id,
            store_addr=host,
            store_port=port,
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=settings.timeout_s),
            quorum_timeout=timedelta(seconds=settings.quorum_timeout_s),
        )
        if state is not None:
            self.replica.restore(state.step)
        # the restart path's step source (the same order, the same rows per rank); its share is set every step
        source = step_source(job, self._full_plan(1), ParallelDims.of(1), 0, cpu, IdRanges(), self._note)
        assert isinstance(source, IndexedSteps | ParquetSteps), "live mode runs deterministic mode only"
        self.steps = source
        faults.arm(job.run_dir, 0, 1)  # RAYTRAIN_FAULTS: rank and world are each step's quorum's (`at_step`)
        settle_heap()  # as the restart path's start does: no full collection mid-step
        return os.getpid(), ray.get_runtime_context().get_node_id(), self.total_steps

    def leave(self) -> None:
        """Ask this worker to stop at the next step boundary, the step it is in committed or redone by the others
        (its node is being drained). Called by the driver while `run` runs: the actor runs two calls at once."""
        self._leaving = True

    def _leave_now(self) -> bool:
        """Whether the group leaves before its next quorum: any of its ranks was asked (agreed over the group, so
        every rank stops at the same boundary)."""
        if self.settings.group_size == 1:
            return self._leaving
        import torch.distributed as dist

        flag = torch.tensor([int(self._leaving)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _note(self, line: str) -> None:
        """A line for the run's log (the step source's data-prefetch decision, the layout), from data rank 0 of
        the latest quorum only (each worker decides alike: the others' lines would repeat it)."""
        if self._rank == 0 and self._coords.tp == 0:
            self.log.note.remote(line)

    def _full_plan(self, ranks: int) -> BatchPlan:
        """The plan of a whole global batch over `ranks` data ranks (the step source splits an epoch's partial
        last step itself, as in the restart path)."""
        return split_step(self.global_batch, self.job.spec.batch.micro_batch, ranks)

    def lr_at(self, step: int) -> float:
        """The LR of step `step`: the restart path's (`scheduled_lr`: the peak for the global batch, by its rule,
        never the replica count, times the schedule at the step's position)."""
        return scheduled_lr(self.job, self.peak_lr, self.clock, step)

    def run(self) -> LiveOutcome:
        """Train steps until the run's last one; every quorum may have other participants. Raises
        `LiveReplicaLost` when the quorum fails, when this replica found no peer to heal from (its quorum is
        behind `settings.floor`) or when a collective inside its group failed on a peer rank that is gone
        (`peer_failure`: a group's ranks die one by one when its node goes, the first death breaks the others'
        FSDP or tp collectives before their own process ends), `NonFiniteError` for a non-finite step with
        on_nonfinite="stop", and what the user's code raises."""
        from raytrain.live.replica import LiveReplicaLost, live_share, peer_failure
        from raytrain.step import train_step

        spec, size = self.job.spec, self.dims.dp  # data ranks per group
        outcome = LiveOutcome(self.settings.replica_id, os.getpid())
        try:
            while True:
                if self._leave_now():
                    outcome.left = True
                    break
                quorum = self.replica.start_step()
                step = quorum.step
                if step < self.settings.floor:
                    raise LiveReplicaLost(
                        f"replica {self.settings.replica_id} found no peer to heal from: its quorum is at step "
                        f"{step}, the run had committed {self.settings.floor} steps"
                    )
                if step >= self.total_steps:
                    break
                epoch, sample_in_epoch = step_position(step, self.num_rows, self.global_batch, spec.batch.drop_last)
                ranks = quorum.participants * size  # every group's data ranks split the step
                self._rank = quorum.rank * size + self._coords.dp  # its tp peers read the same samples
                self.steps.set_share(self._full_plan(ranks), self._rank)
                data = self.steps.next_step(epoch, sample_in_epoch)
                assert data is not None, f"step {step + 1} is within the run: its epoch has it"
                share = live_share(step, data.plan.global_batch, spec.batch.micro_batch, ranks, self._rank)
                assert share.plan == data.plan, (share.plan, data.plan)  # the source split it as the share does
                faults.at_step(step + 1, self._rank, ranks)
                lr = self.lr_at(step)
                set_lr(self.optimizer, self.ratios, lr)
                started = time.perf_counter()
                # the groups compare their LR every step and a parameter checksum every FINGERPRINT_EVERY steps
                fingerprint = {"lr": lr}
                if step % FINGERPRINT_EVERY == 0:
                    fingerprint["parameter checksum"] = parameter_checksum(self.model)
                replication = self.replica.replication(self._gathered_ids(share, data.ids), fingerprint, step)
                result = train_step(
                    self.model,
                    self.optimizer,
                    self.job.loss_fn,
                    data.micro_batches,
                    replicas=ranks,
                    step_total=share.plan.global_batch,
                    max_grad_norm=spec.loop.max_grad_norm,
                    policy=self.policy,
                    seeds=MicroBatchSeeds(spec.loop.seed, step, share.offset, share.micro_batches, 0, None),
                    replication=replication,
                )
                outcome.first_step = step + 1 if outcome.first_step is None else outcome.first_step
                outcome.last_step = step + 1
                if not result.committed:
                    outcome.failed_steps.append(step + 1)
                    continue
                outcome.committed += 1
                loss = result.loss_sum / share.plan.global_batch
                if not result.stepped:
                    if spec.loop.on_nonfinite == "stop":
                        raise NonFiniteError.at(step + 1, loss, result.grad_norm)
                    outcome.skipped_steps += 1
                ids = None
                if spec.loop.audit_samples:
                    ids = data.ids if replication.ids is None else replication.ids
                self._record(step, epoch, sample_in_epoch, share, ids, lr, loss, result, started, quorum.rank)
        except Exception as err:
            # (the user's error on one rank leaves its process and the group's sockets up: the others wait, and
            # the driver gets that error, failed once)
            why = peer_failure(err) if self.settings.group_size > 1 and not isinstance(err, LiveReplicaLost) else None
            if why is None:
                raise
            raise LiveReplicaLost(
                f"replica {self.settings.replica_id}: a collective inside its group failed, a peer rank is gone ({why})"
            ) from err
        finally:
            self.replica.shutdown()
            self.steps.close()
        return outcome

    def _gathered_ids(self, share: LiveShare, mine: np.ndarray) -> torch.Tensor | None:
        """For the audit when each worker holds only its own slice's ids (the Parquet source): the step's ids
        with this slice filled in and zeros elsewhere, summed over its group here and over the groups in the
        step's all-reduce. None when no audit is asked for or the source knows every id of the step (in memory)."""
        if not self.job.spec.loop.audit_samples or not isinstance(self.steps, ParquetSteps):
            return None  # decided alike on every replica: all take part in the all-reduce, or none
        ids = torch.zeros(share.plan.global_batch, dtype=torch.int64)
        ids[share.offset : share.offset + share.count] = torch.from_numpy(np.asarray(mine, dtype=np.int64))
        if self.dims.dp > 1:  # over the group's data ranks (its tp peers hold the same slice)
            import torch.distributed as dist

            dist.all_reduce(ids, group=self._dp_group)
        return ids

    def _record(
        self,
        step: int,
        epoch: int,
        sample_in_epoch: int,
        share: LiveShare,
        ids: Any,
        lr: float,
        loss: float,
        result: Any,
        started: float,
        group_rank: int,
    ) -> None:
        """A committed step's metrics line (and sample ids), sent by rank 0 of every group that committed it (the
        log writes the first of each step, in order: a replica group may commit a step its peers did not); every
        `every_steps` steps the group of quorum rank 0 also sends a checkpoint (gathered over the group when it
        shards the model). Fire and forget: the state is copied when the call is made."""
        spec = self.job.spec
        done = step + 1
        per_epoch = steps_per_epoch(self.num_rows, self.global_batch, spec.batch.drop_last)
        epoch_samples = self.num_rows if not spec.batch.drop_last else per_epoch * self.global_batch
        if self.settings.shard_rank == 0:
            metrics: dict[str, Any] = {
                "step": done,
                "epoch": epoch,
                "world_size": share.participants * self.settings.tp,  # workers, as the restart path counts them
                "accumulation_steps": share.plan.accumulation_steps,
                "per_rank_samples": list(share.plan.per_rank_samples),
                "global_batch_size": share.plan.global_batch,
                "samples_seen": epoch * epoch_samples + sample_in_epoch + share.plan.global_batch,
                "lr": lr,
                "loss": loss,
                "grad_norm": result.grad_norm,
                "step_time_s": time.perf_counter() - started,
                "time": time.time(),
            }
            if not result.stepped:
                metrics["skipped"] = True  # on_nonfinite="skip": this step's update was dropped
            self.log.step.remote(self.settings.group, metrics, None if ids is None else [int(i) for i in ids])
        if group_rank == 0 and (done % spec.checkpoint.every_steps == 0 or done == self.total_steps):
            fault_point("checkpoint")
            state = self.replica.full_state()  # a collective over the group
            if state is not None:
                train_state = {
                    "step": done,
                    "epoch": epoch,
                    "sample_in_epoch": sample_in_epoch + share.plan.global_batch,
                    "samples_seen": epoch * epoch_samples + sample_in_epoch + share.plan.global_batch,
                    "world_size": share.participants * self.settings.tp,  # workers, as the restart path counts them
                    "global_batch": self.global_batch,
                    "base_batch": self.base_batch,
                    "peak_lr": self.peak_lr,
                    "schedule": self.clock.to_dict(),
                    "plan": share.plan.to_dict(),
                    "model": self.model_record,
                }
                self.log.checkpoint.remote(self.settings.group, pack_state(state), train_state)
            fault_point("report")
