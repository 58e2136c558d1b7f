"""Train a tiny character-level transformer language model on Shakespeare's sonnets with raytrain.

    python examples/train_char_lm.py [--workers 2] [--steps N] [--storage DIR] [--strategy ddp|zero1|zero2|zero3|auto]
                                     [--pp 2 [--pp-schedule gpipe|1f1b|interleaved_1f1b]] [--layers N]

The text, examples/data/shakespeare_sonnets.txt, is 23 of Shakespeare's sonnets (1609; public domain), in the
modernised spelling of the Project Gutenberg edition (eBook #1041), numbered as in the original. About 13 KB:
small enough to train on in a minute on two CPU cores, large enough to watch the loss fall.

With `--pp 2` the model is cut into two pipeline stages between its blocks (`CharTransformer.pipeline_split`), one
per worker of a replica, and the step's micro-batches flow through them in the `--pp-schedule` order; the final
checkpoint still loads into one whole model for the sample. `interleaved_1f1b` gives each worker two chunks of the
model (blocks 0 and 2, 1 and 3 with `--pp 2 --layers 4`): it needs at least 2 x pp blocks.

With RAY_ADDRESS set it joins that cluster; otherwise it starts a local Ray instance. The run goes to
<storage>/<run-name> (default ./raytrain_runs/char_lm); running the same command again resumes from the latest
checkpoint there. At the end the driver loads the final checkpoint into a fresh model (`raytrain.load_model`) and
prints a greedy sample: after the default 100 steps (loss about 2.3) expect common letter
patterns ("the the"); a few thousand steps give word-like lines.

Reads top to bottom: cut the text into fixed-length windows with a sample id each, describe the model, the
per-sample loss and the optimizer as plain functions, fix the global batch and the LR, train, then sample.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import raytrain
from raytrain.config import (
    PP_SCHEDULES,
    STRATEGIES,
    BatchConfig,
    CheckpointConfig,
    ClusterConfig,
    LoopConfig,
    LRConfig,
    ParallelConfig,
)
from raytrain.trainer import ElasticTrainer, connect_ray

TEXT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "shakespeare_sonnets.txt")
CONTEXT = 64  # characters the model sees; every training window has exactly this length


# --- The data: fixed-length windows of the text, one sample each ----------------------------------------------
def char_windows(text: str, context: int, stride: int) -> tuple[dict[str, np.ndarray], list[str]]:
    """Cut `text` into windows: "x" = chars[i:i+T], "y" = chars[i+1:i+T+1] (int64 [n, T]), one "id" per window.

    Returns the columns and the vocabulary (sorted characters; a character's index is its token id).
    """
    vocab = sorted(set(text))
    tokens = np.array([vocab.index(c) for c in text], dtype=np.int64)
    starts = np.arange(0, len(tokens) - context - 1, stride)
    x = np.stack([tokens[s : s + context] for s in starts])
    y = np.stack([tokens[s + 1 : s + context + 1] for s in starts])
    # raytrain: a unique integer id per sample. The epoch order, the data position saved in each checkpoint and
    # the sample audit refer to windows by this id (here: the window's start offset in the text).
    return {"id": starts.astype(np.int64), "x": x, "y": y}, vocab


def to_ray_dataset(columns: dict[str, np.ndarray]) -> Any:
    """The columns as one Arrow table in a Ray dataset. The [n, T] token arrays use Ray's tensor extension type,
    so each worker gets them back as int64 [n, T] tensors (raytrain passes only numeric columns to loss_fn)."""
    import pyarrow as pa
    import ray.data
    from ray.data.extensions import ArrowTensorArray

    table = pa.table(
        {name: ArrowTensorArray.from_numpy(v) if v.ndim > 1 else pa.array(v) for name, v in columns.items()}
    )
    return ray.data.from_arrow(table)


# --- What every worker runs: model, per-sample loss, optimizer ---------------------------------------------
# Module-level definitions (and partials of them): Ray pickles them and ships them to every worker.
class CharTransformer(nn.Module):
    """A decoder-only transformer: token + position embeddings, causal self-attention blocks, a linear head."""

    def __init__(self, vocab_size: int, context: int, d_model: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(context, d_model)
        # Pre-norm blocks without dropout (tiny model, short run); batch_first: tensors are [n, T, d_model].
        block = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def pipeline_split(self) -> dict[str, Any]:
        """How raytrain cuts this model into pipeline stages (`ParallelConfig(pp=...)`): between the blocks of the
        encoder's layer list; the embeddings run before them (first stage), the norm and head after (last)."""
        return {"blocks": "blocks.layers", "first": ["token", "position"], "last": ["norm", "head"]}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [n, T, vocab] for tokens [n, T]; position t only attends to positions <= t."""
        length = tokens.shape[1]
        h = self.token(tokens) + self.position(torch.arange(length, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        h = self.blocks(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))


def per_window_cross_entropy(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """raytrain's loss contract: one loss per sample, shape [n]; here the mean next-character cross-entropy of
    each window. raytrain sums these over all workers' micro-batches and divides by the global batch, so each
    step averages over exactly `global_batch` windows whatever the world size."""
    logits = model(batch["x"])
    losses = F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten(), reduction="none")
    return losses.view(batch["y"].shape).mean(dim=1)


def adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW with the usual parameter groups: weight decay on the weight matrices only, none on embeddings, norms
    and biases. raytrain calls optimizer_fn(model, lr=...) because the first parameter is named `model` (with
    `params` it passes model.parameters()); `lr` is the peak LR from LRConfig. Every step raytrain multiplies each
    group's own LR by the schedule, so groups keep their ratios, also under zero1, which shards every group."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        is_matrix = param.ndim >= 2 and not name.startswith(("token.", "position."))
        (decay if is_matrix else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99))


@torch.no_grad()
def greedy_sample(model: nn.Module, vocab: list[str], prompt: str, length: int, context: int) -> str:
    """`prompt` followed by `length` characters, each the model's most likely next one."""
    tokens = [vocab.index(c) for c in prompt]
    for _ in range(length):
        logits = model(torch.tensor([tokens[-context:]]))
        tokens.append(int(logits[0, -1].argmax()))
    return "".join(vocab[t] for t in tokens)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="training workers, 1 CPU each (default 2)")
    parser.add_argument(
        "--min-workers", type=int, default=None, help="allow the run to shrink to this many workers (default: fixed)"
    )
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps in total (default 100)")
    parser.add_argument("--storage", default="raytrain_runs", help="runs go here")
    parser.add_argument("--run-name", default="char_lm", help="run directory under --storage; reusing it resumes")
    parser.add_argument("--strategy", default="ddp", choices=STRATEGIES, help="ddp or ZeRO stage (default ddp)")
    parser.add_argument("--global-batch", type=int, default=32, help="windows per optimizer step, all workers")
    parser.add_argument("--stride", type=int, default=16, help="characters between window starts")
    parser.add_argument("--sample", type=int, default=100, help="characters to sample at the end (0: none)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages, one worker each (default 1)")
    parser.add_argument("--pp-schedule", default="gpipe", choices=PP_SCHEDULES, help="pipeline schedule")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    args = parser.parse_args()

    import ray

    # Join RAY_ADDRESS's cluster (checked to answer within seconds), or start a local Ray instance of our own
    # (never the cluster another process started on this machine): each worker takes one CPU, two more are left
    # for Ray Data and the Ray Train controller. Ray's own output stays in its log files unless RAYTRAIN_VERBOSE=1.
    connect_ray(local_cpus=max(4, args.workers + 2))

    with open(TEXT_PATH, encoding="utf-8") as f:
        text = f.read()
    columns, vocab = char_windows(text, CONTEXT, args.stride)
    windows = len(columns["id"])
    print(f"{len(text)} characters, vocabulary {len(vocab)}, {windows} windows of {CONTEXT} (stride {args.stride})")
    # the vocabulary size and the depth travel inside the partial
    model_fn = partial(CharTransformer, len(vocab), CONTEXT, layers=args.layers)

    # The global batch is the one batch number: windows per optimizer step, summed over workers and
    # micro-steps. raytrain keeps it fixed when workers join or leave and re-splits it as world size x
    # micro-batches x accumulation steps; micro_batch only caps one worker's forward/backward (memory).
    batch = BatchConfig(global_batch=args.global_batch, micro_batch=16)
    # The LR is fitted to the global batch, never to the world size: 4e-3 is right at 32 windows per step
    # ("sqrt" rescales it if --global-batch changes), reached after 10 steps of linear warmup, then a cosine
    # decay to a tenth of it over the run's steps.
    lr = LRConfig(base_lr=4e-3, base_batch=32, rule="sqrt", warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    loop = LoopConfig(
        epochs=math.ceil(args.steps / math.ceil(windows / args.global_batch)),
        max_steps=args.steps,
        strategy=args.strategy,  # ddp; zero1 shards optimizer state; zero2 + gradients; zero3 + parameters
        seed=0,  # seeds the weights and the per-epoch window order, which is the same at any world size
        id_column="id",
        max_grad_norm=1.0,  # clips the gradient of the whole global batch (the same at any world size)
        log_every=10,
    )
    # A checkpoint every 20 steps (and at the end): Ray Train restarts the whole worker group on a failure or a
    # resize, and every worker resumes from the latest one. Saving is collective: every rank writes its DCP
    # shard and calls ray.train.report (also a barrier, so all ranks report equally often).
    checkpoint = CheckpointConfig(storage_path=args.storage, run_name=args.run_name, every_steps=20, keep=2)
    # min_workers < max_workers makes the run elastic: Ray Train starts with as many workers as fit and
    # restarts the group from the latest checkpoint whenever that number changes.
    cluster = ClusterConfig(min_workers=args.min_workers or args.workers, max_workers=args.workers, max_failures=3)

    trainer = ElasticTrainer(
        model_fn=model_fn,
        loss_fn=per_window_cross_entropy,
        optimizer_fn=adamw,
        datasets={"train": to_ray_dataset(columns)},
        batch=batch,
        lr=lr,
        loop=loop,
        checkpoint=checkpoint,
        cluster=cluster,
        required_columns=("x", "y"),  # checked on the driver before any worker starts
        # W workers = pp stages x W / pp data-parallel replicas; the global batch is split over the replicas
        parallel=ParallelConfig(pp=args.pp, pp_schedule=args.pp_schedule),
    )
    result = trainer.fit()  # blocks; survives worker failures and resizes up to max_failures

    # Only rank 0 writes metrics.jsonl, one line per optimizer step.
    metrics = read_jsonl(result.metrics_path)
    print(f"metrics:    {result.metrics_path}")
    print(f"checkpoint: {result.checkpoint.path if result.checkpoint else None}")
    if metrics:
        first, last = metrics[0], metrics[-1]
        print(
            f"steps {len(metrics)}: loss {first['loss']:.4f} at step {first['step']} -> {last['loss']:.4f} at step "
            f"{last['step']} (uniform guess: ln {len(vocab)} = {math.log(len(vocab)):.4f})"
        )
    if args.sample and result.checkpoint is not None:
        # raytrain: the trained model in this process, whatever strategy, layout and world size wrote it (the two
        # pipeline stages' tensors joined); `raytrain export` writes it as safetensors instead.
        model = raytrain.load_model(result.storage_uri, model_fn)
        print("greedy sample:\n" + greedy_sample(model, vocab, "Shall I compare thee", args.sample, CONTEXT))
    ray.shutdown()


if __name__ == "__main__":
    main()
