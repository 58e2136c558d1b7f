"""python benchmarks/startup.py [--quick] [--reps 3]

The start-up a new user waits through with README's example (`examples/fit_mlp.toml`: an MLP, 3,200 training rows
and a 320-row validation set, both Ray datasets), each variant a fresh process that starts its own local Ray
instance, timed from the moment the process is launched:

- `dry_run_s`: `raytrain fit examples/fit_mlp.toml --dry-run` to its exit (every check, nothing trained; goal
  <= 10 s). `ray_start_s`: a process that starts and stops a local Ray instance as raytrain does
  (`connect_ray`) and exits: the floor any Ray program pays here, for scale.
- `fit_start_s`: `raytrain fit examples/fit_mlp.toml --workers 2 --steps 3` to its first step (the `time` of step
  1 in metrics.jsonl, written when the step ends). `bare_start_s`: a plain Ray Train script doing the same work
  by hand (`ray.init`, `TorchTrainer` with 2 workers, the example's model, loss and AdamW in DDP over the same
  training Ray dataset, `iter_torch_batches`) to the end of its first step, written by its rank 0.
  `fit_start_overhead_s` = the two's difference, per repetition (goal <= 3 s, as `start_overhead_s` in
  overhead.py, which times both in one warm Ray instance and without a validation set).

Repetitions alternate the order of raytrain and the bare script. Every figure is a median over `--reps` with its
min and max in the table printed; the headline (last line) holds the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import machine_line, median, print_headline, read_jsonl, table

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "fit_mlp.toml"

BARE = r"""
import os, sys, time
sys.path.insert(0, os.path.join(sys.argv[1], "examples"))
import ray, torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer, prepare_model
import fit_entry

def train_func(config):
    import ray.train
    model = prepare_model(fit_entry.model())
    optimizer = fit_entry.optimizer(model.parameters(), lr=2e-3)
    shard = ray.train.get_dataset_shard("train")
    for step, batch in enumerate(shard.iter_torch_batches(batch_size=32)):
        loss = fit_entry.loss(model, batch).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 0 and ray.train.get_context().get_world_rank() == 0:
            with open(config["mark"], "w") as f:
                f.write(repr(time.time()))
        if step == 2:
            break

examples = os.path.join(sys.argv[1], "examples")
ray.init(  # a local instance of its own (a bare ray.init() joins one found on the machine)
    address="local", num_cpus=3, include_dashboard=False, log_to_driver=False,
    runtime_env={"env_vars": {"PYTHONPATH": examples}},
)
TorchTrainer(
    train_func,
    train_loop_config={"mark": sys.argv[2]},
    datasets={"train": fit_entry.datasets()["train"]},
    scaling_config=ScalingConfig(num_workers=2),
    run_config=RunConfig(storage_path=sys.argv[3], name="bare"),
).fit()
"""

RAY_START = r"""
from raytrain.trainer import connect_ray
import ray
connect_ray(3, "a start-up benchmark", dashboard=False)
ray.shutdown()
"""


def clean_env() -> dict[str, str]:
    """This machine's environment without a Ray address: each process starts its own local instance."""
    return {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}


def timed(command: list[str], cwd: str) -> float:
    """Seconds from launching `command` to its exit; raises with its output's tail when it fails."""
    started = time.time()
    done = subprocess.run(command, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{command[:4]} exited {done.returncode}: {(done.stdout + done.stderr)[-2000:]}")
    return time.time() - started


def raytrain_first_step(storage: str, name: str) -> tuple[float, float]:
    """(seconds to the first step's end, seconds to the process's exit) of `raytrain fit` of the example."""
    command = [sys.executable, "-m", "raytrain.cli", "fit", str(EXAMPLE), "--workers", "2", "--steps", "3"]
    command += ["--storage", storage, "--run-name", name]
    started = time.time()
    ended = started + timed(command, str(REPO))
    first = read_jsonl(os.path.join(storage, name, "metrics.jsonl"))[0]
    assert first["step"] == 1, first
    return float(first["time"]) - started, ended - started


def bare_first_step(storage: str, rep: int) -> tuple[float, float]:
    """The same for the bare Ray Train script."""
    mark = os.path.join(storage, f"bare-first-step-{rep}")
    started = time.time()
    ended = started + timed([sys.executable, "-c", BARE, str(REPO), mark, storage], storage)
    return float(Path(mark).read_text()) - started, ended - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repetition (a smoke run)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each variant (default 3)")
    args = parser.parse_args()
    reps = 1 if args.quick else args.reps
    print(machine_line(), flush=True)
    runs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="raytrain-startup-") as storage:
        for rep in range(reps):
            record: dict[str, float] = {}
            record["ray_start_s"] = timed([sys.executable, "-c", RAY_START], storage)
            record["dry_run_s"] = timed(
                [sys.executable, "-m", "raytrain.cli", "fit", str(EXAMPLE), "--dry-run", "--storage", storage],
                str(REPO),
            )
            order = ["raytrain", "bare"] if rep % 2 == 0 else ["bare", "raytrain"]
            for variant in order:
                if variant == "raytrain":
                    record["fit_start_s"], record["fit_wall_s"] = raytrain_first_step(storage, f"fit-{rep}")
                else:
                    record["bare_start_s"], record["bare_wall_s"] = bare_first_step(storage, rep)
            record["fit_start_overhead_s"] = record["fit_start_s"] - record["bare_start_s"]
            for key, value in record.items():
                if not 0 < value < 600 and key != "fit_start_overhead_s":
                    raise SystemExit(f"{key} = {value:.3f} s in repetition {rep}: impossible, the timing is broken")
            runs.append(record)
            print(f"  repetition {rep}: " + json.dumps({k: round(v, 2) for k, v in record.items()}), flush=True)
    keys = list(runs[0])
    rows: list[list[Any]] = [
        [key, min(r[key] for r in runs), median([r[key] for r in runs]), max(r[key] for r in runs)] for key in keys
    ]
    print(table(["figure (s)", "min", "median", "max"], rows))
    print_headline({key: round(median([r[key] for r in runs]), 2) for key in keys} | {"reps": reps})


if __name__ == "__main__":
    main()
