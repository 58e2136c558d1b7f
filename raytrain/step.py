"""One optimizer step on one rank, in the order the user's own loop writes it.

    step = Step(model, optimizer, micro_batches, replicas, step_total, ...)
    for micro in step.micro_batches():       # this rank's share; the gradient sync only around the last one
        step.backward(loss_fn(model, micro))  # per-sample losses; normalised by the step's global sample count
    result = step.optimizer_step()           # all-reduced loss, global norm, clipping, skip when not finite

raytrain's own loop (`raytrain.worker_loop`) and a user's loop (`raytrain.session`) both train through this class:
the exact-batch arithmetic (each backward scaled by dp / B, so the summed gradient is the one big batch's mean)
lives here once. `train_step` is the same thing for a `loss_fn`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from raytrain.collectives import all_reduce_sum, all_reduce_sum_and_max
from raytrain.faults import fault_point
from raytrain.optim import clip_grad_norm_, global_grad_norm
from raytrain.parallel.apply import (
    SYNC_LAST_MICRO_STEP,
    StepPolicy,
    all_reduce_gradients,
    backward_sync,
    micro_step,
    tied_gradients,
)
from raytrain.parallel.idle import fill_missing_grads, zero_grads
from raytrain.parallel.pipeline import check_losses, pipeline_step, widen
from raytrain.parallel.sequence import sum_sequence_gradients

Batch = dict[str, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]
REDUCTIONS = ("none", "sum", "mean")


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step produced, the same on every rank: the global summed per-sample loss, the global
    gradient norm before clipping, and whether the optimizer stepped (False: a NaN or Inf was found)."""

    loss_sum: float
    grad_norm: float
    stepped: bool
    committed: bool = True  # False: the step's replication did not commit it (live mode); nothing was stepped


class Replication(Protocol):
    """The data-parallel reduction across replica groups when something other than the default process group does
    it: live mode's torchft manager (`raytrain.live.replica.TorchftReplication`), whose groups come and go between
    steps. The step calls `reduce` once every rank of the group holds its group's gradient (FSDP's reduce-scatter
    over the group done, or the whole gradient with one worker per group) and `commit` before stepping."""

    def reduce(self, gradients: list[torch.Tensor], loss_sum: float) -> float:
        """Average `gradients` (this rank's local tensors, in place) over the groups taking part and return
        `loss_sum` (the group's) summed over them; a failed peer leaves them undefined and `commit` False."""
        ...

    def commit(self) -> bool:
        """Whether every group taking part completed the step's reduction: only then is the update applied."""
        ...


class Step:
    """One optimizer step over this rank's `micro_batches` (collective: every rank walks its own micro-batches,
    then every rank calls `optimizer_step`). Zeroes the gradients when made.

    `replicas` is the number of data-parallel ranks DDP/FSDP average over, `step_total` the step's global sample
    count B: each backward adds its summed per-sample loss x dp / B, so after the average the gradient is the
    mean over the whole global batch, whatever the split. Gradients sync as `policy` says (by default on the last
    micro-step only). With `scaler` (fp16) the loss is scaled and the gradients unscaled before the norm.
    With `replication` (live mode) the default process group is one replica group's and `replicas` counts the
    ranks of every group taking part: the gradients and loss are then reduced across the groups by it, and the
    optimizer steps only when it commits.

    `agree`, when given, returns a few floats this rank wants maxed over every rank at the step's end (the loop's
    drain deadline, checkpoint progress, data wait and the steps' pace: `AgreementClock.values`): they ride in the
    loss's collective, which becomes one all-gather instead of two collectives a step; the maxima are in `agreed`
    after `optimizer_step`.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        micro_batches: list[Batch],
        replicas: int,
        step_total: int,
        max_grad_norm: float | None = None,
        policy: StepPolicy = SYNC_LAST_MICRO_STEP,
        scaler: torch.amp.GradScaler | None = None,
        agree: Callable[[], list[float]] | None = None,
        seeds: Callable[..., None] | None = None,
        replication: Replication | None = None,
    ) -> None:
        self.model, self.optimizer, self.policy, self.scaler = model, optimizer, policy, scaler
        self.seeds, self.replication = seeds, replication
        self._agree = agree
        self.agreed: list[float] | None = None
        self.replicas, self.total, self.max_grad_norm = replicas, step_total, max_grad_norm
        self._micro = micro_batches
        self._scale = replicas / step_total
        self._local_sum = 0.0
        self._current: Batch | None = None  # the micro-batch handed out and not yet backpropagated
        self._walked = False
        self.result: StepResult | None = None
        zero_grads(model, optimizer)

    @property
    def micro_batch_count(self) -> int:
        """How many micro-batches this rank trains in this step (it may differ between ranks by one)."""
        return len(self._micro)

    @property
    def samples(self) -> int:
        """This rank's sample count in this step."""
        return sum(len(next(iter(batch.values()))) for batch in self._micro)

    def micro_batches(self) -> Iterator[Batch]:
        """This rank's micro-batches (column tensors on the run's device), each inside its micro-step context: DDP's
        `no_sync` / FSDP's gradient sync off for all but the last, autocast when the precision asks for it. Call
        `backward` exactly once per micro-batch, inside the loop body."""
        if self.policy.pipeline is not None:
            raise RuntimeError("a pipeline-parallel step runs its micro-batches itself: call step.pipeline(loss_fn)")
        if self._walked:
            raise RuntimeError("step.micro_batches() is walked once per step")
        self._walked = True
        last = len(self._micro) - 1
        for j, batch in enumerate(self._micro):
            with micro_step(self.model, last=j == last, policy=self.policy):
                if self.seeds is not None:
                    self.seeds(j)
                fault_point("forward")
                self._current = batch
                yield batch
                if self._current is not None:
                    raise RuntimeError(
                        f"micro-batch {j + 1} of {len(self._micro)} ended without step.backward(loss): call it once "
                        "per micro-batch (the gradient sync of the step happens in the last one's backward)"
                    )

    def backward(self, loss: torch.Tensor, reduction: str = "none") -> None:
        """Backpropagate the current micro-batch's loss, scaled for the exact global-batch mean.

        `loss` is one loss per sample of the micro-batch (shape [n], `reduction="none"`, the default), or a 0-d
        tensor with `reduction="sum"` (the sum of its per-sample losses) or `"mean"` (their mean; multiplied by
        the micro-batch's n here). A ValueError names the shape otherwise; a mean given as "none" would be wrong.
        A micro-batch with no sample (the batch plan gives some ranks none, e.g. micro_batch 1 at B = 10, W = 3)
        adds nothing to the step, whatever its loss is (the mean of no samples is NaN): its backward still runs,
        so this rank joins the gradient sync. That backward goes through your loss's graph, so the loss must come
        from the model's forward on that (empty) micro-batch, and a term over the parameters alone must not be
        divided by the sample count (0 x inf in the chain rule would make the gradients NaN).
        """
        batch = self._current
        if batch is None:
            raise RuntimeError("step.backward(loss) belongs inside `for micro in step.micro_batches():`, once each")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        rows = len(next(iter(batch.values())))
        if reduction == "none":
            check_losses(loss, batch)
            summed = widen(loss).sum()
        elif loss.dim() != 0:
            raise ValueError(f"reduction={reduction!r} takes a 0-d loss, got shape {tuple(loss.shape)}")
        else:
            summed = widen(loss) * (rows if reduction == "mean" else 1)
        if rows == 0:  # the plan gave this rank no sample here: it adds nothing, yet its backward joins the sync
            summed = torch.nan_to_num(summed, nan=0.0, posinf=0.0, neginf=0.0) * 0.0  # a mean over none is NaN
        fault_point("backward")
        scaled = summed * self._scale
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        self._local_sum += float(summed.detach())
        self._current = None

    def pipeline(self, loss_fn: LossFn) -> None:
        """A pipeline stage's forwards and backwards of all its micro-batches in the layout's schedule (GPipe,
        1F1B or interleaved 1F1B; collective over the stages)."""
        assert self.policy.pipeline is not None, "not a pipeline-parallel step"
        device = next(self.model.parameters()).device
        sync = backward_sync(self.model, self.policy)
        self._local_sum += pipeline_step(
            self.model,
            self._micro,
            loss_fn,
            self._scale,
            self.policy.pipeline,
            device,
            sync,
            autocast_dtype=self.policy.autocast_dtype,
            seeds=self.seeds,
            stats=self.policy.pipeline_stats,
        )
        self._walked = True

    def train(self, loss_fn: LossFn) -> StepResult:
        """The whole step for `loss_fn(model, batch) -> per-sample losses`: every micro-batch, then the update."""
        if self.policy.pipeline is not None:
            self.pipeline(loss_fn)
        else:
            for batch in self.micro_batches():
                self.backward(loss_fn(self.model, batch))
        return self.optimizer_step()

    def optimizer_step(self, optimizer: torch.optim.Optimizer | None = None) -> StepResult:
        """Finish the step (collective): sync what the policy syncs here, sum the loss over the ranks (with the
        `agree` values, in one all-gather), take the global
        gradient norm (which with the loss decides, identically on every rank, whether the step is finite), clip
        to `max_grad_norm`, and step the optimizer; a step with a NaN or Inf is skipped (`stepped` False). With
        `scaler` (fp16) overflowing gradients are the scaler's to skip. `optimizer`, when given, must be the
        step's own (the one `Session.prepare` returned)."""
        if optimizer is not None and optimizer is not self.optimizer:
            raise ValueError("step.optimizer_step(optimizer): not the optimizer that run.prepare(...) returned")
        if self.result is not None:
            raise RuntimeError("step.optimizer_step() was already called for this step")
        if not self._walked and self._micro:
            raise RuntimeError("step.optimizer_step() before the step's micro-batches were trained")
        if self._current is not None:
            raise RuntimeError("step.optimizer_step() inside the micro-batch loop: call it after the loop")
        model, optimizer, policy, scaler = self.model, self.optimizer, self.policy, self.scaler
        if policy.all_reduce_gradients:
            all_reduce_gradients(model.parameters(), policy.dp_group, self.replicas)
        if policy.stage_ties:
            tied_gradients(model, policy)
        if policy.sequence_group is not None:
            sum_sequence_gradients(model, policy.sequence_group)
        fill_missing_grads(model.parameters())  # a parameter no sample used: a zero gradient at every W
        fault_point("optimizer")
        if scaler is not None:
            scaler.unscale_(optimizer)
        local = self._local_sum if policy.counts_loss else 0.0
        maxed = self._agree() if self._agree is not None else []
        if policy.unit_calls is not None:  # every rank must have run the same FSDP units: max == min
            signature = policy.unit_calls.signature()
            maxed = [*maxed, signature, -signature]
        if not maxed:
            loss_sum = all_reduce_sum(local)
        else:
            loss_sum, agreed = all_reduce_sum_and_max(local, maxed)
            if policy.unit_calls is not None:
                most, least = agreed[-2], -agreed[-1]
                agreed = agreed[:-2]
                if most != least:
                    raise RuntimeError(
                        "the ranks ran different FSDP units in this step (a module called on some ranks only, such "
                        "as an expert or a branch, is an FSDP unit): their all-gathers paired with each other's, so "
                        "the update is not applied; pass units_fn without that module (raytrain's driver leaves out "
                        "the ones its sample forwards find)"
                    )
            if self._agree is not None:
                self.agreed = agreed
        if self.replication is not None:
            loss_sum = self.replication.reduce(replicated_gradients(model), loss_sum)
        norm = global_grad_norm(policy.norm_parameters(model) if policy.stage_ties else model.parameters())
        if policy.pp_group is not None:  # each stage holds its own parameters: the squares add up over the pipeline
            norm = torch.tensor(math.sqrt(all_reduce_sum(float(norm) ** 2, policy.pp_group)), dtype=norm.dtype)
        finite = math.isfinite(loss_sum) and (scaler is not None or bool(torch.isfinite(norm)))
        committed = self.replication is None or self.replication.commit()
        if not finite or not committed:
            zero_grads(model, optimizer)
            self.result = StepResult(loss_sum, float(norm), stepped=False, committed=committed)
            return self.result
        if self.max_grad_norm is not None:
            clip_grad_norm_(model.parameters(), self.max_grad_norm, norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        self.result = StepResult(loss_sum, float(norm), stepped=True)
        return self.result

    @property
    def loss(self) -> float:
        """The step's mean per-sample loss over the whole global batch (the same on every rank), once stepped."""
        if self.result is None:
            raise RuntimeError("step.loss is known after step.optimizer_step()")
        return self.result.loss_sum / self.total


def replicated_gradients(model: nn.Module) -> list[torch.Tensor]:
    """The local gradient tensors of every trainable parameter, in the model's order (a DTensor's local shard;
    zeros where a parameter got no gradient, as one process on the whole batch would see it): what a
    `Replication` reduces. Every replica group lists the same tensors in the same order, whatever branches its
    samples took."""
    from torch.distributed.tensor import DTensor

    grads = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
    return grads


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    micro_batches: list[Batch],
    replicas: int,
    step_total: int,
    max_grad_norm: float | None = None,
    policy: StepPolicy = SYNC_LAST_MICRO_STEP,
    scaler: torch.amp.GradScaler | None = None,
    seeds: Callable[..., None] | None = None,
    replication: Replication | None = None,
) -> StepResult:
    """One optimizer step over this rank's micro-batches with `loss_fn` (collective: every rank calls it); see
    `Step` for the arithmetic. `seeds(j)`, when given, seeds micro-batch j's random ops (`raytrain.rng`);
    `replication` reduces across live mode's replica groups."""
    step = Step(
        model,
        optimizer,
        micro_batches,
        replicas,
        step_total,
        max_grad_norm,
        policy,
        scaler,
        seeds=seeds,
        replication=replication,
    )
    return step.train(loss_fn)
