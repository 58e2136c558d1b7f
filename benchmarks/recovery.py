"""python benchmarks/recovery.py [--storage DIR]

Recovery after membership events on a local cluster of fake nodes (`raytrain demo`), beside Ray Train's bare
worker-group start and restart measured in the same run:

    event           seconds from the event to the first step finished by the next worker group,
                    and steps that had to be trained again (work lost since the last checkpoint)
    remove          a node with a worker is killed (no grace period), training must go on at W-1
    kill            one training worker process is SIGKILLed, the same size comes back
    add             a node is added, training must go on at W+1
    bare start      TorchTrainer.fit() -> train_func entered, trivial train_func
    bare restart    SIGKILL of a worker in a trivial train_func -> train_func entered again

Prints a table, then one JSON line with the headline figures. Ray settings: raytrain's defaults
(`raytrain.trainer.RAY_ENV_DEFAULTS`), resize monitor interval 1 s, checkpoint every 4 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

SCENARIOS = {
    "remove": ["--nodes", "3", "--workers", "2:3", "--events", "remove@10", "--steps", "40", "--sample-time", "0.01"],
    "kill": ["--nodes", "3", "--workers", "2:3", "--events", "kill@10", "--steps", "40", "--sample-time", "0.01"],
    "add": ["--nodes", "2", "--workers", "2:3", "--events", "add@6", "--steps", "150", "--sample-time", "0.02"],
}


def run_scenario(name: str, storage: str) -> dict[str, Any]:
    """One `raytrain demo --json` run; returns its single event record."""
    command = [
        sys.executable,
        "-m",
        "raytrain.cli",
        "demo",
        "--json",
        "--storage",
        storage,
        "--run-name",
        name,
        "--global-batch",
        "24",
        "--micro-batch",
        "4",
        "--checkpoint-every",
        "4",
        *SCENARIOS[name],
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: demo failed\n{done.stderr[-3000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    return {**summary["events"][0], "world_sizes": summary["world_sizes"]}


def _bare_train_func(config: dict[str, Any]) -> None:
    import ray.train

    marks = config["marks"]
    with open(marks, "a") as f:
        f.write(f"{time.time()} {os.getpid()}\n")
    if not os.path.exists(marks + ".kill") and ray.train.get_context().get_world_rank() == 0:
        time.sleep(1.0)  # let every rank enter first
        with open(marks + ".kill", "w") as f:
            f.write(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)


def bare_ray_train(storage: str) -> dict[str, float]:
    """Ray Train's own floor on the same kind of cluster: start, and restart after a SIGKILL."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raytrain.demo import WORKER_SLOT, FakeCluster
    from raytrain.trainer import apply_ray_env_defaults

    apply_ray_env_defaults()
    cluster = FakeCluster(3)
    ray.init(address=cluster.address)
    marks = os.path.join(storage, "bare_marks.txt")
    try:
        trainer = TorchTrainer(
            _bare_train_func,
            train_loop_config={"marks": marks},
            scaling_config=ScalingConfig(num_workers=3, resources_per_worker={"CPU": 1, WORKER_SLOT: 1}),
            run_config=RunConfig(name="bare", storage_path=storage, failure_config=FailureConfig(max_failures=3)),
        )
        started = time.time()
        trainer.fit()
    finally:
        ray.shutdown()
        cluster.shutdown()
    with open(marks) as f:
        entries = [float(line.split()[0]) for line in f]
    with open(marks + ".kill") as f:
        killed = float(f.read())
    first_attempt = entries[:3]
    second_attempt = [t for t in entries if t > killed]
    return {"start_s": max(first_attempt) - started, "restart_s": max(second_attempt) - killed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", default=None, help="where runs go (default: a temporary directory)")
    args = parser.parse_args()
    storage = args.storage or tempfile.mkdtemp(prefix="raytrain-recovery-")
    rows = {name: run_scenario(name, storage) for name in SCENARIOS}
    bare = bare_ray_train(storage)

    print(f"{'event':<14} {'world':>9} {'recovery s':>11} {'steps lost':>11}  detail")
    for name, row in rows.items():
        world = " -> ".join(str(w) for w in row["world_sizes"])
        recovery = f"{row['recovery_s']:.1f}" if row["recovery_s"] is not None else "n/a"
        print(f"{name:<14} {world:>9} {recovery:>11} {row['steps_lost']!s:>11}  {row['detail']}")
    print(f"{'bare start':<14} {'3':>9} {bare['start_s']:>11.1f} {'-':>11}  TorchTrainer.fit() -> train_func entered")
    print(f"{'bare restart':<14} {'3 -> 3':>9} {bare['restart_s']:>11.1f} {'-':>11}  SIGKILL -> train_func again")
    headline = {
        "node_loss_recovery_s": rows["remove"]["recovery_s"],
        "sigkill_recovery_s": rows["kill"]["recovery_s"],
        "node_add_recovery_s": rows["add"]["recovery_s"],
        "max_steps_lost": max(r["steps_lost"] or 0 for r in rows.values()),
        "bare_start_s": round(bare["start_s"], 2),
        "bare_restart_s": round(bare["restart_s"], 2),
    }
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
