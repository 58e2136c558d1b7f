"""Tensor and pipeline parallel, alone and with data parallel, equal one process training on the whole batch, in
float64.

Each world runs the real pieces on real gloo process groups (`raytrain.testing.multiprocess.run_world`): the layout
(`ParallelDims`, its device mesh), the tensor-parallel plans checked by `resolve_plan` (the toy GPT's; the block
MLP's), `apply_parallelism` (pipeline stage, TP, then FSDP2 or the by-hand all-reduce on the dp axis, meta init), the
GPipe and 1F1B schedules over the plan's uneven micro-batches (the block MLP, an `nn.Sequential`; the toy GPT,
transformers' Llama and GPT-2, cut by their splits), the user's AdamW with
parameter groups, the
batch plan computed for dp with the data indexed by the dp rank, and `train_step` with gradient clipping on the
global norm (and SGD with momentum, unclipped). Three steps with a global batch of 7 (uneven over dp = 2, with
accumulation) must give every rank the
parameters of plain torch in one process (mean loss over the 7 samples, one backward, torch's clipping, one step)
to 1e-10. A negative control normalises by W instead of dp and must miss.
"""

from __future__ import annotations

import functools
import os
import shutil
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from user_models import DropoutDecoder, gpt2, llama

from raytrain.batch_plan import plan_batch
from raytrain.data.materialized import rank_micro_batches
from raytrain.model_init import MetaBuild, record_build
from raytrain.model_tensors import tie_aliases, tie_groups
from raytrain.optim import build_optimizer, call_optimizer_fn
from raytrain.parallel.apply import apply_parallelism, step_policy, unwrap
from raytrain.parallel.dims import ParallelDims
from raytrain.parallel.pipeline import stage_ties
from raytrain.parallel.tensor import resolve_plan
from raytrain.rng import MicroBatchSeeds
from raytrain.testing.multiprocess import run_world
from raytrain.toy import (
    GPT,
    adamw_groups,
    block_mlp,
    block_mlp_tp_plan,
    mlp,
    mlp_tp_plan,
    next_token_loss,
    regression_arrays,
    sgd,
    squared_error,
    token_arrays,
)
from raytrain.worker_loop import train_step

GLOBAL_BATCH = 7
STEPS = 3
LR = 0.01
MAX_GRAD_NORM = 0.5  # below the first step's norm: clipping acts, so the global norm must be right
TOLERANCE = 1e-10  # float64 throughout: only summation order differs (AdamW amplifies it to ~1e-12)
SHAPE = {"vocab": 16, "context": 8, "width": 32, "head_dim": 8, "blocks": 2}


@dataclass(frozen=True)
class Case:
    world: int
    tp: int
    strategy: str
    cap: int  # micro-batch cap: with dp replicas, accumulation k = ceil(B / (cap * dp))
    optimizer: str = "adamw"  # "adamw": AdamW with parameter groups, clipped; "sgd": SGD with momentum, unclipped
    wrong_scale: bool = False  # negative control: normalise by W (every rank a replica) instead of dp
    pp: int = 1
    schedule: str = "gpipe"  # the pipeline's schedule (pp > 1)
    model: str = "gpt"  # "gpt": the toy GPT on tokens; "blocks" / "mlp": the block MLP / the demo's MLP
    # (nn.Sequential) on regression data; "llama" / "gpt2": transformers' models on tokens
    sp: bool = False  # sequence parallel (tp > 1)
    checkpointing: bool = False  # activation checkpointing per block

    @property
    def name(self) -> str:
        name = f"w{self.world}-tp{self.tp}-pp{self.pp}-{self.model}-{self.strategy}-m{self.cap}-{self.optimizer}"
        name += "" if self.schedule == "gpipe" else f"-{self.schedule}"
        return (
            name
            + ("-sp" if self.sp else "")
            + ("-ac" if self.checkpointing else "")
            + ("-wrong" if self.wrong_scale else "")
        )

    @property
    def chunks(self) -> int:
        """Model chunks per stage: 2 for the interleaved schedule."""
        return 2 if self.schedule == "interleaved_1f1b" else 1


CASES = {
    2: [
        Case(2, 2, "ddp", cap=3),  # tp 2, dp 1: k = 3 (2 + 2 + 3)
        Case(2, 1, "ddp", cap=3, pp=2, model="blocks", optimizer="adamw_named"),  # pp 2, dp 1: 2 + 2 + 3
        # the embedding on stage 0 and the head tied to it on stage 1: gradients summed over the two stages
        Case(2, 1, "ddp", cap=3, pp=2, model="tied_seq", optimizer="adamw_ndim"),
        # models that are not nn.Sequential, cut by their split: the toy GPT's pipeline_split(), transformers'
        # Llama by its base_model_pp_plan, GPT-2 by name; each ties its embedding to its head across the stages.
        # Interleaved: each stage holds two of the four blocks (0 and 2, 1 and 3), the last sends to the first
        Case(2, 1, "ddp", cap=3, pp=2, model="tied_gpt", optimizer="adamw_ndim"),
        # transformers' Llama split Megatron-style (attention heads, MLP columns), then sequence parallel: the
        # residual stream and norms hold half the positions per tp rank (with checkpointing: the recompute
        # replays the split)
        Case(2, 2, "ddp", cap=3, model="llama", optimizer="adamw_ndim"),
        Case(2, 2, "ddp", cap=3, model="llama", optimizer="adamw_ndim", sp=True),
        Case(2, 2, "ddp", cap=3, model="llama", optimizer="adamw_ndim", sp=True, checkpointing=True),
        *(
            Case(2, 1, "ddp", cap=3, pp=2, model=model, optimizer="adamw_ndim", schedule=schedule)
            for model in ("llama", "gpt2")
            for schedule in ("gpipe", "1f1b", "interleaved_1f1b")
        ),
    ],
    4: [  # tp 2 x dp 2: 4 + 3 samples, k = 2
        Case(4, 2, "ddp", cap=2),
        Case(4, 2, "zero2", cap=2),
        Case(4, 2, "zero3", cap=2),
        Case(4, 2, "zero3", cap=2, model="tied_gpt"),  # the tied embedding and head stay whole under tp
        Case(4, 1, "zero1", cap=2, model="tied_gpt"),  # dp 4: DDP + the sharded optimizer
        Case(4, 1, "zero2", cap=2, model="tied_gpt"),
        Case(4, 2, "zero3", cap=2, optimizer="sgd"),
        # AdamW and clipping are blind to a constant gradient scale: the control uses SGD without clipping
        Case(4, 2, "zero3", cap=2, optimizer="sgd", wrong_scale=True),
        Case(4, 1, "ddp", cap=2, pp=2, model="blocks", optimizer="adamw_named"),  # pp 2 x dp 2: 4 + 3, k = 2
        Case(4, 1, "zero3", cap=2, pp=2, model="blocks", optimizer="adamw_named"),
        Case(4, 1, "zero3", cap=2, pp=2, model="tied_seq", optimizer="adamw_ndim"),
        Case(4, 2, "ddp", cap=3, pp=2, model="blocks", optimizer="adamw_named"),  # tp 2 x pp 2, dp 1: k = 3
        Case(4, 2, "ddp", cap=3, pp=2, model="mlp", optimizer="adamw_named"),  # the TP plan names top-level units
        Case(4, 2, "ddp", cap=3, pp=2, model="mlp", optimizer="sgd"),
        # cap 1: k = 4 micro-batches, replica 1 has 3 samples, so one of its micro-batches is empty
        Case(4, 2, "zero3", cap=1),
        Case(4, 1, "ddp", cap=1, pp=2, model="blocks", optimizer="adamw_named"),
        Case(4, 1, "zero3", cap=2, pp=2, model="tied_gpt", optimizer="adamw_ndim"),  # pp 2 x dp 2, FSDP2
        Case(4, 2, "ddp", cap=3, pp=2, model="gpt", optimizer="adamw_named"),  # tp 2 x pp 2 of the toy GPT
        *(
            Case(4, 1, strategy, cap=cap, pp=2, model=model, optimizer="adamw_ndim", schedule=schedule)
            for model, strategy, cap in (("llama", "ddp", 2), ("gpt2", "zero2", 2))
            for schedule in ("gpipe", "1f1b", "interleaved_1f1b")
        ),
        # sequence parallel with FSDP2 on dp, and across pipeline stages (each stage cuts and joins the sequence)
        Case(4, 2, "zero3", cap=2, model="llama", optimizer="adamw_ndim", sp=True),
        Case(4, 2, "ddp", cap=3, pp=2, model="llama", optimizer="adamw_ndim", sp=True),
        # all at once: each stage's two chunks cut and join the sequence, and the backward's recompute of a block
        # (outside any chunk's forward) replays its split
        Case(
            4,
            2,
            "ddp",
            cap=3,
            pp=2,
            model="llama",
            optimizer="adamw_ndim",
            schedule="interleaved_1f1b",
            sp=True,
            checkpointing=True,
        ),
        # interleaved under FSDP2: the step's last backward (chunk 0's) also reduces chunk 1's blocks
        Case(4, 1, "zero3", cap=2, pp=2, model="llama", optimizer="adamw_ndim", schedule="interleaved_1f1b"),
        Case(4, 1, "zero3", cap=1, pp=2, model="tied_gpt", optimizer="adamw_ndim", schedule="1f1b"),  # k = 4
        Case(4, 2, "ddp", cap=3, pp=2, model="gpt", optimizer="adamw_named", schedule="1f1b"),
        # four stages, 7 micro-batches: 1F1B fills the pipeline with 3, 2, 1, 0 forwards
        Case(4, 1, "ddp", cap=1, pp=4, model="blocks", optimizer="adamw_named", schedule="1f1b"),
    ],
}


def _columns(model: str) -> dict[str, np.ndarray]:
    if model in ("blocks", "mlp"):
        return {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in regression_arrays(64).items()}
    return token_arrays(64, SHAPE["vocab"], SHAPE["context"], seed=3)


def _positions(step: int) -> np.ndarray:
    return np.random.default_rng(step).permutation(64)[:GLOBAL_BATCH]


class TiedSequential(nn.Sequential):
    """A per-token language model as one `nn.Sequential` whose head shares the embedding's weight (GPT-2's tie):
    a pipeline puts the two on different stages."""

    def __init__(self, vocab: int = 16, width: int = 8) -> None:
        blocks = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(3)]
        super().__init__(nn.Embedding(vocab, width), *blocks, nn.Linear(width, vocab, bias=False))
        self[-1].weight = self[0].weight


def _tied_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["x"])
    return (
        nn.functional.cross_entropy(logits.flatten(0, 1), batch["y"].flatten(), reduction="none")
        .view(batch["y"].shape)
        .mean(dim=1)
    )


def hf_next_token_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A transformers causal LM called as its users call it (keyword input ids, `.logits`): per-sequence mean next-
    token cross entropy."""
    return next_token_loss(lambda tokens: model(input_ids=tokens).logits, batch)  # type: ignore[arg-type]


BUILDERS = {
    "blocks": lambda: block_mlp(8, 16, blocks=4).to(torch.float64),
    "mlp": lambda: mlp(8, 32).to(torch.float64),
    "gpt": lambda: GPT(**SHAPE).to(torch.float64),
    "tied_gpt": lambda: GPT(**SHAPE, tie_embeddings=True).to(torch.float64),
    "tied_seq": lambda: TiedSequential().to(torch.float64),
    "llama": lambda: llama(layers=4).to(torch.float64),
    "gpt2": lambda: gpt2(layers=4).to(torch.float64),
}


def _meta_model(model: str) -> MetaBuild:
    return record_build(BUILDERS[model])


LOSSES = {
    "gpt": next_token_loss,
    "tied_gpt": next_token_loss,
    "tied_seq": _tied_loss,
    "blocks": squared_error,
    "mlp": squared_error,
    "llama": hf_next_token_loss,
    "gpt2": hf_next_token_loss,
}
TP_PLANS = {
    "gpt": lambda model: model.tp_plan(),
    "tied_gpt": lambda model: model.tp_plan(),
    "blocks": block_mlp_tp_plan,
    "mlp": mlp_tp_plan,
    "llama": lambda model: {
        **{f"model.layers.*.self_attn.{name}_proj": "colwise" for name in "qkv"},
        "model.layers.*.self_attn.o_proj": "rowwise",
        **{f"model.layers.*.mlp.{name}_proj": "colwise" for name in ("gate", "up")},
        "model.layers.*.mlp.down_proj": "rowwise",
    },
}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def _adamw_named_groups(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW with groups chosen by parameter name, as a pipeline stage needs (it holds only its own units, so a
    rule like "the first layer" would pick each stage's first): weight decay on matrices only, the first layer
    ("0." of a Sequential, the GPT's "token.") at half the LR."""
    named = list(model.named_parameters())
    first = [p for n, p in named if n.startswith(("0.", "token."))]
    groups: list[dict[str, Any]] = [
        {"params": [p for n, p in named if p.ndim >= 2 and not n.startswith(("0.", "token."))]},
        {"params": [p for n, p in named if p.ndim < 2 and not n.startswith(("0.", "token."))], "weight_decay": 0.0},
        {"params": first, "lr": 0.5 * lr},
    ]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=0.1)


def _adamw_by_ndim(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only: the groups of a parameter tied across pipeline stages agree on
    every stage (a rule by name would see another name on each)."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=0.1)


OPTIMIZERS = {  # name -> (optimizer_fn, max_grad_norm)
    "adamw": (adamw_groups, MAX_GRAD_NORM),
    "adamw_named": (_adamw_named_groups, MAX_GRAD_NORM),
    "adamw_ndim": (_adamw_by_ndim, MAX_GRAD_NORM),
    "sgd": (sgd, None),
}


@functools.cache
def _reference(model_name: str, optimizer_name: str) -> dict[str, torch.Tensor]:
    """Plain torch in one process, from the same (seed, module name) initial weights."""
    optimizer_fn, max_norm = OPTIMIZERS[optimizer_name]
    built = _meta_model(model_name)
    model = apply_parallelism(built.model, "ddp", torch.device("cpu"), 1, init=built.trace, seed=0)
    optimizer = call_optimizer_fn(optimizer_fn, model, LR)
    columns = _columns(model_name)
    for step in range(STEPS):
        picked = _positions(step)
        batch = {k: torch.from_numpy(v[picked]) for k, v in columns.items()}
        optimizer.zero_grad(set_to_none=True)
        LOSSES[model_name](model, batch).mean().backward()
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if step == 0:
                assert norm > max_norm, f"norm {norm} does not clip; lower MAX_GRAD_NORM"
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}


def _check_ties(model: nn.Module, optimizer: torch.optim.Optimizer, built: MetaBuild) -> None:
    """Each tie of the built model that lies on this rank is one parameter with one optimizer state."""
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for group in tie_groups(built.model):
        here = [name for name in group if name in names]
        assert len({id(model.get_parameter(name)) for name in here}) <= 1, f"{here} are no longer one parameter"
    grouped = [id(p) for group in optimizer.param_groups for p in group["params"]]
    assert len(grouped) == len(set(grouped)) == len(list(model.parameters())), "a parameter optimized twice"


def _run_case(case: Case, rank: int) -> dict[str, torch.Tensor]:
    dims = ParallelDims.of(case.world, tp=case.tp, pp=case.pp)
    mesh = dims.build_mesh("cpu")
    coords = dims.coords(rank)
    built = _meta_model(case.model)
    model = built.model
    ties = stage_ties(model, dims.pp, case.chunks) if dims.pp > 1 else []
    plan = resolve_plan(model, TP_PLANS[case.model](model), dims.tp) if dims.tp > 1 else None
    model = apply_parallelism(
        model,
        case.strategy,
        torch.device("cpu"),
        dims,
        mesh=mesh,
        tp_plan=plan,
        stage=coords.pp,
        pp_chunks=case.chunks,
        sequence_parallel=case.sp,
        activation_checkpointing=case.checkpointing,
        init=built.trace,
        seed=0,
    )
    optimizer_fn, max_norm = OPTIMIZERS[case.optimizer]
    optimizer = build_optimizer(model, optimizer_fn, LR, case.strategy)
    policy = step_policy(
        case.strategy, dims, "fp32", "unsharded", mesh, coords, ties, case.schedule, case.chunks, case.sp
    )
    batch_plan = plan_batch(GLOBAL_BATCH, case.cap, dims.dp)
    replica = coords.dp
    columns = _columns(case.model)
    for step in range(STEPS):
        micro = rank_micro_batches(columns, _positions(step), batch_plan, replica, torch.device("cpu"))
        replicas = case.world if case.wrong_scale else dims.dp
        train_step(model, optimizer, LOSSES[case.model], micro, replicas, GLOBAL_BATCH, max_norm, policy)
    _check_ties(unwrap(model), optimizer, built)
    # a pipeline stage: its own parameters, a tied one under each of its names here
    return {name: _full(p) for name, p in unwrap(model).named_parameters(remove_duplicate=False)}


def _tp_dropout(rank: int, world: int, checkpointing: bool = False, sp: bool = False) -> dict[str, object]:
    """tp 2 at dp = world / 2: the toy GPT with dropout trains STEPS steps of 8 samples in micro-batches of 2 (dp 1
    cuts 2+2+2+2, dp 2 cuts 2+2 | 2+2: the same micro-batches), each seeded as the worker loop seeds it. Returns
    the full parameters and block 0's first dropout masks: inside the split MLP (this rank's hidden units) and on
    the residual branch (whole on every tp rank). `checkpointing`: each block recomputed in the backward. `sp`:
    sequence parallel, on a decoder that holds its attention and MLP in modules (`DropoutDecoder`): the residual
    branch holds this rank's half of the positions."""
    dims = ParallelDims.of(world, tp=2)
    mesh, coords, cpu = dims.build_mesh("cpu"), dims.coords(rank), torch.device("cpu")
    build = (lambda: DropoutDecoder().to(torch.float64)) if sp else (lambda: GPT(**SHAPE, dropout=0.3).double())
    built = record_build(build)
    plan = resolve_plan(built.model, built.model.tp_plan(), dims.tp)
    model = apply_parallelism(
        built.model,
        "ddp",
        cpu,
        dims,
        mesh=mesh,
        tp_plan=plan,
        init=built.trace,
        seed=0,
        activation_checkpointing=checkpointing,
        sequence_parallel=sp,
    )
    masks: dict[str, torch.Tensor] = {}
    for name in ("mlp.hidden_drop" if sp else "hidden_drop", "resid_drop"):

        def record(_module: nn.Module, _inputs: object, out: torch.Tensor, name: str = name) -> None:
            masks.setdefault(name.rpartition(".")[2], (out == 0).clone())

        unwrap(model).blocks[0].get_submodule(name).register_forward_hook(record)
    optimizer = build_optimizer(model, sgd, LR, "ddp")
    policy = step_policy("ddp", dims, "fp32", "unsharded", mesh, coords, [], sequence_parallel=sp)
    batch_plan = plan_batch(8, 2, dims.dp)
    columns = _columns("gpt")
    for step in range(STEPS):
        positions = np.random.default_rng(step).permutation(64)[:8]
        micro = rank_micro_batches(columns, positions, batch_plan, coords.dp, cpu)
        offset, sizes = batch_plan.rank_offset(coords.dp), batch_plan.micro_batches[coords.dp]
        seeds = MicroBatchSeeds(0, step, offset, sizes, coords.pp, None)
        train_step(model, optimizer, next_token_loss, micro, dims.dp, 8, None, policy, seeds=seeds)
    params = {name: _full(p) for name, p in unwrap(model).named_parameters()}
    return {"params": params, "masks": masks, "tp": coords.tp, "dp": coords.dp}


DROPOUT_RUNS = [  # key, activation checkpointing, sequence parallel
    ("tp-dropout", False, False),
    ("tp-dropout-ac", True, False),
    ("sp-dropout", False, True),
    ("sp-dropout-ac", True, True),
]


def _world_main(rank: int, world: int) -> dict[str, dict[str, object]]:
    results: dict[str, dict[str, object]] = {}
    for case in CASES[world]:
        try:
            results[case.name] = {"params": _run_case(case, rank), "error": None}
        except Exception:
            results[case.name] = {"params": None, "error": traceback.format_exc()}
        dist.barrier()
    for key, checkpointing, sp in DROPOUT_RUNS:
        try:
            results[key] = {"result": _tp_dropout(rank, world, checkpointing, sp), "error": None}
        except Exception:
            results[key] = {"result": None, "error": traceback.format_exc()}
    return results


@functools.cache
def _world(world: int) -> list[dict[str, dict[str, object]]]:
    return run_world(_world_main, world, preload=("torch", "raytrain.worker_loop", "torch.distributed.tensor"))


def _max_error(case: Case) -> float:
    per_rank = _world(case.world)
    errors = [f"rank {r}:\n{res[case.name]['error']}" for r, res in enumerate(per_rank) if res[case.name]["error"]]
    assert not errors, f"{case.name} raised:\n" + "\n".join(errors)
    reference = _reference(case.model, case.optimizer)
    worst = 0.0
    covered: set[str] = set()
    for result in per_rank:
        params = result[case.name]["params"]
        assert isinstance(params, dict) and params.keys() <= reference.keys()
        if case.pp > 1:  # a stage holds only its own units' parameters
            assert params.keys() < reference.keys()
        covered |= params.keys()
        worst = max(worst, *(float((params[n] - reference[n]).abs().max()) for n in params))
    assert covered == reference.keys(), f"parameters on no stage: {sorted(reference.keys() - covered)}"
    return worst


@pytest.mark.parametrize("case", [c for cs in CASES.values() for c in cs if not c.wrong_scale], ids=lambda c: c.name)
def test_tensor_parallel_equals_one_process(case: Case) -> None:
    assert _max_error(case) < TOLERANCE


def test_normalising_by_world_instead_of_dp_misses() -> None:
    """The negative control: with tp 2 the world holds half as many replicas as ranks."""
    wrong = next(c for c in CASES[4] if c.wrong_scale)
    assert _max_error(wrong) > 1e-4


# ---------------------------------------------------------------- checkpoints across dp and layouts

RESHARD_LAYOUTS: dict[str, dict[str, object]] = {  # written by 4 workers, loaded by 2 (at "load"'s tp and pp)
    "tp2": {"tp": 2, "pp": 1, "model": "gpt"},
    "pp2": {"tp": 1, "pp": 2, "model": "blocks"},
    # the layout changes: tp 2 x pp 2 (dp 1) -> dp 2; dp 4 -> pp 2 (the toy GPT cut by its split)
    "tp2pp2-to-dp2": {"tp": 2, "pp": 2, "model": "gpt", "load": (1, 1)},
    "dp4-to-pp2": {"tp": 1, "pp": 1, "model": "gpt", "load": (1, 2)},
    # GPT-2's tie: one process stores the optimizer state under token.weight, stage 1 reads it as head.weight
    "tied-dp4-to-pp2": {"tp": 1, "pp": 1, "model": "tied_gpt", "load": (1, 2), "optimizer": "adamw_ndim"},
}


def _build(
    layout: dict[str, object], world: int, rank: int, load: bool = False
) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    tp, pp = layout["load"] if load and "load" in layout else (layout["tp"], layout["pp"])  # type: ignore[misc]
    dims = ParallelDims.of(world, tp=tp, pp=pp)
    mesh, coords = dims.build_mesh("cpu"), dims.coords(rank)
    name = str(layout["model"])
    built = _meta_model(name)
    ties = stage_ties(built.model, dims.pp) if dims.pp > 1 else []
    aliases = tie_aliases(built.model)
    plan = resolve_plan(built.model, TP_PLANS[name](built.model), dims.tp) if dims.tp > 1 else None
    model = apply_parallelism(
        built.model, "ddp", torch.device("cpu"), dims, mesh=mesh, tp_plan=plan, stage=coords.pp, init=built.trace
    )
    optimizer = build_optimizer(model, OPTIMIZERS[str(layout.get("optimizer", "adamw_named"))][0], LR, "ddp")
    policy = step_policy("ddp", dims, "fp32", "unsharded", mesh, coords, ties)
    return model, optimizer, (dims, coords, policy, aliases)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, layout_state: Any, name: str, step: int) -> None:
    dims, coords, policy, _ = layout_state
    micro = rank_micro_batches(
        _columns(name), _positions(step), plan_batch(GLOBAL_BATCH, 2, dims.dp), coords.dp, torch.device("cpu")
    )
    train_step(model, optimizer, LOSSES[name], micro, dims.dp, GLOBAL_BATCH, None, policy)


def _reshard_main(rank: int, world: int, mode: str, out: str) -> dict[str, object]:
    from raytrain.checkpoint import TrainState, load_checkpoint, save_checkpoint
    from raytrain.data.id_ranges import IdRanges

    results: dict[str, object] = {}
    for key, layout in RESHARD_LAYOUTS.items():
        name = str(layout["model"])
        try:
            model, optimizer, layout_state = _build(layout, world, rank, load=mode == "load")
            if mode == "save":  # two steps at dp 2, checkpoint, a third step: the continuation to reproduce
                _train(model, optimizer, layout_state, name, 0)
                _train(model, optimizer, layout_state, name, 1)
                directory = save_checkpoint(
                    model, optimizer, TrainState(step=2), rank, IdRanges(), flat_optimizer=layout_state[0].pp > 1
                )
                _train(model, optimizer, layout_state, name, 2)
                results[key] = {
                    "dir": directory,
                    "after": {n: _full(p) for n, p in unwrap(model).named_parameters(remove_duplicate=False)},
                }
            else:  # dp 1: load the merged checkpoint, take the third step
                state, _ = load_checkpoint(os.path.join(out, key), model, optimizer, layout_state[3])
                _train(model, optimizer, layout_state, name, 2)
                after = {n: _full(p) for n, p in unwrap(model).named_parameters(remove_duplicate=False)}
                results[key] = {"step": state.step, "after": after}
        except Exception:
            results[key] = {"error": traceback.format_exc()}
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def resharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("parallel-reshard")
    saved = run_world(_reshard_main, 4, "save", str(out))
    for key in RESHARD_LAYOUTS:  # merge the ranks' directories, as Ray Train does
        (out / key).mkdir()
        for result in saved:
            assert "error" not in result[key], result[key].get("error")
            for file in os.listdir(result[key]["dir"]):
                shutil.copy(os.path.join(result[key]["dir"], file), out / key / file)
    return saved, run_world(_reshard_main, 2, "load", str(out))


@pytest.mark.parametrize("key", list(RESHARD_LAYOUTS))
def test_a_checkpoint_continues_at_another_dp_and_layout(resharded: Any, key: str) -> None:
    """Written by 4 workers, loaded by 2: dp 2 x tp 2 -> tp 2, dp 2 x pp 2 -> pp 2 (tp or pp fixed), tp 2 x pp 2
    -> dp 2 and dp 4 -> pp 2 (the layout changes; DCP reshards the tp DTensors and the stages keep the whole
    model's names): the next step's parameters equal the 4-worker run's continuation (float64)."""
    saved, loaded = resharded
    expected: dict[str, torch.Tensor] = {}
    for result in saved:
        expected.update(result[key]["after"])
    got: dict[str, torch.Tensor] = {}
    for result in loaded:
        assert "error" not in result[key], result[key].get("error")
        assert result[key]["step"] == 2
        got.update(result[key]["after"])
    assert got.keys() == expected.keys()
    assert max(float((got[n] - expected[n]).abs().max()) for n in got) < TOLERANCE


# ---------------------------------------------------------------- the by-hand dp all-reduce (ddp with tp or pp)


def _unused_main(rank: int, world: int) -> dict[str, object]:
    """Replica 0 uses layers a and b, replica 1 only b (as an expert no sample of a replica was routed to); c is
    used by none. Every rank must end with the same averaged gradients."""
    from raytrain.parallel.apply import all_reduce_gradients

    torch.manual_seed(0)
    layers = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3), "c": nn.Linear(3, 3)}).double()
    x = torch.full((2, 3), float(rank + 1), dtype=torch.float64)
    out = layers["b"](x)
    if rank == 0:
        out = out + layers["a"](x)
    out.sum().backward()
    local = {name: None if p.grad is None else p.grad.clone() for name, p in layers.named_parameters()}
    all_reduce_gradients(layers.parameters(), dist.group.WORLD, world)
    return {
        "local": local,
        "reduced": {n: None if p.grad is None else p.grad.clone() for n, p in layers.named_parameters()},
    }


def test_replicas_with_different_unused_parameters_reduce_the_same_parameters() -> None:
    ranks = run_world(_unused_main, 2, timeout_s=60)
    local = [r["local"] for r in ranks]
    for name in ("a.weight", "a.bias", "b.weight", "b.bias"):
        expected = sum(g[name] if g[name] is not None else 0 for g in local) / 2
        for r in ranks:
            assert torch.allclose(r["reduced"][name], expected), name
    assert local[1]["a.weight"] is None  # replica 1 really had no gradient for a
    for r in ranks:  # used by no replica: a zero gradient (raytrain.parallel.idle's convention, at every W)
        assert torch.equal(r["reduced"]["c.weight"], torch.zeros(3, 3, dtype=torch.float64))


@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_dropout_under_tp_draws_per_rank_inside_the_split_and_the_curve_holds_across_dp(mode: str) -> None:
    """Inside a tensor-parallel region (the MLP's hidden units, split over tp) each tp rank draws its own dropout
    mask; on the residual branch (whole on every tp rank) the ranks draw the same one, or, under sequence parallel
    ("sp": each rank holds half the positions there), each its own. tp 2 at dp 2 trains the parameters of tp 2 at
    dp 1 (the same micro-batches, seeded by their place in the step, not by the rank)."""
    runs = {world: _tp_dropout_runs(world, f"{mode}-dropout") for world in (2, 4)}
    tp0, tp1 = runs[2]  # one replica, tp ranks 0 and 1
    assert (tp0["tp"], tp1["tp"]) == (0, 1)
    inside0, inside1 = tp0["masks"]["hidden_drop"], tp1["masks"]["hidden_drop"]
    assert inside0.any() and inside1.any(), "dropout dropped nothing"
    assert inside0.shape == inside1.shape and not torch.equal(inside0, inside1), "tp ranks drew one mask"
    resid0, resid1 = tp0["masks"]["resid_drop"], tp1["masks"]["resid_drop"]
    assert resid0.any()
    if mode == "tp":
        assert torch.equal(resid0, resid1), "replicated activations diverge"
    else:  # each rank's half of the positions: [n, T / 2, width], its own mask
        assert resid0.shape[1] == SHAPE["context"] // 2 and not torch.equal(resid0, resid1), "one mask for all"
    # the parameters both tp ranks hold whole (embeddings, norms, head) stayed equal: the same gradient on each
    assert _max_param_diff([tp0], [tp1]) == 0.0, "the tp ranks' copies of a whole parameter drifted apart"
    worst = _max_param_diff(runs[4][:2], runs[2])  # replica 0 of dp 2 against the one replica of dp 1
    recomputed = _max_param_diff(_tp_dropout_runs(2, f"{mode}-dropout-ac"), runs[2])
    print(f"{mode} 2 dropout: dp 2 vs dp 1 max abs diff {worst:.3e}; checkpointing vs none {recomputed:.3e}")
    assert worst < TOLERANCE, worst
    assert recomputed < TOLERANCE, f"the backward's recompute drew other masks: {recomputed}"


def _tp_dropout_runs(world: int, key: str) -> list[dict[str, Any]]:
    per_rank = _world(world)
    errors = [f"rank {r}:\n{res[key]['error']}" for r, res in enumerate(per_rank) if res[key]["error"]]
    assert not errors, "\n".join(errors)
    return [res[key]["result"] for res in per_rank]


def _max_param_diff(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float:
    return max(
        float((x["params"][name] - y["params"][name]).abs().max())
        for x, y in zip(a, b, strict=True)
        for name in x["params"]
    )
