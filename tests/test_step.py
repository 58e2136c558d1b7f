"""`raytrain.step.Step` as a user's own loop drives it, in one process: the three ways to hand over a loss give
the update of `train_step` with per-sample losses; each misuse fails at once, naming what to do instead. And the
map-style data that `raytrain.attach` takes."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raytrain.data.materialized import ColumnData, IndexedSteps
from raytrain.errors import ConfigError
from raytrain.step import Step, train_step


def _setup() -> tuple[nn.Module, torch.optim.Optimizer, list[dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1, dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(10, 4, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    empty = {"x": x[:0], "y": y[:0]}  # what the plan hands a rank with no sample in a micro-step
    return model, optimizer, [{"x": x[:4], "y": y[:4]}, empty, {"x": x[4:], "y": y[4:]}]  # uneven micro-batches


def _per_sample(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (model(batch["x"]).squeeze(-1) - batch["y"]) ** 2


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_a_users_loop_over_step_equals_train_step(reduction: str):
    model, optimizer, micro = _setup()
    reference, ref_optimizer = copy.deepcopy(model), None
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = train_step(reference, ref_optimizer, _per_sample, micro, 1, 10, max_grad_norm=0.5)

    step = Step(model, optimizer, micro, 1, 10, max_grad_norm=0.5)
    for batch in step.micro_batches():
        prediction = model(batch["x"]).squeeze(-1)
        if reduction == "none":
            step.backward((prediction - batch["y"]) ** 2)
        else:
            step.backward(F.mse_loss(prediction, batch["y"], reduction=reduction), reduction=reduction)
    result = step.optimizer_step(optimizer)
    assert result.loss_sum == pytest.approx(expected.loss_sum, abs=1e-12)
    assert result.grad_norm == pytest.approx(expected.grad_norm, abs=1e-12)
    assert step.loss == pytest.approx(expected.loss_sum / 10)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)


def test_misuse_fails_at_once_saying_what_to_do():
    model, optimizer, micro = _setup()
    step = Step(model, optimizer, micro, 1, 10)
    with pytest.raises(RuntimeError, match=r"inside `for micro in step\.micro_batches"):
        step.backward(torch.zeros(4))
    with pytest.raises(RuntimeError, match="before the step's micro-batches"):
        step.optimizer_step()
    batches = step.micro_batches()
    batch = next(batches)
    with pytest.raises(ValueError, match=r"one loss per sample \(shape \[4\]\), got shape \(\)"):
        step.backward(_per_sample(model, batch).mean())  # a mean without reduction="mean": refused, not wrong
    with pytest.raises(ValueError, match="takes a 0-d loss"):
        step.backward(_per_sample(model, batch), reduction="mean")
    with pytest.raises(ValueError, match="reduction must be one of"):
        step.backward(_per_sample(model, batch).sum(), reduction="average")
    with pytest.raises(RuntimeError, match="optimizer_step\\(\\) inside the micro-batch loop"):
        step.optimizer_step()
    with pytest.raises(RuntimeError, match=r"micro-batch 1 of 3 ended without step\.backward"):
        next(batches)
    with pytest.raises(RuntimeError, match="walked once per step"):
        next(step.micro_batches())

    step = Step(model, optimizer, micro, 1, 10)
    for batch in step.micro_batches():
        step.backward(_per_sample(model, batch))
    with pytest.raises(ValueError, match=r"not the optimizer that run\.prepare"):
        step.optimizer_step(torch.optim.SGD(model.parameters(), lr=1.0))
    step.optimizer_step()
    with pytest.raises(RuntimeError, match="already called"):
        step.optimizer_step()


class _Items(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, object]:
        return {"id": self.ids[i], "x": torch.full((3,), float(self.ids[i])), "y": np.float32(self.ids[i] / 2)}


def test_map_style_data_is_read_into_columns_in_id_order_and_split_exactly():
    data = ColumnData.from_map_style(_Items([5, 3, 9, 1, 7, 0, 2]), id_column="id")
    assert data.num_rows == 7 and data.ids.tolist() == [0, 1, 2, 3, 5, 7, 9]
    columns = data.load_columns()
    assert columns["x"].shape == (7, 3) and columns["x"][:, 0].tolist() == [0, 1, 2, 3, 5, 7, 9]
    assert ColumnData.from_map_style(_Items([5, 3])).ids.tolist() == [0, 1]  # no id column: the index

    from raytrain.batch_plan import plan_batch

    plan = plan_batch(global_batch=4, micro_batch_cap=2, world_size=2)
    ranks = [IndexedSteps(data, seed=1, plan=plan, rank=r, device="cpu", drop_last=False) for r in range(2)]
    first = [source.next_step(0, 0) for source in ranks]
    seen = [int(i) for step in first for batch in step.micro_batches for i in batch["id"]]
    assert sorted(seen) == sorted(first[0].ids.tolist()) and len(seen) == 4

    with pytest.raises(ConfigError, match="some ids repeat"):
        ColumnData.from_map_style(_Items([1, 1]), id_column="id")
    with pytest.raises(ConfigError, match="'uid' is not a key"):
        ColumnData.from_map_style(_Items([1]), id_column="uid")
    with pytest.raises(ConfigError, match="must be dicts"):
        ColumnData.from_map_style([(1, 2)])
    with pytest.raises(ConfigError, match="empty"):
        ColumnData.from_map_style([])
