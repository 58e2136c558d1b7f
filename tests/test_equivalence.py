"""Gradient equivalence without Ray: the real `train_step` on real gloo process groups equals full-batch training.

For every strategy (ddp, zero1, zero2, zero3), world size W in {1, 2, 3} and accumulation k in {1, 2, 4}, each rank
trains a tiny float64 MLP for three optimizer steps on its micro-batches from `_rank_micro_batches`; rank 0's full
parameters must equal a plain single-process reference (mean loss over the B samples, one backward, one step) to
1e-6. The global batch depends on W so that every k is reachable and W=2 and W=3 do not divide B. A final partial
step (`split_step`, normalised by its true size) is covered at W=3, including one with fewer samples than ranks.
Also at every W and strategy: gradient clipping on the global norm (`max_grad_norm`, small enough to clip every
step), and AdamW with parameter groups (their own weight decay and LR ratio) under a decaying per-step LR.
Models whose parameters sit out steps (`raytrain.parallel.idle`): a top-1 mixture of experts whose experts go idle
per rank and step, and a branch some samples take, under AdamW with weight decay at every strategy and W, against
the reference with the zero-gradient convention (an unused parameter's gradient is zero, not None).
With dropout, each micro-batch draws from a stream seeded by its place in the step's global layout
(`raytrain.rng.MicroBatchSeeds`, as the worker loop seeds it): W = 2 equals W = 1 to 1e-6 when the micro-batch cuts
are the same at both, and W = 3, whose cuts differ, does not (the documented line).

One world of W processes per W (`raytrain.testing.multiprocess.run_world`: forkserver by default,
RAYTRAIN_TEST_START_METHOD=spawn also works) runs every strategy and configuration in a single gloo process group:
starting processes is the expensive part, the runs themselves take milliseconds.
"""

from __future__ import annotations

import functools
import math
import traceback
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from raytrain.batch_plan import BatchPlan, plan_batch, split_step
from raytrain.data.materialized import rank_micro_batches as _rank_micro_batches
from raytrain.model_init import materialize, record_build
from raytrain.optim import build_optimizer, call_optimizer_fn, lr_ratios, set_lr
from raytrain.parallel.apply import apply_parallelism, gradient_sync, step_policy
from raytrain.rng import MicroBatchSeeds
from raytrain.step import Step
from raytrain.testing.multiprocess import run_world
from raytrain.worker_loop import train_step

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
WORLDS = (1, 2, 3)
ACCUMULATIONS = (1, 2, 4)
# B per world size: every k in ACCUMULATIONS is reachable with some cap m, and W=2, W=3 do not divide B.
GLOBAL_BATCH = {1: 12, 2: 13, 3: 10}
STEPS = 3
NUM_ROWS = 64
TOLERANCE = 1e-6
LR = {"sgd": 0.1, "adam": 0.01, "adamw_groups": 0.01, "adamw": 0.01}
IDLE_MODELS = ("moe", "branch")  # user_models.TopOneMoE, user_models.SometimesBranch


@dataclass(frozen=True)
class Case:
    """One training run: `step_sizes[s]` samples in optimizer step s, micro-batch cap `cap`."""

    strategy: str
    world: int
    accumulation: int
    cap: int
    step_sizes: tuple[int, ...]
    optimizer: str = "sgd"
    wrong_scale: bool = False  # negative control: normalise by the micro-batch mean instead of W / B
    max_grad_norm: float | None = None
    lr_factors: tuple[float, ...] | None = None  # the schedule's factor per step (None: constant)
    dropout: bool = False
    blocks: bool = False  # a model of repeated residual blocks, built on the meta device (per-block FSDP units)
    grad_accumulation: str = "unsharded"
    checkpointing: bool = False
    precision: str = "fp32"  # "bf16": a float32 model under bf16 compute, against the fp32 run
    model: str = "mlp"  # or one of IDLE_MODELS
    reduction: str = ""  # "none" | "sum" | "mean": a user's loop over `Step` handing the loss so (else train_step)

    @property
    def name(self) -> str:
        sizes = ",".join(map(str, self.step_sizes))
        extra = "-wrong" if self.wrong_scale else ""
        extra += f"-clip{self.max_grad_norm}" if self.max_grad_norm else ""
        extra += "-sched" if self.lr_factors else ""
        extra += "-dropout" if self.dropout else ""
        extra += f"-blocks-{self.grad_accumulation}" if self.blocks else ""
        extra += "-ac" if self.checkpointing else ""
        extra += f"-{self.precision}" if self.precision != "fp32" else ""
        extra += f"-{self.model}" if self.model != "mlp" else ""
        extra += f"-own-loop-{self.reduction}" if self.reduction else ""
        return f"{self.strategy}-W{self.world}-k{self.accumulation}-m{self.cap}-{self.optimizer}-[{sizes}]{extra}"

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.precision != "fp32" else torch.float64


def _cap_for(global_batch: int, world: int, accumulation: int) -> int:
    """The largest micro-batch cap m with ceil(B / (m * W)) == k."""
    for cap in range(global_batch, 0, -1):
        if math.ceil(global_batch / (cap * world)) == accumulation:
            return cap
    raise AssertionError(f"no cap gives k={accumulation} for B={global_batch}, W={world}")


def _full_case(strategy: str, world: int, accumulation: int, optimizer: str = "sgd", **options: object) -> Case:
    batch = GLOBAL_BATCH[world]
    cap = _cap_for(batch, world, accumulation)
    return Case(strategy, world, accumulation, cap, (batch,) * STEPS, optimizer, **options)  # type: ignore[arg-type]


def _partial_case(strategy: str, last: int) -> Case:
    """W=3, k=2: two full steps of B=10, then a final partial step of `last` samples (split_step)."""
    batch = GLOBAL_BATCH[3]
    cap = _cap_for(batch, 3, 2)
    return Case(strategy, 3, 2, cap, (batch, batch, last))


NEGATIVE = _full_case("ddp", 3, 2, wrong_scale=True)
PARTIAL_SIZES = (5, 2)  # 2 < W: one rank has no sample at all in the final step
MAX_GRAD_NORM = 0.05  # below every step's gradient norm here, so every step clips
LR_FACTORS = (1.0, 0.6, 0.2)  # a decaying schedule over the three steps
# B = 12, cap 3: W = 1 cuts 3+3+3+3, W = 2 cuts 3+3 | 3+3 (the same micro-batches), W = 3 cuts 4 per rank otherwise
DROPOUT = {world: Case("ddp", world, k, 3, (12,) * STEPS, dropout=True) for world, k in ((1, 4), (2, 2), (3, 2))}


REDUCTIONS = ("none", "sum", "mean")
OWN_LOOP_STRATEGIES = ("ddp", "zero3")


def _own_loop_case(strategy: str, reduction: str) -> Case:
    """docs/own_loop.md's loop (`F.mse_loss(..., reduction=...)`, `step.backward(loss, reduction=...)`) with micro
    batch 1 at W = 3: B = 10 gives ranks [4, 3, 3] samples in 4 micro-steps, so ranks 1 and 2 run an empty one
    every step, and the last step of 2 samples leaves rank 2 with none at all (a mean over no samples is NaN)."""
    return Case(strategy, 3, 4, 1, (10, 10, 2), reduction=reduction)


def _clip_case(strategy: str, world: int) -> Case:
    return _full_case(strategy, world, 2, max_grad_norm=MAX_GRAD_NORM)


def _groups_case(strategy: str, world: int) -> Case:
    return _full_case(strategy, world, 2, optimizer="adamw_groups", lr_factors=LR_FACTORS)


def _init_case(strategy: str, world: int) -> Case:
    """No step at all: the initial weights of the meta-built block model."""
    return replace(_full_case(strategy, world, 1, blocks=True), step_sizes=())


def _block_cases(strategy: str, world: int) -> list[Case]:
    """The block model built on meta: both gradient accumulation modes at k = 4, activation checkpointing, bf16."""
    modes = ("unsharded", "sharded") if strategy in ("zero2", "zero3") else ("unsharded",)
    cases = [_full_case(strategy, world, 4, blocks=True, grad_accumulation=mode) for mode in modes]
    cases.append(_full_case(strategy, world, 2, blocks=True, checkpointing=True))
    cases.append(_full_case(strategy, world, 2, blocks=True, precision="bf16"))
    if strategy in ("ddp", "zero1"):  # fp16 with loss scaling: whole gradients on every rank only
        cases.append(_full_case(strategy, world, 2, blocks=True, precision="fp16"))
    return cases


def _idle_case(strategy: str, world: int, model: str) -> Case:
    """Four steps of AdamW with weight decay (where an idle parameter's zero gradient still moves it) at k = 2."""
    batch = GLOBAL_BATCH[world]
    return Case(strategy, world, 2, _cap_for(batch, world, 2), (batch,) * 4, "adamw", model=model)


def _cases_for_world(world: int) -> list[Case]:
    cases = []
    for strategy in STRATEGIES:
        cases += [_idle_case(strategy, world, model) for model in IDLE_MODELS]
        cases += [_full_case(strategy, world, k) for k in ACCUMULATIONS]
        cases.append(_full_case(strategy, world, 2, optimizer="adam"))
        cases += [_clip_case(strategy, world), _groups_case(strategy, world)]
        cases += [_init_case(strategy, world), *_block_cases(strategy, world)]
        if world == 3:
            cases += [_partial_case(strategy, last) for last in PARTIAL_SIZES]
            if strategy in OWN_LOOP_STRATEGIES:
                cases += [_own_loop_case(strategy, reduction) for reduction in REDUCTIONS]
    if world == NEGATIVE.world:
        cases.append(NEGATIVE)
    cases.append(DROPOUT[world])
    return cases


# ---------------------------------------------------------------- shared by the reference and the workers


class Block(nn.Module):
    """A residual block, repeated: what FSDP shards as one unit each."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class BlockModel(nn.Module):
    """In -> 3 repeated blocks (a ModuleList nested one level down, as in models from other libraries) -> out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 8)
        self.trunk = nn.Module()
        self.trunk.layers = nn.ModuleList(Block(8) for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.trunk.layers:  # type: ignore[union-attr]
            h = layer(h)
        return self.head(h)


def _block_model(dtype: torch.dtype) -> nn.Module:
    return BlockModel().to(dtype)


def _build_model(case: Case | None = None, *, on_meta: bool = False) -> nn.Module:
    """The case's model: the small MLP (seeded, on the CPU) or the block model (recorded on meta for the workers;
    for the reference materialized and initialised the way raytrain does it, replaying the recording)."""
    if case is not None and case.blocks:
        built = record_build(functools.partial(_block_model, case.dtype))
        if not on_meta:
            materialize(built.model, "cpu", built.trace, seed=0)
        return built.model
    torch.manual_seed(0)
    if case is not None and case.model != "mlp":
        from user_models import SometimesBranch, TopOneMoE

        return {"moe": TopOneMoE, "branch": SometimesBranch}[case.model]().double()
    if case is not None and case.dropout:
        return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Dropout(0.5), nn.Linear(8, 1)).double()
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def _columns() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(NUM_ROWS, 5))
    y = np.sin(x @ rng.normal(size=5)) + 0.1 * rng.normal(size=NUM_ROWS)
    return {"x": x, "y": y}


def _step_positions(step_sizes: tuple[int, ...]) -> list[np.ndarray]:
    """Consecutive slices of one fixed permutation: the global sample positions of each optimizer step."""
    order = np.random.default_rng(11).permutation(NUM_ROWS)
    starts = np.cumsum((0, *step_sizes))
    assert starts[-1] <= NUM_ROWS
    return [order[starts[s] : starts[s + 1]] for s in range(len(step_sizes))]


def _adamw_groups(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The optimizer everyone uses, with groups by name: no decay for biases, half the LR for the first layer."""
    named = list(model.named_parameters())
    return torch.optim.AdamW(
        [
            {"params": [p for n, p in named if n.startswith("0.") and p.ndim >= 2], "lr": 0.5 * lr},
            {"params": [p for n, p in named if not n.startswith("0.") and p.ndim >= 2]},
            {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=lr,
        weight_decay=0.1,
    )


def _optimizer_fn(name: str):
    if name == "sgd":
        return functools.partial(torch.optim.SGD, momentum=0.9)
    if name == "adamw_groups":
        return _adamw_groups
    if name == "adamw":
        return functools.partial(torch.optim.AdamW, weight_decay=0.1)
    return torch.optim.Adam


def _loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (model(batch["x"]).squeeze(-1) - batch["y"]) ** 2


def _step_plan(case: Case, size: int) -> BatchPlan:
    full = case.step_sizes[0]
    if size == full:
        return plan_batch(full, case.cap, case.world)
    return split_step(size, case.cap, case.world)


IDLE_IN_REFERENCE: dict[str, list[list[str]]] = {}  # model -> per step, the parameters no sample used


@functools.cache
def _reference(case: Case) -> dict[str, torch.Tensor]:
    """Plain torch in one process: per optimizer step the mean loss over the step's samples, one backward, a zero
    gradient for a parameter no sample used (raytrain's convention; torch would leave None), clipping with torch's
    own `clip_grad_norm_`, each group's LR set by hand, one step."""
    columns = {k: v.astype(np.float32) if case.dtype == torch.float32 else v for k, v in _columns().items()}
    model = _build_model(case)
    lr = LR[case.optimizer]
    opt = call_optimizer_fn(_optimizer_fn(case.optimizer), model, lr)
    base = [group["lr"] for group in opt.param_groups]
    for step, positions in enumerate(_step_positions(case.step_sizes)):
        for group, group_lr in zip(opt.param_groups, base, strict=True):
            group["lr"] = group_lr * (case.lr_factors[step] if case.lr_factors else 1.0)
        x, y = torch.from_numpy(columns["x"][positions]), torch.from_numpy(columns["y"][positions])
        opt.zero_grad(set_to_none=True)
        ((model(x).squeeze(-1) - y) ** 2).mean().backward()
        idle = [name for name, p in model.named_parameters() if p.grad is None]
        IDLE_IN_REFERENCE.setdefault(case.model, []).append(idle)
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if case.max_grad_norm:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), case.max_grad_norm)
            assert norm > case.max_grad_norm, f"step {step}: norm {norm} does not clip; lower MAX_GRAD_NORM"
        opt.step()
    return {name: t.detach().clone() for name, t in model.state_dict().items()}  # buffers compared too


def _reference_of(case: Case) -> dict[str, torch.Tensor]:
    """The reference for `case`'s training: plain fp32/float64 torch in one process (world size, strategy, split,
    accumulation mode, checkpointing and compute precision do not enter it)."""
    return _reference(
        replace(
            case,
            strategy="",
            world=1,
            accumulation=0,
            cap=0,
            wrong_scale=False,
            grad_accumulation="",
            checkpointing=False,
            precision="fp32" if case.precision == "fp32" else "float32",
            reduction="",
        )
    )


# ---------------------------------------------------------------- the spawned ranks


def _own_loop_step(case: Case, model, optimizer, micro_batches, total: int, policy, seeds) -> None:
    """One step as docs/own_loop.md writes it: the user's forward and loss, `Step` for the rest."""
    step = Step(model, optimizer, micro_batches, case.world, total, case.max_grad_norm, policy, seeds=seeds)
    for batch in step.micro_batches():
        prediction = model(batch["x"]).squeeze(-1)
        if case.reduction == "none":
            step.backward((prediction - batch["y"]) ** 2)
        else:
            step.backward(F.mse_loss(prediction, batch["y"], reduction=case.reduction), reduction=case.reduction)
    result = step.optimizer_step(optimizer)
    assert result.stepped and math.isfinite(step.loss), f"{case.name}: step skipped, loss {step.loss}"


def _wrong_train_step(model, optimizer, loss_fn, micro_batches) -> None:
    """Negative control: `train_step` with the micro-batch mean as the loss (the contract says never do this)."""
    optimizer.zero_grad(set_to_none=True)
    for j, batch in enumerate(micro_batches):
        with gradient_sync(model, enabled=j == len(micro_batches) - 1):
            losses = loss_fn(model, batch)
            if len(losses):
                losses.mean().backward()
            else:
                (losses.sum() * 0.0).backward()
    optimizer.step()


def _assert_wrapped(case: Case, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The strategy really is in effect (a plain model would pass every comparison trivially)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor import DTensor

    assert isinstance(optimizer, ZeroRedundancyOptimizer) == (case.strategy == "zero1")
    if case.world == 1:
        return
    if case.strategy in ("ddp", "zero1"):
        assert isinstance(model, nn.parallel.DistributedDataParallel)
    else:
        from torch.distributed.fsdp import FSDPModule

        assert all(isinstance(p, DTensor) for p in model.parameters())
        if case.blocks:  # one FSDP unit per repeated block, found through the nested ModuleList
            assert all(isinstance(block, FSDPModule) for block in model.trunk.layers)  # type: ignore[union-attr]
            assert not isinstance(model.embed, FSDPModule)  # the rest belongs to the root unit


def _run_case(case: Case, rank: int, columns: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    device = torch.device("cpu")
    built = record_build(functools.partial(_block_model, case.dtype)) if case.blocks else None
    conditional: list[str] = []
    if case.model != "mlp":  # what the driver's probe finds: a few forwards on sample rows, one by one and together
        from raytrain.parallel.idle import conditional_modules

        rows = {k: torch.from_numpy(v[:4]) for k, v in columns.items()}
        probes = [rows, *({k: v[i : i + 1] for k, v in rows.items()} for i in range(4))]
        conditional = conditional_modules(_build_model(case), _loss_fn, probes)
    model = apply_parallelism(
        built.model if built is not None else _build_model(case),
        case.strategy,
        device,
        case.world,
        init=built.trace if built is not None else None,
        seed=0,
        precision=case.precision,
        activation_checkpointing=case.checkpointing,
        conditional=conditional,
    )
    policy = step_policy(case.strategy, case.world, case.precision, case.grad_accumulation, model=model)
    # fp16: dynamic loss scaling, started low enough that no step of this tiny model overflows (none is skipped)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if case.precision == "fp16" else None
    if case.dtype == torch.float32:
        columns = {k: v.astype(np.float32) for k, v in columns.items()}
    lr = LR[case.optimizer]
    optimizer = build_optimizer(model, _optimizer_fn(case.optimizer), lr, case.strategy)
    ratios = lr_ratios(optimizer, lr)
    _assert_wrapped(case, model, optimizer)
    for step, positions in enumerate(_step_positions(case.step_sizes)):
        set_lr(optimizer, ratios, lr * (case.lr_factors[step] if case.lr_factors else 1.0))
        plan = _step_plan(case, len(positions))
        assert plan.accumulation_steps == case.accumulation or len(positions) != case.step_sizes[0], plan
        batches = _rank_micro_batches(columns, positions, plan, rank, device)
        seeds = MicroBatchSeeds(0, step, plan.rank_offset(rank), plan.micro_batches[rank], 0, None)
        if case.wrong_scale:
            _wrong_train_step(model, optimizer, _loss_fn, batches)
        elif case.reduction:
            _own_loop_step(case, model, optimizer, batches, len(positions), policy, seeds)
        else:
            args = (case.world, len(positions), case.max_grad_norm, policy, scaler)
            train_step(model, optimizer, _loss_fn, batches, *args, seeds=seeds)
    # A collective for FSDP2 (all ranks call it); strips DDP's "module." prefix.
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {name: tensor.detach().clone() for name, tensor in state.items()}


class TwoExperts(nn.Module):
    """Two experts of one shape, each rank's rows all routed to its own one: made FSDP units by a `units_fn`, their
    all-gathers pair across ranks without a size mismatch, the silent case `UnitCalls` exists for."""

    def __init__(self) -> None:
        super().__init__()
        from user_models import Expert

        self.experts = nn.ModuleList(Expert(5, 8) for _ in range(2))
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.experts[int(x[0, 0] > 0)](x)).squeeze(-1)


def _units_called_apart(rank: int, world: int) -> str:
    """The error a zero3 step raises when the ranks ran different FSDP units."""
    torch.manual_seed(0)
    model = apply_parallelism(TwoExperts(), "zero3", torch.device("cpu"), world, units_fn=lambda m: list(m.experts))
    policy = step_policy("zero3", world, "fp32", "unsharded", model=model)
    x = torch.randn(3, 5).abs() * (1 if rank == 0 else -1)
    try:
        train_step(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            _loss_fn,
            [{"x": x, "y": torch.zeros(3)}],
            world,
            6,
            None,
            policy,
        )
    except RuntimeError as err:
        return str(err)
    return "no error"


def _world_main(rank: int, world: int) -> dict[str, dict[str, object]]:
    results: dict[str, dict[str, object]] = {}
    if world == 2:
        results["units-called-apart"] = {"params": None, "error": _units_called_apart(rank, world)}
        dist.barrier()
    columns = _columns()
    for case in _cases_for_world(world):
        try:
            results[case.name] = {"params": _run_case(case, rank, columns), "error": None}
        except Exception:
            results[case.name] = {"params": None, "error": traceback.format_exc()}
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def world_results(tmp_path_factory: pytest.TempPathFactory):
    """world -> rank -> case name -> {"params", "error"}; each world runs once, on first use (failures too)."""

    outcomes: dict[int, object] = {}

    def run(world: int) -> list[dict[str, dict[str, object]]]:
        if world not in outcomes:
            try:
                preload = ("torch", "numpy", "raytrain.worker_loop", "torch.distributed.fsdp")
                outcomes[world] = run_world(_world_main, world, preload=preload)
            except Exception as exc:
                outcomes[world] = exc
        outcome = outcomes[world]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome  # type: ignore[return-value]

    return run


def _params_of(world_results, case: Case) -> list[dict[str, torch.Tensor]]:
    """Every rank's full parameters after the run of `case`."""
    per_rank = world_results(case.world)
    errors = [f"rank {r}:\n{res[case.name]['error']}" for r, res in enumerate(per_rank) if res[case.name]["error"]]
    assert not errors, f"{case.name} raised:\n" + "\n".join(errors)
    return [res[case.name]["params"] for res in per_rank]


def _max_abs_diff(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    assert sorted(params) == sorted(reference), (sorted(params), sorted(reference))
    return max(float((params[name] - reference[name]).abs().max()) for name in reference)


def _check(world_results, case: Case, tolerance: float = TOLERANCE) -> float:
    """Rank 0 (and every other rank: replicas must agree, FSDP2 gathers on all) equals the reference."""
    reference = _reference_of(case)
    diffs = [_max_abs_diff(params, reference) for params in _params_of(world_results, case)]
    print(f"{case.name}: max abs diff per rank {', '.join(f'{d:.3e}' for d in diffs)}")
    assert max(diffs) <= tolerance, f"{case.name}: max abs diff per rank {diffs} > {tolerance}"
    return max(diffs)


# ---------------------------------------------------------------- tests


def _ids(world: int, k: int) -> str:
    return f"W{world}-B{GLOBAL_BATCH[world]}-k{k}"


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    ("world", "k"),
    [(w, k) for w in WORLDS for k in ACCUMULATIONS],
    ids=[_ids(w, k) for w in WORLDS for k in ACCUMULATIONS],
)
def test_sgd_momentum_matches_full_batch(world_results, strategy: str, world: int, k: int) -> None:
    case = _full_case(strategy, world, k)
    assert plan_batch(GLOBAL_BATCH[world], case.cap, world).accumulation_steps == k
    _check(world_results, case)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world", WORLDS, ids=[_ids(w, 2) for w in WORLDS])
def test_adam_matches_full_batch(world_results, strategy: str, world: int) -> None:
    _check(world_results, _full_case(strategy, world, 2, optimizer="adam"))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("last", PARTIAL_SIZES, ids=[f"W3-last{n}" for n in PARTIAL_SIZES])
def test_partial_final_step_normalised_by_its_size(world_results, strategy: str, last: int) -> None:
    case = _partial_case(strategy, last)
    plan = split_step(last, case.cap, 3)
    assert sum(plan.per_rank_samples) == last < GLOBAL_BATCH[3]
    assert (min(plan.per_rank_samples) == 0) == (last < 3)  # with 2 samples, rank 2 only runs empty micro-steps
    _check(world_results, case)


@pytest.mark.parametrize("strategy", OWN_LOOP_STRATEGIES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_the_documented_own_loop_trains_like_w1_with_empty_micro_batches(world_results, strategy: str, reduction: str):
    """`_own_loop_case`: every step taken (none skipped as non-finite) and the weights of one process on the whole
    batches, for each way of handing the loss to `Step.backward`."""
    plan = split_step(2, 1, 3)
    assert plan.per_rank_samples == (1, 1, 0) and plan_batch(10, 1, 3).per_rank_samples == (4, 3, 3)
    _check(world_results, _own_loop_case(strategy, reduction))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world", WORLDS, ids=[f"W{w}" for w in WORLDS])
def test_meta_init_gives_the_same_initial_weights_at_every_w_and_strategy(
    world_results, strategy: str, world: int
) -> None:
    """Built on meta, sharded, then each rank's shard initialised from (seed, module name): the full weights equal
    the single-process initialisation exactly, whatever W and the strategy."""
    case = _init_case(strategy, world)
    assert _check(world_results, case, tolerance=0.0) == 0.0
    assert _max_abs_diff(_reference_of(case), _reference_of(replace(case, strategy="zero3"))) == 0.0


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world", WORLDS, ids=[f"W{w}" for w in WORLDS])
def test_per_block_units_and_both_accumulation_modes_match_full_batch(world_results, strategy: str, world: int) -> None:
    """Per-block FSDP units on a meta-built model at k = 4: gradients accumulated whole and synced once, or
    reduce-scattered after every micro-step (zero2 keeping parameters gathered, zero3 re-gathering them)."""
    for case in _block_cases(strategy, world):
        if not case.checkpointing and case.precision == "fp32":
            _check(world_results, case)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world", WORLDS, ids=[f"W{w}" for w in WORLDS])
def test_activation_checkpointing_matches_full_batch(world_results, strategy: str, world: int) -> None:
    _check(world_results, next(c for c in _block_cases(strategy, world) if c.checkpointing))


BF16_TOLERANCE = 5e-3  # bf16 keeps 8 bits of mantissa; measured here: at most 1.1e-3 (bf16), 1.3e-4 (fp16)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world", WORLDS, ids=[f"W{w}" for w in WORLDS])
def test_bf16_compute_stays_within_bf16_tolerance_of_fp32(world_results, strategy: str, world: int) -> None:
    """bf16 (and fp16 with loss scaling, for ddp/zero1) compute with fp32 master weights and fp32 reduction
    against the fp32 single-process run: close to the format's precision, and not identical (so it really was
    used)."""
    for case in (c for c in _block_cases(strategy, world) if c.precision != "fp32"):
        diff = _check(world_results, case, tolerance=BF16_TOLERANCE)
        assert diff > 1e-6, f"{case.name}: identical to fp32 ({diff}): {case.precision} was not applied"


def test_reference_trains() -> None:
    """An untrained model cannot pass: three steps move the parameters well beyond the tolerance."""
    initial = {name: p.detach() for name, p in _build_model().named_parameters()}
    for optimizer in LR:
        moved = _max_abs_diff(_reference_of(_full_case("ddp", 1, 1, optimizer)), initial)
        assert moved > 1e-3, (optimizer, moved)


def test_micro_batch_mean_is_not_equivalent(world_results) -> None:
    """Negative control: the same ranks with the micro-batch mean as loss do not reproduce the reference."""
    diff = _max_abs_diff(_params_of(world_results, NEGATIVE)[0], _reference_of(NEGATIVE))
    print(f"{NEGATIVE.name}: max abs diff {diff:.3e}")
    assert diff > 1e-3, diff


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world", WORLDS, ids=[f"W{w}" for w in WORLDS])
def test_clipping_uses_the_norm_of_the_whole_global_batch(world_results, strategy: str, world: int) -> None:
    case = _clip_case(strategy, world)
    _check(world_results, case)
    unclipped = _reference_of(replace(case, max_grad_norm=None))
    assert _max_abs_diff(_reference_of(case), unclipped) > 1e-3  # clipping changed the update: not a no-op


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world", WORLDS, ids=[f"W{w}" for w in WORLDS])
def test_adamw_parameter_groups_keep_their_options_and_lr_ratios(world_results, strategy: str, world: int) -> None:
    _check(world_results, _groups_case(strategy, world))


def test_dropout_follows_the_micro_batches_not_the_world_size(world_results) -> None:
    """A micro-batch draws its dropout masks from its place in the step's global layout: W = 2 cutting the same
    micro-batches as W = 1 trains the same parameters; W = 3, whose cuts differ, draws other masks (an equally
    valid curve, not the same one: the documented line)."""
    one = _params_of(world_results, DROPOUT[1])[0]
    same = _max_abs_diff(_params_of(world_results, DROPOUT[2])[0], one)
    other = _max_abs_diff(_params_of(world_results, DROPOUT[3])[0], one)
    print(f"dropout: W=2 vs W=1 {same:.3e}, W=3 vs W=1 {other:.3e}")
    assert same < TOLERANCE, same
    assert other > 1e-4, other


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world", WORLDS, ids=[f"W{w}" for w in WORLDS])
@pytest.mark.parametrize("model", IDLE_MODELS)
def test_parameters_that_sit_out_a_step_train_like_w1(world_results, model: str, strategy: str, world: int) -> None:
    """A mixture of experts (top-1: experts idle per rank and step) and a branch some samples take train at every
    strategy and W exactly like one process on the whole batch, with no setting: DDP's buckets are completed for
    the parameters a rank's backward did not reach, FSDP reduce-scatters zeros for them and never makes a module
    called on some forwards only a unit. The reference has idle parameters in whole steps (so the zero-gradient
    convention matters under AdamW's weight decay)."""
    case = _idle_case(strategy, world, model)
    _check(world_results, case)
    assert any(IDLE_IN_REFERENCE[model]), f"{model}: no parameter was idle in a whole step; the case tests nothing"


def test_ranks_that_ran_different_fsdp_units_stop_before_the_update(world_results) -> None:
    """Units a units_fn made of modules some ranks skip: their all-gathers pair silently when the shapes agree;
    the step compares the units' call counts over the ranks and refuses the update on every rank."""
    for rank in world_results(2):
        message = rank["units-called-apart"]["error"]
        assert message.startswith("the ranks ran different FSDP units in this step"), message


def test_the_probe_finds_the_modules_called_on_some_forwards_only() -> None:
    """The driver's probe (`conditional_modules`): the experts and the branch, not the modules every forward runs."""
    from user_models import NanoGPT, SometimesBranch, TopOneMoE

    from raytrain.parallel.idle import conditional_modules

    columns = {k: torch.from_numpy(v[:4]) for k, v in _columns().items()}
    probes = [columns, *({k: v[i : i + 1] for k, v in columns.items()} for i in range(4))]
    assert conditional_modules(TopOneMoE().double(), _loss_fn, probes) == [f"experts.{i}" for i in range(4)]
    assert conditional_modules(SometimesBranch().double(), _loss_fn, probes) == ["extra"]
    tokens = torch.randint(0, 32, (4, 8))

    def lm(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(batch["x"])

    assert conditional_modules(NanoGPT(), lm, [{"x": tokens}, *({"x": tokens[i : i + 1]} for i in range(4))]) == []
