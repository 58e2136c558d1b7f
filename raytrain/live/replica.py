"""Live recovery's step: data-parallel replicas as torchft replica groups that split each step's exact global batch
among the replicas taking part in that step.

torchft (https://github.com/pytorch/torchft) forms a quorum of replica groups at every step through a lighthouse;
a replica that dies is dropped from the next quorum while the others go on, and a replacement (or a replica that
fell behind) receives the model and optimizer state from a healthy peer before it takes part. What torchft does
not do is keep the batch: its replicas each train their own batch, so the effective batch shrinks with them.
`LiveReplica` adds raytrain's rule on top:

* at step s the P participants split that step's B samples (global positions s·B .. s·B + B - 1 of the order) with
  the batch plan computed for P (`raytrain.batch_plan.split_step(B, micro_batch, P)`); participant r takes its
  contiguous slice in its micro-batches;
* each participant's loss is the sum of its per-sample losses times P / B, and torchft averages the gradients over
  the P participants, so the update is the mean over all B samples: the same as one process on the whole batch,
  whatever P is;
* the optimizer steps only when torchft's `should_commit` says so. A replica that fails mid-step makes the
  step's collective fail on the others, which then do not commit it (never half-applied); the next quorum
  redoes the same step s, with the same B samples, split over the new participants. `should_commit` is decided
  per replica group: if one group committed a step that another did not, the other is behind at the next
  quorum and heals from a peer, so every replica holds the committed update.

This module is the step alone, run by one process per replica group (tested with real torchft processes, a
lighthouse and a kill in `tests/test_live.py`); `raytrain.live.worker` runs it in a Ray actor over the run's data,
`raytrain.live.driver` keeps the replicas going.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.distributed import ReduceOp

from raytrain.batch_plan import BatchPlan, split_step


@dataclass(frozen=True)
class Quorum:
    """What torchft's quorum for the next step says: the step (optimizer steps committed so far), how many
    replicas take part and this replica's rank among them."""

    step: int
    participants: int
    rank: int


@dataclass(frozen=True)
class LiveStep:
    """What `LiveReplica.train_step` did: whether this replica group committed the step, the step's mean
    per-sample loss over all its samples and the norm of the averaged gradient (before clipping), and whether
    both are finite (if not, nothing was stepped, as in the restart path)."""

    committed: bool
    loss: float
    grad_norm: float
    finite: bool
    ids: torch.Tensor | None = None  # the step's sample ids summed over the participants (`train_step`'s `ids`)


class LiveReplicaLost(RuntimeError):
    """This replica cannot go on live: its quorum failed (a timeout, the lighthouse gone) or it found no peer to
    heal from. The driver treats it as a lost replica, never as a bug in the user's code."""


@dataclass(frozen=True)
class LiveShare:
    """This replica's part of step `step`: `participants` replicas take part and this one is `rank` among them;
    it trains the step's samples [offset, offset + count) (in the step's order) in `micro_batches`."""

    step: int
    participants: int
    rank: int
    plan: BatchPlan

    @property
    def offset(self) -> int:
        """Where this replica's slice starts among the step's samples."""
        return sum(self.plan.per_rank_samples[: self.rank])

    @property
    def count(self) -> int:
        """Samples this replica trains in the step."""
        return self.plan.per_rank_samples[self.rank]

    @property
    def micro_batches(self) -> tuple[int, ...]:
        """Sizes of this replica's micro-batches (some may be 0 when B < P x accumulation)."""
        return self.plan.micro_batches[self.rank]

    @property
    def loss_scale(self) -> float:
        """Multiplier of the summed per-sample loss: P / B (torchft averages the gradients over P)."""
        return self.participants / self.plan.global_batch


def live_share(step: int, step_batch: int, micro_batch: int, participants: int, rank: int) -> LiveShare:
    """Pure: participant `rank` of `participants`'s share of step `step`, whose batch holds `step_batch` samples
    (the global batch; fewer only at the end of an epoch without drop_last, possibly fewer than the participants:
    then some get none, and train an empty micro-batch, as in the restart path's `split_step`). Raises
    `ValueError` unless 0 <= rank < participants."""
    if not 0 <= rank < participants:
        raise ValueError(f"rank must be in [0, participants={participants}), got {rank}")
    return LiveShare(step, participants, rank, split_step(step_batch, micro_batch, participants))


class LiveReplica:
    """One replica group's side of a live run: a torchft `Manager` over `model` and `optimizer` (its state is what
    a healing peer receives), and the exact-batch step.

    `lighthouse`: the torchft lighthouse's address; `replica_id`: unique per replica group; `store_port`: a free
    port for this group's own TCP store (one worker per group here). Timeouts bound how long a failure stalls the
    survivors: a dead peer's all-reduce fails after `timeout`.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        lighthouse: str,
        replica_id: str,
        store_port: int,
        timeout: timedelta = timedelta(seconds=5),
        quorum_timeout: timedelta = timedelta(seconds=30),
    ) -> None:
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo
        from torchft.checkpointing.pg_transport import PGTransport

        self.model, self.optimizer = model, optimizer
        self._store = TCPStore("127.0.0.1", store_port, 1, is_master=True, wait_for_workers=False)
        pg = self._pg = ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=pg,
            load_state_dict=self._load_state_dict,
            state_dict=self._state_dict,
            min_replica_size=1,
            use_async_quorum=False,  # healing completes before the step's forward
            timeout=timeout,
            quorum_timeout=quorum_timeout,
            rank=0,
            world_size=1,
            store_addr="127.0.0.1",
            store_port=store_port,
            lighthouse_addr=lighthouse,
            replica_id=replica_id,
            checkpoint_transport=PGTransport(pg, timeout=quorum_timeout, device=torch.device("cpu")),
        )

    def _state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])

    def restore(self, state: dict[str, Any]) -> None:
        """Load a live checkpoint (`state_dict()`'s form) before the first quorum: model, optimizer and the step
        count, so the replicas of a restarted group go on from its step."""
        self._load_state_dict(state)
        self.manager.load_state_dict(state["manager"])

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and torchft's step count: what a live checkpoint holds."""
        return {**self._state_dict(), "manager": self.manager.state_dict()}

    def start_step(self) -> Quorum:
        """Join this step's quorum (healing from a peer first when behind) and return it; its step is the one
        torchft says is next (`manager.current_step()`, the committed steps so far)."""
        try:
            self.manager.start_quorum()
        except Exception as err:  # torchft's quorum timeout or a lighthouse that went away
            raise LiveReplicaLost(f"quorum failed: {type(err).__name__}: {err}") from err
        rank = self.manager.participating_rank()
        assert rank is not None, "a synchronous quorum always makes this replica a participant"
        return Quorum(self.manager.current_step(), self.manager.num_participants(), rank)

    def train_step(
        self,
        share: LiveShare,
        micro_batches: Iterator[dict[str, torch.Tensor]],
        loss_fn: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor],
        fault: Callable[[str], None] = lambda phase: None,
        max_grad_norm: float | None = None,
        ids: torch.Tensor | None = None,
    ) -> LiveStep:
        """Forward/backward of `share`'s micro-batches (the per-sample losses times `share.loss_scale`), the
        gradients of the trainable parameters averaged over the participants, and then, if this replica group
        commits (torchft's `should_commit`) and the averaged loss and gradient are finite: clipping to
        `max_grad_norm` (the norm of the averaged gradient, the same on every replica) and the optimizer step.
        `fault(phase)` is called between each forward and its backward ("backward") and between the last backward
        and the gradient all-reduce ("optimizer"): where `raytrain.faults` and the tests kill a replica. `ids`
        (int64, one per sample of the step: this replica's slice filled in, zeros elsewhere) is summed over the
        participants with the gradients, so every participant returns the step's ids (the audit's, when each
        replica reads only its own slice)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer.zero_grad(set_to_none=False)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        local = 0.0
        for batch in micro_batches:
            losses = loss_fn(self.model, batch)
            fault("backward")
            (losses.sum() * share.loss_scale).backward()
            local += float(losses.detach().sum())
        fault("optimizer")
        loss = torch.tensor([local * share.loss_scale], dtype=torch.float64)  # averaged over P: sum / B
        works = [self.manager.allreduce(t) for t in (*(p.grad for p in params if p.grad is not None), loss)]
        if ids is not None:
            works.append(self.manager.allreduce(ids, reduce_op=ReduceOp.SUM))
        for work in works:
            work.wait()
        if self.manager.errored() is not None:
            # A peer died mid-collective. Close this replica's connections at once: a survivor still waiting on
            # this one (a ring passes through every replica) then fails now instead of at the collective timeout.
            self._pg.abort()
        committed = self.manager.should_commit()
        mean = float(loss)
        norm = float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
        finite = math.isfinite(mean) and math.isfinite(norm)
        if committed and finite:
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            self.optimizer.step()
        return LiveStep(committed, mean, norm, finite, ids)

    def shutdown(self) -> None:
        """Leave the quorum and stop torchft's background threads."""
        self.manager.shutdown(wait=False)
