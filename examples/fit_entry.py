"""Builders for `raytrain fit examples/fit_mlp.toml` (the file names them as "fit_entry.py:<function>").

    raytrain fit examples/fit_mlp.toml --dry-run       # validate and print the plan, start nothing
    raytrain fit examples/fit_mlp.toml                 # train on a local Ray instance (or RAY_ADDRESS's cluster)

`datasets()` runs on the driver after Ray is up; the other three are shipped to every worker.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from raytrain.toy import mlp, mlp_tp_plan, regression_dataset


def model() -> nn.Module:
    """A two-layer MLP regressor, 16 features -> 1 (built in every worker after torch.manual_seed(seed))."""
    return mlp(features=16, hidden=64)


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One squared error per sample (raytrain normalises by the global batch)."""
    return (model(batch["x"]) - batch["y"]) ** 2


def optimizer(params: Any, lr: float) -> torch.optim.Optimizer:
    """AdamW; raytrain sets the LR every step from the LR rule."""
    return torch.optim.AdamW(params, lr=lr)


def tp_plan(model: nn.Module) -> dict[str, str]:
    """For `[parallel] tp = 2` (or `--tp 2`): split the MLP's hidden layer over the tp workers (the first linear
    layer colwise, the second rowwise; see raytrain.parallel.tensor)."""
    return mlp_tp_plan(model)


def datasets() -> dict[str, Any]:
    """A generated regression problem (3,200 training rows, 320 validation rows) with an "id" column."""
    return {"train": regression_dataset(3200, features=16, seed=0), "val": regression_dataset(320, features=16, seed=1)}
