"""Fine-tune pretrained weights with raytrain: a transformers GPT-2 started from a safetensors checkpoint.

    pip install transformers                        # the model's code (raytrain reads the weights itself)
    python examples/finetune_pretrained.py [--workers 2] [--steps 20] [--strategy zero3] [--weights DIR]

Without `--weights` the example writes its own "pretrained" checkpoint first: a small GPT-2 (2 layers, 64 wide,
character vocabulary), trained for nothing, saved with transformers' `save_pretrained`. With `--weights DIR`,
give a directory `save_pretrained` wrote for the same configuration (a real one from the Hub has a 50257-token
vocabulary: change `config()` and the tokenisation to match).

What raytrain does with `init_from`: before any worker starts, the driver reads the checkpoint's headers and
checks every name and shape against the model (`lm_head.weight` is tied to `transformer.wte.weight`, and the file
holds it once: that is enough). Every worker then builds the model without memory, reads only the rows of each
tensor its shard needs (zero3 at 2 workers: half the bytes each), and starts training from them; the first log
line of the run says how much rank 0 read. The model's own init never runs for tensors the file holds.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from raytrain.config import BatchConfig, CheckpointConfig, ClusterConfig, LoopConfig, LRConfig
from raytrain.trainer import ElasticTrainer

TEXT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "shakespeare_sonnets.txt")
CONTEXT, VOCAB = 32, 128  # ASCII characters as tokens


def config() -> Any:
    import transformers

    return transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=CONTEXT, bos_token_id=0, eos_token_id=0
    )


def model_fn() -> nn.Module:
    """The architecture only; the weights come from `init_from`."""
    import transformers

    return transformers.GPT2LMHeadModel(config())


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-window mean next-character cross entropy: one loss per sample, shape [n]."""
    logits = model(input_ids=batch["x"]).logits
    losses = F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten(), reduction="none")
    return losses.view(batch["y"].shape).mean(dim=1)


def optimizer_fn(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW, no weight decay on biases and norms (groups by shape: the same on every rank and layout)."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=0.01)


def write_windows(directory: str) -> str:
    """The sonnets as Parquet windows of CONTEXT + 1 characters, with an "id" column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open(TEXT_PATH) as f:
        codes = np.minimum(np.frombuffer(f.read().encode("ascii", "replace"), dtype=np.uint8), VOCAB - 1)
    starts = np.arange(0, len(codes) - CONTEXT - 1, CONTEXT // 2)
    windows = np.stack([codes[s : s + CONTEXT + 1] for s in starts]).astype(np.int64)
    table = pa.table(
        {
            "id": pa.array(np.arange(len(windows)), type=pa.int64()),
            "x": pa.array(list(windows[:, :-1]), type=pa.list_(pa.int64(), CONTEXT)),
            "y": pa.array(list(windows[:, 1:]), type=pa.list_(pa.int64(), CONTEXT)),
        }
    )
    os.makedirs(directory, exist_ok=True)
    pq.write_table(table, os.path.join(directory, "windows.parquet"), row_group_size=128)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--strategy", default="zero3")
    parser.add_argument("--weights", default=None, help="a save_pretrained directory (default: write one)")
    parser.add_argument("--storage", default="raytrain_runs")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="raytrain-finetune-")
    weights = args.weights
    if weights is None:  # stands in for a downloaded checkpoint
        weights = os.path.join(work, "gpt2-small-chars")
        torch.manual_seed(1)
        model_fn().save_pretrained(weights)
    trainer = ElasticTrainer(
        model_fn=model_fn,
        loss_fn=loss_fn,
        optimizer_fn=optimizer_fn,
        datasets={"train": write_windows(os.path.join(work, "data"))},
        batch=BatchConfig(global_batch=32, micro_batch=8),
        lr=LRConfig(base_lr=3e-4, warmup_steps=5, schedule="cosine", min_lr_ratio=0.1),
        loop=LoopConfig(max_steps=args.steps, strategy=args.strategy, id_column="id", max_grad_norm=1.0),
        checkpoint=CheckpointConfig(storage_path=args.storage, run_name="finetune-gpt2", every_steps=10),
        cluster=ClusterConfig(min_workers=1, max_workers=args.workers),
        required_columns=("x", "y"),
        init_from=weights,  # raytrain: start from these weights (names and shapes checked before any worker starts)
    )
    result = trainer.fit()
    print(f"final loss {result.metrics['loss']:.4f}; run directory {result.run_dir}")


if __name__ == "__main__":
    main()
