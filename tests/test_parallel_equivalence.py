"""Tensor parallel (and tensor x data parallel) equals one process training on the whole batch, in float64.

Each world runs the real pieces on real gloo process groups (`raytrain.testing.multiprocess.run_world`): the layout
(`ParallelDims`, its device mesh), the toy GPT's tensor-parallel plan checked by `resolve_plan`, `apply_parallelism`
(TP, then FSDP2 or the by-hand all-reduce on the dp axis, meta init), the user's AdamW with parameter groups, the
batch plan computed for dp with the data indexed by the dp rank, and `train_step` with gradient clipping on the
global norm (and SGD with momentum, unclipped). Three steps with a global batch of 7 (uneven over dp = 2, with
accumulation) must give every rank the
parameters of plain torch in one process (mean loss over the 7 samples, one backward, torch's clipping, one step)
to 1e-9. A negative control normalises by W instead of dp and must miss.
"""

from __future__ import annotations

import functools
import traceback
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from raytrain.batch_plan import plan_batch
from raytrain.data import rank_micro_batches
from raytrain.optim import build_optimizer, call_optimizer_fn
from raytrain.parallel.apply import apply_parallelism, step_policy
from raytrain.parallel.dims import ParallelDims
from raytrain.parallel.tensor import resolve_plan
from raytrain.testing.multiprocess import run_world
from raytrain.toy import GPT, adamw_groups, next_token_loss, sgd, token_arrays
from raytrain.worker_loop import train_step

GLOBAL_BATCH = 7
STEPS = 3
LR = 0.01
MAX_GRAD_NORM = 0.5  # below the first step's norm: clipping acts, so the global norm must be right
TOLERANCE = 1e-9
SHAPE = {"vocab": 16, "context": 8, "width": 32, "head_dim": 8, "blocks": 2}


@dataclass(frozen=True)
class Case:
    world: int
    tp: int
    strategy: str
    cap: int  # micro-batch cap: with dp replicas, accumulation k = ceil(B / (cap * dp))
    optimizer: str = "adamw"  # "adamw": AdamW with parameter groups, clipped; "sgd": SGD with momentum, unclipped
    wrong_scale: bool = False  # negative control: normalise by W (every rank a replica) instead of dp

    @property
    def name(self) -> str:
        name = f"w{self.world}-tp{self.tp}-{self.strategy}-m{self.cap}-{self.optimizer}"
        return name + ("-wrong" if self.wrong_scale else "")


CASES = {
    2: [Case(2, 2, "ddp", cap=3)],  # tp 2, dp 1: k = 3 (3 + 2 + 2)
    4: [  # tp 2 x dp 2: 4 + 3 samples, k = 2
        Case(4, 2, "ddp", cap=2),
        Case(4, 2, "zero2", cap=2),
        Case(4, 2, "zero3", cap=2),
        Case(4, 2, "zero3", cap=2, optimizer="sgd"),
        # AdamW and clipping are blind to a constant gradient scale: the control uses SGD without clipping
        Case(4, 2, "zero3", cap=2, optimizer="sgd", wrong_scale=True),
    ],
}


def _columns() -> dict[str, np.ndarray]:
    return token_arrays(64, SHAPE["vocab"], SHAPE["context"], seed=3)


def _positions(step: int) -> np.ndarray:
    return np.random.default_rng(step).permutation(64)[:GLOBAL_BATCH]


def _meta_gpt() -> nn.Module:
    with torch.device("meta"):
        return GPT(**SHAPE).to(torch.float64)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


OPTIMIZERS = {"adamw": (adamw_groups, MAX_GRAD_NORM), "sgd": (sgd, None)}  # name -> (optimizer_fn, max_grad_norm)


@functools.cache
def _reference(optimizer_name: str) -> dict[str, torch.Tensor]:
    """Plain torch in one process, from the same (seed, module name) initial weights."""
    optimizer_fn, max_norm = OPTIMIZERS[optimizer_name]
    model = apply_parallelism(_meta_gpt(), "ddp", torch.device("cpu"), 1, seed=0)
    optimizer = call_optimizer_fn(optimizer_fn, model, LR)
    columns = _columns()
    for step in range(STEPS):
        picked = _positions(step)
        batch = {k: torch.from_numpy(v[picked]) for k, v in columns.items()}
        optimizer.zero_grad(set_to_none=True)
        next_token_loss(model, batch).mean().backward()
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if step == 0:
                assert norm > max_norm, f"norm {norm} does not clip; lower MAX_GRAD_NORM"
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _run_case(case: Case, rank: int) -> dict[str, torch.Tensor]:
    dims = ParallelDims.of(case.world, tp=case.tp)
    mesh = dims.build_mesh("cpu")
    model = _meta_gpt()
    plan = resolve_plan(model, model.tp_plan(), dims.tp)  # type: ignore[operator]
    model = apply_parallelism(model, case.strategy, torch.device("cpu"), dims, mesh=mesh, tp_plan=plan, seed=0)
    optimizer_fn, max_norm = OPTIMIZERS[case.optimizer]
    optimizer = build_optimizer(model, optimizer_fn, LR, case.strategy)
    policy = step_policy(case.strategy, dims, "fp32", "unsharded", mesh)
    batch_plan = plan_batch(GLOBAL_BATCH, case.cap, dims.dp)
    replica = dims.coords(rank).dp
    columns = _columns()
    for step in range(STEPS):
        micro = rank_micro_batches(columns, _positions(step), batch_plan, replica, torch.device("cpu"))
        replicas = case.world if case.wrong_scale else dims.dp
        train_step(model, optimizer, next_token_loss, micro, replicas, GLOBAL_BATCH, max_norm, policy)
    return {name: _full(p) for name, p in model.named_parameters()}


def _world_main(rank: int, world: int) -> dict[str, dict[str, object]]:
    results: dict[str, dict[str, object]] = {}
    for case in CASES[world]:
        try:
            results[case.name] = {"params": _run_case(case, rank), "error": None}
        except Exception:
            results[case.name] = {"params": None, "error": traceback.format_exc()}
        dist.barrier()
    return results


@functools.cache
def _world(world: int) -> list[dict[str, dict[str, object]]]:
    return run_world(_world_main, world, preload=("torch", "raytrain.worker_loop", "torch.distributed.tensor"))


def _max_error(case: Case) -> float:
    per_rank = _world(case.world)
    errors = [f"rank {r}:\n{res[case.name]['error']}" for r, res in enumerate(per_rank) if res[case.name]["error"]]
    assert not errors, f"{case.name} raised:\n" + "\n".join(errors)
    reference = _reference(case.optimizer)
    worst = 0.0
    for result in per_rank:
        params = result[case.name]["params"]
        assert isinstance(params, dict) and params.keys() == reference.keys()
        worst = max(worst, *(float((params[n] - reference[n]).abs().max()) for n in reference))
    return worst


@pytest.mark.parametrize("case", [c for cs in CASES.values() for c in cs if not c.wrong_scale], ids=lambda c: c.name)
def test_tensor_parallel_equals_one_process(case: Case) -> None:
    assert _max_error(case) < TOLERANCE


def test_normalising_by_world_instead_of_dp_misses() -> None:
    """The negative control: with tp 2 the world holds half as many replicas as ranks."""
    wrong = next(c for c in CASES[4] if c.wrong_scale)
    assert _max_error(wrong) > 1e-4
