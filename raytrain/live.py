"""Live recovery's step (issue 17, first part): data-parallel replicas as torchft replica groups that split each
step's exact global batch among the replicas taking part in that step.

torchft (https://github.com/pytorch/torchft) forms a quorum of replica groups at every step through a lighthouse;
a replica that dies is dropped from the next quorum while the others go on, and a replacement (or a replica that
fell behind) receives the model and optimizer state from a healthy peer before it takes part. What torchft does
not do is keep the batch: its replicas each train their own batch, so the effective batch shrinks with them.
`LiveReplica` adds raytrain's rule on top:

* at step s the P participants split that step's B samples (global positions s·B .. s·B + B - 1 of the order) with
  the batch plan computed for P (`raytrain.batch_plan.plan_batch(B, micro_batch, P)`); participant r takes its
  contiguous slice in its micro-batches;
* each participant's loss is the sum of its per-sample losses times P / B, and torchft averages the gradients over
  the P participants, so the update is the mean over all B samples: the same as one process on the whole batch,
  whatever P is;
* the optimizer steps only when torchft's `should_commit` agrees on every replica. A replica that fails mid-step
  makes the step fail everywhere (not half-applied); the next quorum redoes the same step s, with the same B
  samples, split over the new participants.

This module is the step alone, run by one process per replica group (tested with real torchft processes, a
lighthouse and a kill in `tests/test_live.py`). The Ray Train integration (`ClusterConfig(recovery="live")`, the
demo and the benchmark) is not built yet; see the README's "Not yet".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from raytrain.batch_plan import BatchPlan, plan_batch


@dataclass(frozen=True)
class LiveShare:
    """This replica's part of step `step`: `participants` replicas take part and this one is `rank` among them;
    it trains the global positions [begin, begin + count) of the order in `micro_batches`."""

    step: int
    participants: int
    rank: int
    plan: BatchPlan
    begin: int

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


def live_share(step: int, global_batch: int, micro_batch: int, participants: int, rank: int) -> LiveShare:
    """Pure: participant `rank` of `participants`'s share of step `step` (global positions start at
    step x global_batch). Raises `ValueError` unless 0 <= rank < participants."""
    if not 0 <= rank < participants:
        raise ValueError(f"rank must be in [0, participants={participants}), got {rank}")
    plan = plan_batch(global_batch, micro_batch, participants)
    begin = step * global_batch + sum(plan.per_rank_samples[:rank])
    return LiveShare(step, participants, rank, plan, begin)


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
        pg = ProcessGroupGloo(timeout=timeout)
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

    def start_step(self, global_batch: int, micro_batch: int) -> LiveShare:
        """Join this step's quorum (healing from a peer first when behind) and return this replica's share of the
        step torchft says is next (`manager.current_step()`, the committed steps so far)."""
        self.manager.start_quorum()
        rank = self.manager.participating_rank()
        assert rank is not None, "a synchronous quorum always makes this replica a participant"
        return live_share(self.manager.current_step(), global_batch, micro_batch, self.manager.num_participants(), rank)

    def train_step(
        self,
        share: LiveShare,
        micro_batches: Iterator[dict[str, torch.Tensor]],
        loss_fn: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor],
        fault: Callable[[], None] = lambda: None,
    ) -> tuple[bool, float]:
        """Forward/backward of `share`'s micro-batches (the per-sample losses times `share.loss_scale`), the
        gradients averaged over the participants, and the optimizer step if and only if every replica commits.
        Returns (committed, this replica's summed per-sample loss). `fault` is called between the backward and
        the gradient all-reduce (tests kill a replica there)."""
        self.optimizer.zero_grad(set_to_none=False)
        for p in self.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        local = 0.0
        for batch in micro_batches:
            losses = loss_fn(self.model, batch)
            (losses.sum() * share.loss_scale).backward()
            local += float(losses.detach().sum())
        fault()
        works = [self.manager.allreduce(p.grad) for p in self.model.parameters() if p.grad is not None]
        for work in works:
            work.wait()
        committed = self.manager.should_commit()
        if committed:
            self.optimizer.step()
        return committed, local

    def shutdown(self) -> None:
        """Leave the quorum and stop torchft's background threads."""
        self.manager.shutdown(wait=False)
