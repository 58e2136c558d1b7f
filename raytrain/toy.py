"""Small, self-contained models and data sets for the demo, the examples, tests and benchmarks.

Everything here is generated from a seed: no downloads. Functions are module-level (or `functools.partial` of
module-level functions) so Ray can ship them to workers by reference.
"""

from __future__ import annotations

import math
import os
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn


def regression_weights(features: int = 8) -> np.ndarray:
    """The weights w of `regression_arrays`' problem y = tanh(x @ w) + noise: fixed by the feature count alone."""
    return np.random.default_rng([features, 0]).normal(size=features).astype(np.float32)


def regression_arrays(num_rows: int, features: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    """A noisy nonlinear regression problem: columns "id" (int64), "x" (float32 [features]) and "y" (float32).

    The problem (y = tanh(x @ w) + noise) is one per feature count, whatever `seed` and `num_rows`; `seed` draws
    the samples: so `seed=1` is a validation set of the same problem as the training set of `seed=0`."""
    w = regression_weights(features)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_rows, features)).astype(np.float32)
    y = (np.tanh(x @ w) + 0.1 * rng.normal(size=num_rows)).astype(np.float32)
    return {"id": np.arange(num_rows, dtype=np.int64), "x": x, "y": y}


def write_regression_parquet(
    directory: str | os.PathLike[str],
    num_rows: int,
    features: int = 8,
    seed: int = 0,
    *,
    files: int = 3,
    row_group: int = 16,
) -> list[str]:
    """Write the regression arrays as `files` Parquet files of row groups of `row_group` rows ("x" a fixed-size list
    column); returns the paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrays = regression_arrays(num_rows, features, seed)
    os.makedirs(directory, exist_ok=True)
    paths = []
    for part, index in enumerate(np.array_split(np.arange(num_rows), files)):
        x = pa.FixedSizeListArray.from_arrays(pa.array(arrays["x"][index].reshape(-1)), features)
        table = pa.table({"id": pa.array(arrays["id"][index]), "x": x, "y": pa.array(arrays["y"][index])})
        path = os.path.join(os.fspath(directory), f"part-{part:03d}.parquet")
        pq.write_table(table, path, row_group_size=row_group)
        paths.append(path)
    return paths


def regression_dataset(num_rows: int, features: int = 8, seed: int = 0) -> Any:
    """The regression arrays as a `ray.data.Dataset` (needs Ray initialised)."""
    return _from_arrays(regression_arrays(num_rows, features, seed))


def _from_arrays(arrays: dict[str, np.ndarray]) -> Any:
    """One Arrow table (tensor columns for arrays of rank > 1) as a Ray dataset."""
    import pyarrow as pa
    import ray.data
    from ray.data.extensions import ArrowTensorArray

    columns = {
        name: ArrowTensorArray.from_numpy(value) if value.ndim > 1 else pa.array(value)
        for name, value in arrays.items()
    }
    return ray.data.from_arrow(pa.table(columns))


def mlp(features: int = 8, hidden: int = 32, dtype: torch.dtype = torch.float32, dropout: float = 0.0) -> nn.Module:
    """A two-layer MLP regressor: [n, features] -> [n] (with a dropout layer after the hidden one if `dropout`)."""
    extra = [nn.Dropout(dropout)] if dropout else []
    layers = [nn.Linear(features, hidden), nn.Tanh(), *extra, nn.Linear(hidden, 1), nn.Flatten(0)]
    return nn.Sequential(*layers).to(dtype)


def mlp_factory(features: int = 8, hidden: int = 32, dropout: float = 0.0) -> partial[nn.Module]:
    """A picklable `model_fn` building `mlp(features, hidden, dropout=dropout)`."""
    return partial(mlp, features, hidden, dropout=dropout)


def mlp_tp_plan(model: nn.Module) -> dict[str, str]:
    """The tensor-parallel plan of `mlp`: the first linear layer colwise (each tp rank computes its slice of the
    hidden units, tanh and dropout act on the slice), the last rowwise (partial outputs all-reduced once)."""
    linears = [name for name, child in model.named_children() if isinstance(child, nn.Linear)]
    return {linears[0]: "colwise", linears[-1]: "rowwise"}


class ResidualBlock(nn.Module):
    """x + W2 tanh(W1 LayerNorm(x)): the repeated unit of `block_mlp` (one FSDP unit each)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The residual update of `x` [n, width]."""
        return x + self.down(torch.tanh(self.up(self.norm(x))))


def block_mlp(features: int = 8, width: int = 32, blocks: int = 4) -> nn.Module:
    """A regressor built like a transformer's trunk: in-projection, `blocks` residual blocks, head: [n, f] -> [n]."""
    return nn.Sequential(
        nn.Linear(features, width),
        nn.Sequential(*(ResidualBlock(width) for _ in range(blocks))),
        nn.Linear(width, 1),
        nn.Flatten(0),
    )


def block_mlp_tp_plan(model: nn.Module) -> dict[str, str]:
    """The tensor-parallel plan of `block_mlp`: each residual block's up projection colwise, down rowwise."""
    return {"1.*.up": "colwise", "1.*.down": "rowwise"}


def block_mlp_factory(features: int = 8, width: int = 32, blocks: int = 4) -> partial[nn.Module]:
    """A picklable `model_fn` building `block_mlp(features, width, blocks)`."""
    return partial(block_mlp, features, width, blocks)


def squared_error(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-sample squared error of `model(batch["x"])` against `batch["y"]`: shape [n]."""
    return (model(batch["x"]) - batch["y"]) ** 2


def sgd(params: Any, lr: float) -> torch.optim.Optimizer:
    """Plain SGD with momentum 0.9."""
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def adamw(params: Any, lr: float) -> torch.optim.Optimizer:
    """AdamW with weight decay 0.01."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def inverse_sqrt_schedule(step: int, total_steps: int) -> float:
    """An `lr_schedule_fn`: the factor 1 / sqrt(step + 1) of the peak LR (the "rsqrt" schedule; ignores the
    run's length)."""
    return 1.0 / math.sqrt(step + 1)


def adamw_groups(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW as most runs configure it: weight decay 0.1 on matrices only (no decay for biases and norms), and the
    first layer at half the LR (as one might treat an embedding)."""
    named = list(model.named_parameters())
    first = named[0][0].rsplit(".", 1)[0]  # the module that owns the first parameter
    groups: list[dict[str, Any]] = [
        {"params": [p for n, p in named if p.ndim >= 2 and n.startswith(first + ".")], "lr": 0.5 * lr},
        {"params": [p for n, p in named if p.ndim >= 2 and not n.startswith(first + ".")]},
        {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=0.1)


class GPTBlock(nn.Module):
    """A pre-norm transformer block with separate q, k, v projections: the layout tensor parallelism splits
    (q, k, v colwise -> `proj` rowwise; `fc` colwise -> `out` rowwise). Heads are sized by `head_dim`, so a rank
    holding a colwise slice of q, k, v attends with its heads / tp heads."""

    def __init__(self, width: int, head_dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.proj = nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        # `hidden_drop` acts on the MLP's hidden units (split under tp: each tp rank draws its own mask),
        # `resid_drop` on each residual branch (whole on every tp rank: the ranks draw the same mask)
        self.hidden_drop: nn.Module = nn.Dropout(dropout) if dropout else nn.Identity()
        self.resid_drop: nn.Module = nn.Dropout(dropout) if dropout else nn.Identity()

    def _heads(self, projected: torch.Tensor, n: int, t: int) -> torch.Tensor:
        """[n, T, heads x head_dim] -> [n, heads, T, head_dim]; the head count from the tensor (a rank holding a
        colwise slice has fewer), written out so that an empty micro-batch (n = 0) reshapes too."""
        heads = projected.shape[-1] // self.head_dim
        return projected.view(n, t, heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, T, width] -> [n, T, width]; causal attention."""
        n, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (self._heads(m(h), n, t) for m in (self.q, self.k, self.v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.resid_drop(self.proj(y.transpose(1, 2).reshape(n, t, y.shape[1] * y.shape[3])))
        return x + self.resid_drop(self.out(self.hidden_drop(nn.functional.gelu(self.fc(self.ln2(x))))))


class GPT(nn.Module):
    """A tiny decoder-only transformer for tensor- and pipeline-parallel runs: token and position embeddings,
    `blocks` `GPTBlock`s, a final norm and a linear head. Tokens [n, T] -> logits [n, T, vocab]. With
    `tie_embeddings` the head has no bias and shares its weight with the token embedding (GPT-2's tie); `dropout`
    > 0 adds dropout on each block's residual branches and MLP hidden units."""

    def __init__(
        self,
        vocab: int = 16,
        context: int = 8,
        width: int = 32,
        head_dim: int = 8,
        blocks: int = 2,
        tie_embeddings: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(GPTBlock(width, head_dim, dropout) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=not tie_embeddings)
        if tie_embeddings:
            self.head.weight = self.token.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [n, T, vocab] for tokens [n, T]."""
        h = self.token(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    def pipeline_split(self) -> dict[str, object]:
        """The pipeline split (`raytrain.parallel.pipeline`): the embeddings run before the blocks (first stage),
        the final norm and the head after them (last stage)."""
        return {"blocks": "blocks", "first": ["token", "position"], "last": ["norm", "head"]}

    def tp_plan(self) -> dict[str, str]:
        """The tensor-parallel plan (`raytrain.parallel.tensor`): attention and MLP split Megatron-style;
        embeddings, norms and the head stay whole."""
        plan = {f"blocks.*.{name}": "colwise" for name in ("q", "k", "v", "fc")}
        plan.update({"blocks.*.proj": "rowwise", "blocks.*.out": "rowwise"})
        return plan


def gpt_factory(
    vocab: int = 16, context: int = 8, width: int = 32, head_dim: int = 8, blocks: int = 2
) -> partial[nn.Module]:
    """A picklable `model_fn` building `GPT(...)`."""
    return partial(GPT, vocab, context, width, head_dim, blocks)  # type: ignore[return-value]


def token_arrays(num_rows: int, vocab: int = 16, context: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    """Sequences that follow a learnable rule (each token is the previous one plus a per-row step, mod `vocab`):
    columns "id" (int64), "x" and "y" (int64 [n, context]; y is x shifted by one token)."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, vocab, size=(num_rows, 1))
    step = rng.integers(1, 4, size=(num_rows, 1))
    tokens = (start + step * np.arange(context + 1)) % vocab
    return {"id": np.arange(num_rows, dtype=np.int64), "x": tokens[:, :-1], "y": tokens[:, 1:]}


def token_dataset(num_rows: int, vocab: int = 16, context: int = 8, seed: int = 0) -> Any:
    """The token arrays as a `ray.data.Dataset` (needs Ray initialised)."""
    return _from_arrays(token_arrays(num_rows, vocab, context, seed))


def next_token_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-sequence mean next-token cross entropy: shape [n]."""
    logits = model(batch["x"])
    losses = nn.functional.cross_entropy(logits.flatten(0, 1), batch["y"].flatten(), reduction="none")
    return losses.view(batch["y"].shape).mean(dim=1)
