"""Your own Ray Train loop, with raytrain's guarantees: a plain `TorchTrainer` script converted in a few lines.

    python examples/own_loop.py [--workers 2] [--steps 30] [--storage DIR] [--run-name own_loop]

The training function below is the one Ray Train's docs write (a model, AdamW, a map-style dataset, a loop over
epochs and batches), with raytrain's four changes marked `# raytrain`: `attach` fixes the global batch, the LR
rule and the data; `prepare` builds the model and optimizer for whatever world exists; `steps()` and
`micro_batches()` hand out this rank's exact share of each global batch; `backward` and `optimizer_step` do the
exact normalisation and the one gradient sync per step. docs/own_loop.md shows the diff against the plain script.

Run it again with the same --run-name and it resumes from the latest checkpoint, at any --workers: the global
batch, the LR and the sample order are those of the first run (an EMA of the weights, tracked below, resumes with
them). The run's files are in <storage>/<run-name>: metrics.jsonl, samples.jsonl (the sample ids of every step),
events.jsonl and the checkpoints.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import raytrain
from raytrain.config import BatchConfig, CheckpointConfig, LoopConfig, LRConfig

FEATURES = 8
ROWS = 600


class RegressionData(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A map-style dataset as users write them: item i is a dict of tensors."""

    def __init__(self, rows: int = ROWS, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
        w = rng.normal(size=FEATURES).astype(np.float32)
        self.y = (np.tanh(self.x @ w) + 0.1 * rng.normal(size=rows)).astype(np.float32)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.from_numpy(self.x[i]), "y": torch.tensor(self.y[i])}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(FEATURES, 32), nn.GELU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).squeeze(-1)


class EMA:
    """An exponential moving average of the weights: per-step code of the user's own, saved in every checkpoint."""

    def __init__(self, model: nn.Module, decay: float = 0.9) -> None:
        self.decay = decay
        self.shadow = {name: p.detach().clone() for name, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for name, p in model.named_parameters():
            self.shadow[name].mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.shadow)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            self.shadow[name].copy_(value)


def adamw(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def train_func(config: dict[str, Any]) -> None:
    run = raytrain.attach(  # raytrain: the global batch, the LR rule and the data, fixed whatever the world size
        batch=BatchConfig(global_batch=config["global_batch"], micro_batch=config["micro_batch"]),
        lr=LRConfig(base_lr=config["lr"], rule="sqrt", warmup_steps=5),
        data=config.get("data") or RegressionData(),  # or a Parquet path, or a ray.data.Dataset
        loop=LoopConfig(epochs=config["epochs"], max_steps=config["steps"], audit_samples=True, log_every=5),
        checkpoint=CheckpointConfig(every_steps=config["every"]),
    )
    model, optimizer = run.prepare(Net, adamw)  # raytrain: was `prepare_model(Net())` and `AdamW(...)`
    ema = EMA(run.module)  # keyed by the model's own names (`run.module`: the same at every world size)
    run.track("ema", ema)  # raytrain: saved in every checkpoint and restored with it
    for step in run.steps():  # raytrain: was `for epoch in range(...): for batch in loader:`
        for batch in step.micro_batches():
            loss = F.mse_loss(model(batch["x"]), batch["y"])
            step.backward(loss, reduction="mean")  # raytrain: was `loss.backward()`
        step.optimizer_step(optimizer)  # raytrain: was `optimizer.step()` (and `zero_grad()`)
        ema.update(run.module)
        run.report({"ema_norm": float(sum(v.norm() ** 2 for v in ema.shadow.values()) ** 0.5)})
        time.sleep(config.get("pause_s", 0.0))  # --pause-s: a stand-in for a bigger model's compute


def main(argv: list[str] | None = None) -> Any:
    """Run the example; returns Ray Train's `Result`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="Ray Train workers (default 2)")
    parser.add_argument("--max-workers", type=int, default=None, help="elastic: up to this many (default --workers)")
    parser.add_argument("--steps", type=int, default=30, help="train until this many optimizer steps (default 30)")
    parser.add_argument("--storage", default="raytrain_runs", help="where runs go (default ./raytrain_runs)")
    parser.add_argument("--run-name", default="own_loop", help="the run (the same name resumes it)")
    parser.add_argument("--pause-s", type=float, default=0.0, help="sleep after each step (a slower model)")
    args = parser.parse_args(argv)

    from ray.train import CheckpointConfig as RayCheckpointConfig
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raytrain.session import ray_callbacks
    from raytrain.trainer import connect_ray

    high = max(args.workers, args.max_workers or args.workers)
    # raytrain: a local instance of its own unless RAY_ADDRESS is set; quiet=False shows the workers' output here
    # (your prints and raytrain's lines from rank 0: progress, resizes, resumes), as a plain ray.init() would
    connect_ray(high + 1, "the workers and Ray Data", quiet=False)
    trainer = TorchTrainer(
        train_func,
        train_loop_config={
            "global_batch": 32,
            "micro_batch": 8,
            "lr": 3e-3,
            "epochs": 3,
            "steps": args.steps,
            "every": 10,
            "pause_s": args.pause_s,
        },
        scaling_config=ScalingConfig(num_workers=args.workers if high == args.workers else (args.workers, high)),
        run_config=RunConfig(
            name=args.run_name,
            storage_path=os.path.abspath(args.storage),
            checkpoint_config=RayCheckpointConfig(num_to_keep=2),
            # raytrain (optional): after a node loss, restart at the size left in seconds, not after Ray's 60 s
            callbacks=ray_callbacks(os.path.join(os.path.abspath(args.storage), args.run_name)),
        ),
    )
    result = trainer.fit()
    print(
        f"{args.run_name}: step {result.metrics['step']}, loss {result.metrics['loss']:.6f}, "
        f"files in {os.path.join(os.path.abspath(args.storage), args.run_name)}"
    )
    return result


if __name__ == "__main__":
    main()
