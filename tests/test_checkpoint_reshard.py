"""A checkpoint written at W = 2 loads at W' = 1 and 3, for ddp, zero1, zero2 and zero3 (gloo, no Ray).

Each rank saves its share with `save_checkpoint` into its own directory, as in a Ray run, and once more in the
background (`start_save` on a gloo group of its own, then a training step that changes every parameter in place
while the files are written, then `finish_save`): that checkpoint must hold the state of the step it was taken
at. The test merges the directories the way Ray Train does (one directory, all files) and loads it at another
world size. After loading, the full parameters equal the saved ones, and one more optimizer step on the same
global batch gives the same parameters as the run that never stopped, which holds only when the optimizer state
(momentum) came back too. The user's own state saved beside them (`extras`, as `raytrain.attach`'s `run.track`
saves it: an EMA keyed by the module's own names, DTensors under zero2/zero3, and a plain counter) comes back whole
at the other world size.
"""

from __future__ import annotations

import os
import shutil
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from raytrain.batch_plan import plan_batch
from raytrain.checkpoint import (
    TrainState,
    checkpoint_group,
    finish_save,
    load_checkpoint,
    load_extras,
    save_checkpoint,
    start_save,
)
from raytrain.data.id_ranges import IdRanges
from raytrain.data.materialized import rank_micro_batches
from raytrain.optim import build_optimizer
from raytrain.parallel.apply import apply_parallelism
from raytrain.testing.multiprocess import run_world
from raytrain.worker_loop import train_step

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
KINDS = ("sync", "background")
GLOBAL_BATCH = 12
ROWS = 3 * GLOBAL_BATCH


def _columns() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(ROWS, 5)), "y": rng.normal(size=ROWS)}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1), nn.Flatten(0)).double()


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (model(batch["x"]) - batch["y"]) ** 2


def _sgd(params, lr: float) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int, world: int) -> None:
    plan = plan_batch(GLOBAL_BATCH, 2, world)
    positions = np.arange(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
    batches = rank_micro_batches(_columns(), positions, plan, rank, torch.device("cpu"))
    train_step(model, optimizer, _loss, batches, world, GLOBAL_BATCH)


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


class _Shadow:
    """A user's own state: an EMA-like copy of the parameters (keyed by the module's own names) and a counter."""

    def __init__(self, model: nn.Module, zero: bool = False) -> None:
        module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        self.weights = {
            name: torch.zeros_like(p.detach()) if zero else p.detach().clone() for name, p in module.named_parameters()
        }
        self.count = 0 if zero else 7

    def state_dict(self) -> dict[str, object]:
        return {"weights": self.weights, "count": self.count}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.weights, self.count = state["weights"], state["count"]  # type: ignore[assignment]

    def full(self) -> dict[str, object]:
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in self.weights.items()}
        return {"weights": full, "count": self.count}


def _world_main(rank: int, world: int, mode: str, out: str) -> dict[str, object]:
    results: dict[str, object] = {}
    group = checkpoint_group()
    for strategy in STRATEGIES:
        for kind in KINDS:
            model = apply_parallelism(_model(), strategy, torch.device("cpu"), world)
            optimizer = build_optimizer(model, _sgd, 0.05, strategy)
            key = f"{strategy}-{kind}"
            try:
                if mode == "save":  # two steps, checkpoint, one more step: the continuation to reproduce
                    _step(model, optimizer, 0, rank, world)
                    _step(model, optimizer, 1, rank, world)
                    state, ids = TrainState(step=2), IdRanges.from_ids(np.arange(5, 9))
                    extras = {"ema": _Shadow(model)}
                    if kind == "sync":
                        directory = save_checkpoint(model, optimizer, state, rank, ids, extras=extras)
                        saved = _full_params(model)
                        _step(model, optimizer, 2, rank, world)
                    else:  # the next step runs while the files are being written
                        pending = start_save(model, optimizer, state, rank, ids, background_group=group, extras=extras)
                        saved = _full_params(model)
                        _step(model, optimizer, 2, rank, world)
                        directory = finish_save(pending, rank)
                    results[key] = {"dir": directory, "saved": saved, "after": _full_params(model)}
                else:  # load the merged checkpoint, then take step 2
                    state, _ = load_checkpoint(os.path.join(out, key), model, optimizer)
                    loaded = _full_params(model)
                    ema = _Shadow(model, zero=True)
                    missing = load_extras(os.path.join(out, key), {"ema": ema, "absent": _Shadow(model, zero=True)})
                    _step(model, optimizer, 2, rank, world)
                    results[key] = {
                        "step": state.step,
                        "loaded": loaded,
                        "after": _full_params(model),
                        "ema": ema.full(),
                        "missing": missing,
                    }
            except Exception:
                results[key] = {"error": traceback.format_exc()}
    return results


def _run(world: int, mode: str, out: Path) -> list[dict[str, dict]]:
    return run_world(_world_main, world, mode, str(out))


@pytest.fixture(scope="module")
def saved_and_loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, dict[int, list]]:
    out = tmp_path_factory.mktemp("reshard")
    saved = _run(2, "save", out)
    for key in (f"{strategy}-{kind}" for strategy in STRATEGIES for kind in KINDS):  # merge, as Ray Train does
        merged = out / key
        merged.mkdir()
        for rank_result in saved:
            assert "error" not in rank_result[key], rank_result[key].get("error")
            for name in os.listdir(rank_result[key]["dir"]):
                shutil.copy(os.path.join(rank_result[key]["dir"], name), merged / name)
    return saved, {world: _run(world, "load", out) for world in (1, 3)}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_from_w2_loads_and_continues_at_other_w(
    saved_and_loaded, strategy: str, world: int, kind: str
) -> None:
    saved, loaded = saved_and_loaded
    reference = saved[0][f"{strategy}-{kind}"]
    assert not torch.equal(reference["saved"]["0.weight"], reference["after"]["0.weight"])  # the step changed it
    for rank, result in enumerate(loaded[world]):
        outcome = result[f"{strategy}-{kind}"]
        assert "error" not in outcome, f"rank {rank}: {outcome.get('error')}"
        assert outcome["step"] == 2
        for name, value in reference["saved"].items():
            assert torch.allclose(outcome["loaded"][name], value, atol=1e-12), f"{name} not restored"
        for name, value in reference["after"].items():
            # Equal only if the momentum buffers were restored too (and resharded for W' ranks).
            assert torch.allclose(outcome["after"][name], value, atol=1e-10), f"{name} diverged after resume"
        assert outcome["missing"] == ["absent"] and outcome["ema"]["count"] == 7
        assert set(outcome["ema"]["weights"]) == set(reference["saved"])
        for name, value in reference["saved"].items():  # the EMA was the parameters at the checkpoint
            assert torch.equal(outcome["ema"]["weights"][name], value), f"the user's state for {name} not restored"
