"""Fine-tune a pretrained language model as a classifier with raytrain, then export it for transformers.

    pip install transformers                        # the model's code (raytrain reads and writes the weights itself)
    python examples/finetune_pretrained.py [--workers 2] [--steps 20] [--strategy zero3] [--weights DIR]

The most common fine-tune: a new head on a pretrained trunk. The task here: does a 32-character window of
Shakespeare's sonnets hold a line break? The model is transformers' GPT2ForSequenceClassification; its weights
start from a GPT2LMHeadModel checkpoint. Without `--weights` the example writes that checkpoint first (a small
GPT-2, 2 layers, 64 wide, character vocabulary, saved untrained with `save_pretrained`; it stands in for a
download). With `--weights DIR`, give a directory `save_pretrained` wrote for the same configuration.

What raytrain does with `init_from`: before any worker starts, the driver reads the checkpoint's headers and
matches every name and shape against the classifier. The trunk's tensors are in the file; the classifier's head
(`score.weight`) is not: it keeps the model's own init, the same at every world size, and one line says so. (A
tensor of the file the model lacks, such as an untied LM head, is refused unless `init_unexpected="ignore"`.)
Every worker reads only the rows of each tensor its shard needs (zero3 at 2 workers: half the bytes each).

After training the example exports the run (`raytrain.export`, as `raytrain export RUN_DIR OUT_DIR` does):
safetensors under the model's own names and transformers' config.json, then loads the export with
`AutoModelForSequenceClassification.from_pretrained` and prints its loss and accuracy beside those of
`raytrain.load_model` (the run's model in this process): the two losses are the same number.
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

import raytrain
from raytrain.config import BatchConfig, CheckpointConfig, ClusterConfig, LoopConfig, LRConfig
from raytrain.trainer import ElasticTrainer

TEXT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "shakespeare_sonnets.txt")
CONTEXT, VOCAB = 32, 128  # ASCII characters as tokens
NEWLINE = ord("\n")


def config(labels: int | None = None) -> Any:
    import transformers

    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=CONTEXT, bos_token_id=0, eos_token_id=0
    )
    if labels is not None:  # the classifier reads the last token that is not padding (no window holds a 0)
        config.num_labels, config.pad_token_id = labels, 0
    return config


def model_fn() -> nn.Module:
    """The architecture only: the trunk's weights come from `init_from`, the head keeps its own init."""
    import transformers

    return transformers.GPT2ForSequenceClassification(config(labels=2))


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross entropy per window: one loss per sample, shape [n]."""
    return F.cross_entropy(model(input_ids=batch["x"]).logits, batch["label"], reduction="none")


def optimizer_fn(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW, no weight decay on biases and norms (groups by shape: the same on every rank and layout)."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=0.01)


def windows() -> tuple[np.ndarray, np.ndarray]:
    """The sonnets cut into windows of CONTEXT characters, and each window's label: 1 if it holds a line break."""
    with open(TEXT_PATH) as f:
        codes = np.minimum(np.frombuffer(f.read().encode("ascii", "replace"), dtype=np.uint8), VOCAB - 1)
    starts = np.arange(0, len(codes) - CONTEXT, CONTEXT // 4)
    x = np.stack([codes[s : s + CONTEXT] for s in starts]).astype(np.int64)
    return x, (x == NEWLINE).any(axis=1).astype(np.int64)


def write_windows(directory: str) -> str:
    """The windows as a Parquet file with an "id" column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    x, label = windows()
    table = pa.table(
        {
            "id": pa.array(np.arange(len(x)), type=pa.int64()),
            "x": pa.array(list(x), type=pa.list_(pa.int64(), CONTEXT)),
            "label": pa.array(label, type=pa.int64()),
        }
    )
    os.makedirs(directory, exist_ok=True)
    pq.write_table(table, os.path.join(directory, "windows.parquet"), row_group_size=128)
    return directory


@torch.no_grad()
def evaluate(model: nn.Module, count: int = 256) -> tuple[float, float]:
    """(mean loss, accuracy) of `model` on the first `count` windows."""
    x, label = (torch.from_numpy(a[:count]) for a in windows())
    logits = model(input_ids=x).logits
    return float(F.cross_entropy(logits, label)), float((logits.argmax(-1) == label).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--strategy", default="zero3")
    parser.add_argument("--weights", default=None, help="a GPT2LMHeadModel save_pretrained directory (default: one)")
    parser.add_argument("--storage", default="raytrain_runs")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="raytrain-finetune-")
    weights = args.weights
    if weights is None:  # stands in for a downloaded language model
        import transformers

        weights = os.path.join(work, "gpt2-small-chars")
        torch.manual_seed(1)
        transformers.GPT2LMHeadModel(config()).save_pretrained(weights)
    trainer = ElasticTrainer(
        model_fn=model_fn,
        loss_fn=loss_fn,
        optimizer_fn=optimizer_fn,
        datasets={"train": write_windows(os.path.join(work, "data"))},
        batch=BatchConfig(global_batch=32, micro_batch=8),
        lr=LRConfig(base_lr=1e-3, warmup_steps=5, schedule="cosine", min_lr_ratio=0.1),
        loop=LoopConfig(max_steps=args.steps, strategy=args.strategy, id_column="id", max_grad_norm=1.0),
        checkpoint=CheckpointConfig(storage_path=args.storage, run_name="finetune-gpt2", every_steps=10),
        cluster=ClusterConfig(min_workers=1, max_workers=args.workers),
        required_columns=("x", "label"),
        init_from=weights,  # raytrain: the trunk from these weights; the new head keeps its own init (one line)
    )
    result = trainer.fit()
    print(f"final loss {result.metrics['loss']:.4f}; run directory {result.run_dir}")

    # raytrain: the trained model out, as safetensors transformers loads (`raytrain export RUN_DIR OUT_DIR`).
    exported = os.path.join(result.run_dir, "exported")
    raytrain.export(result.storage_uri, exported, overwrite=True, log=print)
    import transformers

    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(exported)
    ours = raytrain.load_model(result.storage_uri, model_fn)  # the same weights, in this process
    (loss, accuracy), (our_loss, _) = evaluate(theirs), evaluate(ours)
    print(f"exported model: loss {loss:.6f} (raytrain's model: {our_loss:.6f}), accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
