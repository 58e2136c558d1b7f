"""The optimizer factory forms, zero1's shardability check and per-group LRs (pure: no process group, no Ray).
zero1 on real gloo groups with AdamW parameter groups is in tests/test_equivalence.py."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

from raytrain.config import BatchConfig, LoopConfig, LRConfig
from raytrain.errors import ConfigError
from raytrain.optim import call_optimizer_fn, check_shardable, lr_ratios, set_lr, wants_model
from raytrain.toy import mlp_factory, squared_error
from raytrain.trainer import ElasticTrainer


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1))


def adamw_by_shape(params: Any, lr: float) -> torch.optim.Optimizer:
    params = list(params)
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=lr,
    )


def adamw_by_name(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    first = [p for n, p in model.named_parameters() if n.startswith("0.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("0.")]
    return torch.optim.AdamW([{"params": first, "lr": 0.1 * lr}, {"params": rest}], lr=lr, weight_decay=0.01)


class NeedsExtraArgument(torch.optim.SGD):
    def __init__(self, params: Any, lr: float, trust: float) -> None:
        super().__init__(params, lr=lr)
        self.trust = trust


def test_factory_form_is_chosen_by_the_first_parameters_name() -> None:
    assert wants_model(adamw_by_name)
    assert not wants_model(adamw_by_shape)
    assert not wants_model(functools.partial(torch.optim.SGD, momentum=0.9))
    assert not wants_model(torch.optim.AdamW)
    model = _model()
    by_name = call_optimizer_fn(adamw_by_name, model, 1e-3)
    assert [g["lr"] for g in by_name.param_groups] == pytest.approx([1e-4, 1e-3])
    by_shape = call_optimizer_fn(adamw_by_shape, model, 1e-3)
    assert [g["weight_decay"] for g in by_shape.param_groups] == [0.1, 0.0]


def test_adamw_adam_and_sgd_with_groups_can_be_sharded() -> None:
    model = _model()
    for optimizer in (
        call_optimizer_fn(adamw_by_name, model, 1e-3),
        call_optimizer_fn(adamw_by_shape, model, 1e-3),
        torch.optim.Adam([{"params": model[0].parameters(), "lr": 1e-4}, {"params": model[2].parameters()}], lr=1e-3),
        torch.optim.SGD([{"params": model[0].parameters(), "momentum": 0.0}, {"params": model[2].parameters()}], 0.1),
    ):
        check_shardable(optimizer)


def test_an_optimizer_zero1_cannot_rebuild_is_a_config_error_naming_it() -> None:
    optimizer = NeedsExtraArgument(_model().parameters(), lr=0.1, trust=0.5)
    with pytest.raises(ConfigError, match=r"strategy 'zero1' cannot shard optimizer .*NeedsExtraArgument.*trust"):
        check_shardable(optimizer)


def test_set_lr_keeps_every_groups_ratio() -> None:
    optimizer = call_optimizer_fn(adamw_by_name, _model(), 2e-3)
    ratios = lr_ratios(optimizer, 2e-3)
    assert ratios == pytest.approx([0.1, 1.0])
    set_lr(optimizer, ratios, 5e-4)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([5e-5, 5e-4])


def _trainer(**kwargs: Any) -> ElasticTrainer:
    options: dict[str, Any] = {
        "model_fn": mlp_factory(8, 16),
        "loss_fn": squared_error,
        "optimizer_fn": adamw_by_shape,
        "datasets": {"train": None},
        "batch": BatchConfig(global_batch=8, micro_batch=4),
        "lr": LRConfig(base_lr=1e-3),
        "loop": LoopConfig(strategy="zero1"),
    }
    return ElasticTrainer(**{**options, **kwargs})


def test_driver_check_accepts_adamw_groups_for_zero1() -> None:
    _trainer().check_user_functions()


def test_driver_check_rejects_an_unshardable_optimizer_before_any_worker() -> None:
    trainer = _trainer(optimizer_fn=functools.partial(NeedsExtraArgument, trust=0.5))
    with pytest.raises(ConfigError, match="strategy 'zero1' cannot shard optimizer"):
        trainer.check_user_functions()
    _trainer(optimizer_fn=functools.partial(NeedsExtraArgument, trust=0.5), loop=LoopConfig()).check_user_functions()


def test_driver_check_names_a_broken_model_or_optimizer_fn() -> None:
    with pytest.raises(ConfigError, match=r"model_fn .* must return a torch.nn.Module, got str"):
        _trainer(model_fn=lambda: "not a model").check_user_functions()
    with pytest.raises(ConfigError, match=r"optimizer_fn must return a torch\.optim\.Optimizer, got list"):
        _trainer(optimizer_fn=lambda params, lr: list(params)).check_user_functions()
