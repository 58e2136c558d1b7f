"""Live recovery's step: data-parallel replicas as torchft replica groups that split each step's exact global batch
among the replicas taking part in that step.

torchft (https://github.com/pytorch/torchft) forms a quorum of replica groups at every step through a lighthouse;
a replica that dies is dropped from the next quorum while the others go on, and a replacement (or a replica that
fell behind) receives the model and optimizer state from a healthy peer before it takes part. What torchft does
not do is keep the batch: its replicas each train their own batch, so the effective batch shrinks with them.
raytrain adds its rule on top:

* a replica group is dp_shard x tp workers (`ParallelConfig(dp_shard=..., tp=...)`; one by default): dp_shard data
  ranks that shard the model among themselves (zero2/zero3: FSDP2 over the group's own process group), each of tp
  workers splitting its layers; torchft's HSDP: torchft replicates across groups, each rank with the same rank of
  the other groups;
* at step s the P groups' P x dp_shard data ranks split that step's B samples (global positions s·B .. s·B + B - 1
  of the order) with the batch plan computed for them (`raytrain.batch_plan.split_step`); data rank
  q·dp_shard + k (group q of the quorum, k its dp coordinate in the group) takes its contiguous slice in its
  micro-batches, the same slice on each of its tp workers;
* the step is the restart path's (`raytrain.step.Step`): each backward scaled by P·dp_shard / B, FSDP averaging
  over the group, then `TorchftReplication` averaging over the P groups: the update is the mean over all B
  samples, the same as one process on the whole batch, whatever P is;
* the optimizer steps only when torchft's `should_commit` says so. A replica group that fails mid-step makes the
  step's collective fail on the others, which then do not commit it (never half-applied); the next quorum
  redoes the same step s, with the same B samples, split over the new participants. `should_commit` is decided
  per replica group: if one group committed a step that another did not, the other is behind at the next
  quorum and heals from a peer, so every replica holds the committed update.

This module is torchft's side of one rank (tested with real torchft processes, a lighthouse and a kill in
`tests/test_live.py`); `raytrain.live.worker` runs it in a Ray actor over the run's data, `raytrain.live.driver`
keeps the replica groups going.
"""

from __future__ import annotations

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


class LiveReplicaLost(RuntimeError):
    """This replica cannot go on live: its quorum failed (a timeout, the lighthouse gone), it found no peer to
    heal from, or a collective inside its group failed because another rank of the group is gone. The driver
    treats it as a lost replica, never as a bug in the user's code."""


# What gloo's transport says when the other end of a pair went away (gloo raises a plain RuntimeError whose message
# names its transport source file; NCCL and the stores raise `torch.distributed.DistError` subclasses)
_GLOO_TRANSPORT = "gloo/transport/"


def peer_failure(err: BaseException) -> str | None:
    """Pure: why `err`, raised by a collective of a replica group's own process group (FSDP's all-gather, tp's
    all-reduce), says a peer rank of the group is gone rather than the user's code failing, in words: a
    `torch.distributed.DistError` (NCCL, a store, the network) or a gloo transport error ("Connection closed by
    peer", "Connection reset by peer", a timed-out read; its raw text stays out of the console line: it reaches
    the driver only inside the `RayTaskError`'s traceback, which raytrain.log does not keep yet). None for any
    other exception, which stays the user's error (failed once, never retried)."""
    from torch.distributed import DistError

    if isinstance(err, DistError):
        return f"{type(err).__name__} from the group's process group"
    if isinstance(err, RuntimeError) and _GLOO_TRANSPORT in str(err):
        return "RuntimeError from gloo's transport: its connection to a peer rank broke"
    return None


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


def live_share(step: int, step_batch: int, micro_batch: int, participants: int, rank: int) -> LiveShare:
    """Pure: participant `rank` of `participants`'s share of step `step`, whose batch holds `step_batch` samples
    (the global batch; fewer only at the end of an epoch without drop_last, possibly fewer than the participants:
    then some get none, and train an empty micro-batch, as in the restart path's `split_step`). Raises
    `ValueError` unless 0 <= rank < participants."""
    if not 0 <= rank < participants:
        raise ValueError(f"rank must be in [0, participants={participants}), got {rank}")
    return LiveShare(step, participants, rank, split_step(step_batch, micro_batch, participants))


FINGERPRINT_EVERY = 10  # steps between the groups' comparison of a parameter checksum (the LR: every step)


class ReplicasDisagree(RuntimeError):
    """The replica groups of a step hold different LRs or parameters: their updates would drift apart."""


def disagreement(names: list[str], sums: list[float], squares: list[float], participants: int) -> str | None:
    """Pure: which of the fingerprint values `names` differ across the `participants` replica groups, from their
    sums and sums of squares over the groups (all equal: a variance of 0, up to rounding); None when none does."""
    if participants < 2:
        return None
    differ = []
    for name, total, square in zip(names, sums, squares, strict=True):
        mean = total / participants
        spread = max(0.0, square / participants - mean * mean) ** 0.5
        if spread > 1e-6 * max(abs(mean), 1e-30):
            differ.append(f"{name} {mean:.6g} on average with a spread of {spread:.3g} across {participants} groups")
    return "; ".join(differ) or None


def parameter_checksum(model: torch.nn.Module) -> float:
    """The sum of squares of this rank's parameters (its shards' local parts), in float64: the same number on the
    same rank of every replica group in step."""
    parts = [(p.to_local() if hasattr(p, "to_local") else p).detach().double().pow(2).sum() for p in model.parameters()]
    return float(torch.stack(parts).sum()) if parts else 0.0  # one device sync, not one per tensor


class TorchftReplication:
    """The dp-axis reduction of live mode (a `raytrain.step.Replication`): the gradients averaged and the loss
    summed over the replica groups of this step's quorum through torchft's manager, and `commit` its
    `should_commit`. Each rank of a group reduces with the same rank of every other group (its shard, when the
    group shards the model). `ids` (int64, the step's sample ids: this group's slices filled in, zeros elsewhere)
    is summed with them, so every participant holds the step's ids afterwards (the audit's, when each replica
    reads only its own slice)."""

    def __init__(
        self,
        manager: Any,
        pg: Any,
        ids: torch.Tensor | None = None,
        fingerprint: dict[str, float] | None = None,
        step: int = 0,
    ) -> None:
        self.manager, self.pg, self.ids = manager, pg, ids
        self.fingerprint, self.step = fingerprint or {}, step

    def reduce(self, gradients: list[torch.Tensor], loss_sum: float) -> float:
        """One all-reduce per dtype over the flattened gradients (averaged over the participants), one for the
        loss and one for the ids (summed); a peer that died mid-collective closes this rank's connections at once
        (a survivor still waiting on it then fails now, not at the collective timeout)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in gradients:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        flats = {dtype: torch.cat([g.reshape(-1) for g in grads]) for dtype, grads in by_dtype.items()}
        values = list(self.fingerprint.values())  # summed with the loss, and their squares: no collective more
        loss = torch.tensor([loss_sum, *values, *(v * v for v in values)], dtype=torch.float64)
        works = [self.manager.allreduce(flat) for flat in flats.values()]
        works.append(self.manager.allreduce(loss, reduce_op=ReduceOp.SUM))
        if self.ids is not None:
            works.append(self.manager.allreduce(self.ids, reduce_op=ReduceOp.SUM))
        for work in works:
            work.wait()
        if self.manager.errored() is not None:
            self.pg.abort()
        for dtype, grads in by_dtype.items():
            offset = 0
            for g in grads:
                g.copy_(flats[dtype][offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        if values and self.manager.errored() is None:
            n = len(values)
            sums, squares = loss[1 : 1 + n].tolist(), loss[1 + n :].tolist()
            differ = disagreement(list(self.fingerprint), sums, squares, self.manager.num_participants())
            if differ is not None:
                raise ReplicasDisagree(f"live: the replica groups disagree at step {self.step + 1}: {differ}")
        return float(loss[0])

    def commit(self) -> bool:
        """torchft's vote: True when every rank of this group completed the step's collectives.
        `LiveReplicaLost` when the vote cannot be taken: it is a call to the manager server that the group's rank 0
        serves, gone with that rank's process or node. Any exception counts: torchft's client raises a plain
        `RuntimeError` whatever the cause ("transport error" for a server gone, a timeout for one that does not
        answer), and no user code runs inside the call."""
        try:
            return bool(self.manager.should_commit())
        except Exception as err:
            raise LiveReplicaLost(f"the step's commit vote failed: {type(err).__name__}: {err}") from err


class LiveReplica:
    """One replica group's torchft side on one of its ranks: a `Manager` over `model` and `optimizer` (this rank's
    state, its shard when the group shards the model, is what the same rank of a healing group receives).

    `lighthouse`: the torchft lighthouse's address; `replica_id`: unique per replica group; `rank` of
    `world_size`: this worker's rank in its group; `store_addr`/`store_port`: the group's TCP store (served by
    its rank 0). Timeouts bound how long a failure stalls the survivors: a dead peer's all-reduce fails after
    `timeout`.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        lighthouse: str,
        replica_id: str,
        store_addr: str,
        store_port: int,
        rank: int = 0,
        world_size: int = 1,
        timeout: timedelta = timedelta(seconds=5),
        quorum_timeout: timedelta = timedelta(seconds=30),
    ) -> None:
        from torchft import Manager, ProcessGroupGloo
        from torchft.checkpointing.pg_transport import PGTransport

        self.model, self.optimizer, self.rank = model, optimizer, rank
        pg = self._pg = ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=pg,
            load_state_dict=self._load_state_dict,
            state_dict=self._state_dict,
            min_replica_size=1,
            use_async_quorum=False,  # healing completes before the step's forward
            timeout=timeout,
            quorum_timeout=quorum_timeout,
            connect_timeout=quorum_timeout,
            rank=rank,
            world_size=world_size,
            store_addr=store_addr,
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

    def restore(self, step: int) -> None:
        """The step count of the checkpoint the group's model and optimizer were loaded from (before the first
        quorum), so the replicas of a restarted group go on from its step."""
        self.manager.load_state_dict({"step": step, "batches_committed": step})

    def full_state(self) -> dict[str, Any] | None:
        """The whole model and optimizer state, keyed by parameter name, on the CPU, the optimizer's flattened as
        the restart path's checkpoints store it: what a live checkpoint holds, at any group sharding. A
        collective over the group when it shards the model: every rank calls it, rank 0 gets the state, the
        others None."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True)
        model, optim = get_state_dict(self.model, self.optimizer, options=options)
        return {"model": model, "optim": optim} if self.rank == 0 else None

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

    def replication(
        self, ids: torch.Tensor | None = None, fingerprint: dict[str, float] | None = None, step: int = 0
    ) -> TorchftReplication:
        """This step's reduction across the replica groups (`raytrain.step.Step(replication=...)`); `fingerprint`
        (name -> value, the same names on every group at `step`) is compared across them in the loss's
        all-reduce: `ReplicasDisagree` when a value differs."""
        return TorchftReplication(self.manager, self._pg, ids, fingerprint, step)

    def shutdown(self) -> None:
        """Leave the quorum and stop torchft's background threads."""
        self.manager.shutdown(wait=False)
