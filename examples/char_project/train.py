"""The builders of a two-file project, as a user writes one (`job.toml` names them as "train.py:<function>"):

    raytrain fit examples/char_project/job.toml --dry-run     # every check, no worker started
    raytrain fit examples/char_project/job.toml               # train on a local Ray instance
    cd examples && ray job submit --working-dir . -- raytrain fit char_project/job.toml

`import charmodel` finds the neighbour file: raytrain puts this file's directory on the path and ships the modules
imported from it to the workers by value. `datasets()` runs on the driver; the other builders run in every worker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import charmodel
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
CONTEXT = 32


def model() -> nn.Module:
    return charmodel.CharGRU()


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-window mean next-character cross entropy: one loss per sample, shape [n]."""
    logits = model(batch["x"])
    losses = nn.functional.cross_entropy(logits.flatten(0, 1), batch["y"].flatten(), reduction="none")
    return losses.view(batch["y"].shape).mean(dim=1)


def optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (groups by parameter shape)."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=0.1)


def datasets() -> dict[str, Any]:
    """Windows of Shakespeare's sonnets as Parquet files (written once, next to this file), read in place."""
    out = HERE / "data"
    if not out.exists():
        codes = charmodel.encode((HERE.parent / "data" / "shakespeare_sonnets.txt").read_text())
        starts = np.arange(0, len(codes) - CONTEXT - 1, CONTEXT // 2)
        windows = np.stack([codes[s : s + CONTEXT + 1] for s in starts])
        out.mkdir()
        for part, rows in enumerate(np.array_split(np.arange(len(windows)), 2)):
            table = pa.table(
                {
                    "id": pa.array(rows, type=pa.int64()),
                    "x": pa.array(list(windows[rows, :-1]), type=pa.list_(pa.int64(), CONTEXT)),
                    "y": pa.array(list(windows[rows, 1:]), type=pa.list_(pa.int64(), CONTEXT)),
                }
            )
            pq.write_table(table, out / f"part-{part}.parquet", row_group_size=256)
    return {"train": str(out)}
