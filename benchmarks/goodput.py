"""python benchmarks/goodput.py [--quick] [--events kill|node] [--only bare,restart,live,live_hsdp]

Goodput: the share of the wall time that trains, when a training process is SIGKILLed every 50 steps (`--events
kill`, the default) or a node is lost every 50 steps (`--events node`). One model and data set, four ways to
recover, in one run:
    bare      a hand-written Ray Train loop, the usual recipe: `TorchTrainer` with `FailureConfig(max_failures)`,
              DDP, a `torch.save` checkpoint of model and optimizer on rank 0 reported every 10 steps, resume
              from `ray.train.get_checkpoint()`; Ray Train restarts the worker group after a kill
    restart   raytrain's `ElasticTrainer` with `ClusterConfig(recovery="restart")` (the default): Ray Train restarts
              the group, raytrain resumes from its newest checkpoint (DCP, written in the background)
    live      the same trainer with `recovery="live"`: torchft replica groups; the survivor finishes the step with
              the same global batch and goes on, a replacement heals from it and joins
    live_hsdp live mode with sharded replica groups (`ParallelConfig(dp_shard=2)`, zero3 in each group): two groups
              of two workers (W = 4 on the same 2 cores); a kill loses its group, the other finishes the step, a
              new group heals from it
Same for all: `raytrain.toy.block_mlp(64, 1024, 2)` (8.5 M parameters; AdamW's state makes a checkpoint
~100 MB), `raytrain.toy.regression_arrays` (64 features, 50 steps per epoch), global batch 1024 in micro-batches of
128, W = 2 CPU workers (gloo, one thread each: about 0.35 s of matrix multiplies per step at W = 2, no sleep), 200
steps, a checkpoint every 10 steps, one local Ray instance. The kills are the same event in every variant:
`raytrain.faults` (RAYTRAIN_FAULTS) makes rank 1, then 0, then 1 SIGKILL itself before the forward of steps 50, 100
and 150; the bare loop calls the same fault points (live_hsdp: data ranks 1, 0, 1 of 4, both in the first group).

`--events node`: the same, on a cluster of fake nodes (`raytrain.cli.demo.FakeCluster`: a head with 2 CPUs for the
driver and Ray Data, and W = 2 worker nodes, each with one worker's slot, or two for live_hsdp so that a node holds
one replica group). When rank 0 has recorded step 49, 99 and 149, the newest worker node is removed without
notice (its raylet and every process on it killed: a spot reclaim) and a replacement node is started at once, as a
warm pool or an autoscaler that already has one ready would (a cloud's start of a fresh VM, minutes, is not in
it). The node's death is detected with `raytrain.ray_hooks.FAST_NODE_DEATH`, which the fake cluster and
cluster.yaml both set (Ray's defaults take ~15-30 s); every other setting is the library's default
(`resize_monitor_interval_s` 5 s). Keys carry `goodput_node_` where the kill run's carry `goodput_`. Steps
trained again, raytrain restart: from the step each node was lost at back to the checkpoint the next group resumed
from; a second restart, should the group grow again when the replacement node arrives, is not counted there (its
time is in the goodput all the same).

From rank 0's record of each step (the time it finished: raytrain's metrics.jsonl, the bare loop's own file; a step
trained again after a restart is counted once, at the first time it finished):
    step s          the fault-free median step time: the median interval between steps 10 .. 40 (whole checkpoint
                    periods up to the last checkpoint before the first kill: the restart path's records after it
                    are written again after the restart)
    goodput         (n - 5) x step s / (t_n - t_5): the steps' worth of fault-free training in the wall time from
                    step 5 to the last step. Starts are excluded (`start_overhead_s` in overhead.py measures them);
                    every checkpoint, every kill's detection, restart, reload, steps trained again, and the slower
                    steps of a smaller world until the replacement joins are inside.
    fault-free      the same over steps 10 .. 40 (no kill yet): what the checkpoints alone cost
    kill cost s     the wall time beyond the fault-free pace (checkpoints included), per kill:
                    ((t_n - t_5) - (n - 5) x step s / fault-free) / kills
Keys: goodput_bare, goodput_restart, goodput_live, goodput_live_hsdp; goodput_fault_free_*, goodput_kill_cost_s_*,
goodput_live_over_restart, goodput_live_hsdp_over_restart (`--events node`: goodput_node_*,
goodput_node_cost_s_*). One repetition per run
(`run_all.py` runs it three times and reports min/median/max); the variants rotate their order per repetition.
Timings depend on the machine's load (its load average is printed).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from _common import first_rep, machine_line, median, print_headline, read_jsonl, start_ray, stop_ray, table

from raytrain.rank0 import METRICS_FILE

FEATURES, WIDTH, BLOCKS = 64, 1024, 2
GLOBAL_BATCH, MICRO_BATCH, WORKERS = 1024, 128, 2
EPOCH_STEPS, EVERY, SKIP, LR, SEED = 50, 10, 5, 1e-3, 0
VARIANTS = ("bare", "restart", "live", "live_hsdp")
HSDP_SHARD = 2  # live_hsdp: workers per replica group


def kill_plan(steps: int, every: int) -> str:
    """RAYTRAIN_FAULTS for a kill before the forward of every `every`-th step (not the last), ranks 1, 0, 1, ..."""
    return ",".join(f"{(i + 1) % 2}:{s}:forward" for i, s in enumerate(range(every, steps, every)))


# ---------------------------------------------------------------- bare Ray Train


def bare_train_func(config: dict[str, Any]) -> None:
    """The usual Ray Train loop for this model: DDP, each rank its contiguous half of the step's global batch (an
    epoch order drawn from (seed, epoch)), DDP `no_sync` on all but the last micro-batch, a checkpoint every
    `every` steps saved by rank 0 and reported by every rank; resumes from Ray Train's latest checkpoint. Rank 0
    appends {"step", "time"} to `marks` after each step. The kills: `raytrain.faults`' fault points, as in
    raytrain's loop."""
    import contextlib

    import numpy as np
    import ray.train
    import torch
    from ray.train import Checkpoint
    from torch import nn

    from raytrain import faults
    from raytrain.toy import adamw, block_mlp, regression_arrays

    torch.set_num_threads(1)
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(SEED)
    model = nn.parallel.DistributedDataParallel(block_mlp(FEATURES, WIDTH, BLOCKS))
    optimizer = adamw(model.parameters(), LR)
    step = 0
    latest = ray.train.get_checkpoint()
    if latest is not None:
        with latest.as_directory() as directory:
            state = torch.load(os.path.join(directory, "state.pt"), weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        step = int(state["step"])
    columns = regression_arrays(GLOBAL_BATCH * EPOCH_STEPS, FEATURES, SEED)
    x_all, y_all = torch.from_numpy(columns["x"]), torch.from_numpy(columns["y"])
    os.environ[faults.ENV] = config["faults"]
    faults.arm(config["run_dir"], rank, world)
    share = GLOBAL_BATCH // world
    orders: dict[int, np.ndarray] = {}
    while step < config["steps"]:
        faults.at_step(step + 1)
        epoch, position = divmod(step, EPOCH_STEPS)
        if epoch not in orders:
            orders = {epoch: np.random.default_rng((SEED, epoch)).permutation(len(y_all))}
        mine = orders[epoch][position * GLOBAL_BATCH + rank * share :][:share]
        optimizer.zero_grad()
        for start in range(0, share, MICRO_BATCH):
            rows = torch.from_numpy(mine[start : start + MICRO_BATCH])
            last = start + MICRO_BATCH >= share
            faults.fault_point("forward")
            with contextlib.nullcontext() if last else model.no_sync():
                loss = ((model(x_all[rows]) - y_all[rows]) ** 2).sum() * world / GLOBAL_BATCH
                loss.backward()
        optimizer.step()
        step += 1
        if rank == 0:
            with open(config["marks"], "a") as f:
                f.write(json.dumps({"step": step, "time": time.time()}) + "\n")
        if step % EVERY == 0 or step == config["steps"]:
            with tempfile.TemporaryDirectory() as directory:
                checkpoint = None
                if rank == 0:
                    state = {"model": model.module.state_dict(), "optim": optimizer.state_dict(), "step": step}
                    torch.save(state, os.path.join(directory, "state.pt"))
                    checkpoint = Checkpoint.from_directory(directory)
                ray.train.report({"step": step}, checkpoint=checkpoint)


# ---------------------------------------------------------------- the events


Fit = Callable[[], Any]


def kills_only(fit: Fit, run_dir: str) -> tuple[Any, list[Any]]:
    """`--events kill`: the run's own processes kill themselves (RAYTRAIN_FAULTS); just train."""
    return fit(), []


class NodeLoss:
    """`--events node`: a fresh fake-node cluster per variant; `__call__` trains in a thread while the main thread
    (Ray's `Cluster.add_node` must run there) follows rank 0's metrics.jsonl in `run_dir` and, at each event step,
    removes the newest worker node without notice and starts a replacement (`raytrain.cli.demo.EventDriver`)."""

    def __init__(self, steps: int, every: int, slots: int) -> None:
        from raytrain.cli.demo import WORKER_SLOT, Event, FakeCluster
        from raytrain.console import init_ray
        from raytrain.trainer import apply_ray_env_defaults

        apply_ray_env_defaults()
        self.cluster = FakeCluster(WORKERS, head_cpus=2, slots=slots)
        init_ray(address=self.cluster.address)
        self.resources = {"CPU": 1.0, WORKER_SLOT: 1.0}  # workers on the worker nodes, never on the head
        # once step s - 1 is recorded: the node goes during step s, the moment of the kill runs' SIGKILL (before
        # step s's forward), not right after a checkpoint
        self.events = [Event(kind, s - 1) for s in range(every, steps, every) for kind in ("remove", "add")]

    def __call__(self, fit: Fit, run_dir: str) -> tuple[Any, list[Any]]:
        from raytrain.cli.demo import EventDriver

        driver = EventDriver(list(self.events), run_dir, self.cluster)
        return driver.train(fit, timeout_s=3600, name="goodput-fit"), driver.applied

    def close(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()


def bare(
    storage: str, name: str, steps: int, kills: str, resources: dict[str, float], events: Callable[[Fit, str], Any]
) -> tuple[list[dict[str, Any]], int]:
    """One bare Ray Train run: rank 0's step records, and the steps trained again (each restart's steps since the
    checkpoint it resumed from, recorded again)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    run_dir = os.path.join(storage, name)
    os.makedirs(run_dir)
    marks = os.path.join(run_dir, METRICS_FILE)
    trainer = TorchTrainer(
        bare_train_func,
        train_loop_config={"marks": marks, "steps": steps, "faults": kills, "run_dir": run_dir},
        scaling_config=ScalingConfig(num_workers=WORKERS, resources_per_worker=resources),
        run_config=RunConfig(name=name, storage_path=storage, failure_config=FailureConfig(max_failures=10)),
    )
    events(trainer.fit, run_dir)
    records = read_jsonl(marks)
    return records, len(records) - len({r["step"] for r in records})


# ---------------------------------------------------------------- raytrain


def raytrain_run(
    storage: str,
    name: str,
    steps: int,
    kills: str,
    variant: str,
    resources: dict[str, float],
    events: Callable[[Fit, str], Any],
) -> tuple[list[dict[str, Any]], int]:
    """One ElasticTrainer run (`variant` "restart", "live" or "live_hsdp"): rank 0's metrics.jsonl (each step once),
    and the steps trained again (restart: from each kill's step back to the checkpoint the next group resumed from;
    live: the attempts the survivors redid after a kill, and a fallback's steps since its checkpoint, as the demo
    counts them)."""
    from raytrain.config import BatchConfig, CheckpointConfig, ClusterConfig, LoopConfig, LRConfig, ParallelConfig
    from raytrain.toy import adamw, block_mlp_factory, regression_dataset, squared_error
    from raytrain.trainer import ElasticTrainer

    recovery = "restart" if variant == "restart" else "live"
    shard = HSDP_SHARD if variant == "live_hsdp" else 1
    strategy = "zero3" if shard > 1 else "ddp"
    os.environ["RAYTRAIN_FAULTS"] = kills  # the workers get it with the job
    try:
        trainer = ElasticTrainer(
            model_fn=block_mlp_factory(FEATURES, WIDTH, BLOCKS),
            loss_fn=squared_error,
            optimizer_fn=adamw,
            datasets={"train": regression_dataset(GLOBAL_BATCH * EPOCH_STEPS, FEATURES, seed=SEED)},
            batch=BatchConfig(global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH),
            lr=LRConfig(base_lr=LR),
            loop=LoopConfig(
                epochs=None, max_steps=steps, seed=SEED, id_column="id", log_every=10**6, strategy=strategy
            ),
            checkpoint=CheckpointConfig(storage_path=storage, run_name=name, every_steps=EVERY, keep=2),
            cluster=ClusterConfig(
                min_workers=shard,
                max_workers=WORKERS * shard,
                resources_per_worker=resources,
                max_failures=10,
                recovery=recovery,
            ),
            parallel=ParallelConfig(dp_shard=shard),
            required_columns=("x", "y"),
        )
        result, applied = events(trainer.fit, trainer.spec.checkpoint.run_dir())
    finally:
        os.environ.pop("RAYTRAIN_FAULTS", None)
    metrics = read_jsonl(result.metrics_path)
    if recovery == "live":
        live = trainer.live_run.result
        redone = {step for outcome in live.outcomes for step in outcome.failed_steps}
        return metrics, len(redone) + sum(max(0, f["at_step"] - f["restored_step"]) for f in live.fallbacks)
    if applied:  # node loss: from the step a node was removed at back to the checkpoint the next group resumed from
        return metrics, sum(e.steps_lost or 0 for e in applied if e.kind == "remove")
    # a kill before step s's forward had finished s - 1 steps; the next group resumed at its checkpoint's step (the
    # old group's records since its last checkpoint died with it, so metrics.jsonl cannot show them)
    fired = read_jsonl(os.path.join(os.path.dirname(result.metrics_path), "faults_fired.jsonl"))
    retrained, pending = 0, list(fired)
    for start in read_jsonl(result.events_path)[1:]:  # a restart no kill caused (a resize) is not counted
        if pending and start["step"] < pending[0]["step"]:
            retrained += pending.pop(0)["step"] - 1 - start["step"]
    return metrics, retrained


# ---------------------------------------------------------------- the figures


def goodput(records: list[dict[str, Any]], steps: int, first_kill: int) -> dict[str, float]:
    """Pure: the figures of one run from rank 0's step records ({"step", "time"}, in the order written; a step
    written again after a restart counts at its first time). Raises `ValueError` if the run did not reach step
    `steps`."""
    finished: dict[int, float] = {}
    for record in records:
        finished.setdefault(int(record["step"]), float(record["time"]))
    if max(finished, default=0) < steps:
        raise ValueError(f"the run ended at step {max(finished, default=0)} of {steps}")
    # a step's time is when it was first finished; later steps were finished later (the loop is sequential)
    times = [finished[s] for s in range(1, steps + 1)]
    # whole checkpoint periods before the first kill (steps EVERY .. the last checkpoint before it): no kill yet,
    # each interval's share of checkpoints as in the whole run, and every record written by the first group (the
    # restart path writes rank 0's records with each checkpoint: those since the last one are written again, after
    # the restart, by the group that trains them again)
    before = times[EVERY - 1 : first_kill - EVERY]
    step_s = median([b - a for a, b in itertools.pairwise(before)])
    fault_free = (len(before) - 1) * step_s / (before[-1] - before[0])
    wall = times[-1] - times[SKIP - 1]
    trained = (steps - SKIP) * step_s
    return {
        "step_s": step_s,
        "wall_s": wall,
        "goodput": trained / wall,
        "fault_free": fault_free,
        "beyond_pace_s": wall - trained / fault_free,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 steps, one event at step 30 (a smoke run)")
    parser.add_argument(
        "--events", choices=("kill", "node"), default="kill", help="a worker SIGKILLed, or a node lost (and replaced)"
    )
    parser.add_argument("--only", default=",".join(VARIANTS), help="variants to run (default: all four)")
    parser.add_argument("--storage", default=None, help="where runs go (default: a temporary directory)")
    args = parser.parse_args()
    steps, every = (60, 30) if args.quick else (200, 50)
    variants = [v for v in VARIANTS if v in args.only.split(",")]
    unknown = set(args.only.split(",")) - set(VARIANTS)
    if unknown or not variants:
        parser.error(f"--only takes some of {', '.join(VARIANTS)}, got {args.only!r}")
    node_loss = args.events == "node"
    kills = "" if node_loss else kill_plan(steps, every)
    count = len(range(every, steps, every))
    prefix = "goodput_node_" if node_loss else "goodput_"
    shift = first_rep() % len(variants)
    order = variants[shift:] + variants[:shift]
    storage = args.storage or tempfile.mkdtemp(prefix="raytrain-goodput-")
    print(machine_line(), flush=True)
    if not node_loss:
        start_ray(num_cpus=WORKERS * HSDP_SHARD + 1)  # live_hsdp's 4 workers and Ray Data
    found: dict[str, dict[str, Any]] = {}
    for variant in order:
        shard = HSDP_SHARD if variant == "live_hsdp" else 1
        events: Callable[[Fit, str], Any] = kills_only
        resources = {"CPU": 1.0}
        if node_loss:
            events = NodeLoss(steps, every, slots=shard)  # a cluster of its own: a node holds one replica group
            resources = events.resources
        began = time.perf_counter()
        try:
            records, retrained = (
                bare(storage, variant, steps, kills, resources, events)
                if variant == "bare"
                else raytrain_run(storage, variant, steps, kills, variant, resources, events)
            )
        finally:
            if isinstance(events, NodeLoss):
                events.close()
        found[variant] = {
            **goodput(records, steps, every),
            "retrained": retrained,
            "run_s": time.perf_counter() - began,
        }
        print(f"  done {variant}: {found[variant]}", flush=True)
    print(machine_line())
    if not node_loss:
        stop_ray()
    what = (
        f"{count} node(s) lost at steps {', '.join(str(s) for s in range(every, steps, every))}, each replaced at once"
        if node_loss
        else f"{count} SIGKILL(s) ({kills})"
    )
    print(
        f"\nGoodput: block_mlp({FEATURES}, {WIDTH}, {BLOCKS}), W = {WORKERS}, global batch {GLOBAL_BATCH}, {steps} "
        f"steps, a checkpoint every {EVERY} steps, {what}"
    )
    print(
        table(
            [
                "variant",
                "step s",
                f"wall s (steps {SKIP}-{steps})",
                "goodput",
                f"fault-free (steps {EVERY}-{every - EVERY})",
                "cost per event s",
                "steps trained again",
            ],
            [
                [v, r["step_s"], r["wall_s"], r["goodput"], r["fault_free"], r["beyond_pace_s"] / count, r["retrained"]]
                for v, r in found.items()
            ],
        )
    )
    step_s = median([r["step_s"] for r in found.values()])
    print(
        f"an event every {every} steps = one every {every * step_s:.0f} s of training here (torchft reports 81 % at "
        "one failure a minute on its own setup)"
    )
    cost = "node_cost_s" if node_loss else "kill_cost_s"
    headline: dict[str, Any] = {f"{prefix}{v}": round(r["goodput"], 4) for v, r in found.items()}
    headline |= {f"{prefix}fault_free_{v}": round(r["fault_free"], 4) for v, r in found.items()}
    headline |= {f"goodput_{cost}_{v}": round(r["beyond_pace_s"] / count, 2) for v, r in found.items()}
    headline |= {f"{prefix}step_s_{v}": round(r["step_s"], 4) for v, r in found.items()}
    headline |= {f"{prefix}retrained_{v}": r["retrained"] for v, r in found.items()}
    headline["goodput_node_event_every_s" if node_loss else "goodput_kill_every_s"] = round(every * step_s, 1)
    for live in ("live", "live_hsdp"):
        if live in found and "restart" in found:
            ratio = found[live]["goodput"] / found["restart"]["goodput"]
            headline[f"{prefix}{live}_over_restart"] = round(ratio, 3)
    headline["settings"] = {
        "steps": steps,
        "events": what,
        **({} if node_loss else {"kills": kills}),
        "checkpoint_every_steps": EVERY,
        "workers": WORKERS,
        "live_hsdp": f"{WORKERS} replica groups of dp_shard={HSDP_SHARD} (zero3), W = {WORKERS * HSDP_SHARD}",
        **(
            {"node_death": "raytrain.ray_hooks.FAST_NODE_DEATH (as cluster.yaml)", "replacement": "started at once"}
            if node_loss
            else {}
        ),
    }
    print_headline(headline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
