"""python benchmarks/overhead.py [--quick] [--reps 3] [--no-streaming] [--only raytrain,matched]

Loop overhead: raytrain's ElasticTrainer against hand-written Ray Train `TorchTrainer` DDP loops, same model
(MLP 64 -> 512 -> 512 -> 1, 0.30 M parameters), data (raytrain.toy regression arrays, 64 features), seed,
optimizer (SGD, momentum 0.9), global batch (512 = 2 workers x 4 micro-batches x 64) and W = 2 CPU workers
(gloo), all under the same local Ray instance and Ray environment (`raytrain.trainer.RAY_ENV_DEFAULTS`).

The headline, `overhead_ratio`, compares like with like: raytrain's default (deterministic=True) against the
*matched* hand-written loop, which does by hand what raytrain does: the training set in every worker's memory, an
epoch order drawn from (seed, epoch), the heap frozen out of Python's full collections, each rank's contiguous slice
of the step's global batch cut into k micro-batches, DDP `no_sync` on all but the last micro-step (one gradient sync
per step), the summed loss times W / B, one loss all-reduce per step, a metrics line on rank 0, and every `every`
steps a checkpoint saved the way raytrain saves it: DCP `async_save` from every rank on a gloo group of its own (the
shard is copied to host memory, the files are written in a background thread while training goes on),
`ray.train.report` once the files are written (after the next step), and Ray's commit waited for in a background
thread (joined before the next checkpoint). Both loops therefore save in the background; the difference is
raytrain's own cost: its batch plan, step source, LR setting, RNG seeding and bookkeeping.

Two more measurements locate that cost (not in `--quick`, except the second, shortened): the comparison again at a
step of real size (the "-large" variants: hidden `LARGE_HIDDEN`, ~145 ms per step here; `overhead_ratio_large_step`
with its A/A control), and raytrain's per-step work without Ray (`step_costs`: one process, W = 1 gloo, the small
model, the matched step against raytrain's `Step` with and without each of its pieces, alternated in blocks):
`step_cost_us` and the share of the gradient norm, the micro-batch seeds and the step source's hand-over.

The design differences are separate rows against the *naive* loop, the usual Ray Train recipe:
`prepare_model` (DDP), `get_dataset_shard("train")` + `iter_torch_batches` with a per-epoch `local_shuffle_seed`,
loss / k, `backward()` on every micro-batch (it all-reduces k times per step), and a rank-0-only `torch.save`
checkpoint reported without waiting for the commit. "naive + no_sync" is the same loop with DDP `no_sync` on all
but the last micro-step, so the table separates what one sync per step is worth (naive + no_sync ÷ naive) from
what the in-memory data path is worth (matched ÷ naive + no_sync). raytrain's streaming mode (deterministic=False,
through `get_dataset_shard` like the naive loop) is compared with the naive loop too.

Measured: each loop writes a timestamp when an optimizer step finishes (raytrain: the "time" field of
metrics.jsonl on rank 0; the hand-written loops: their own file on rank 0). Steady state starts after `skip`
steps (start-up and warm-up excluded); every interval after it counts, checkpoints and the epoch change included.
Per run:
    steps/s (all)          (n - 1) / (t_last - t_first) over the window: every interval
    steps/s (median)       1 / median interval: the per-step cost alone
    ckpt s                 the window's time beyond n x the median interval (less the epoch change's), per
                           checkpoint: what a checkpoint costs wherever its work lands (a background save slows
                           the steps after it, not the step that starts it)
    epoch s                extra time of the interval that crosses into the second epoch
    to entry s             fit() -> rank 0 enters the training function (driver checks, Ray Train's controller
                           and worker group); entry to step s: from there to the first step finished
The matched loop runs twice per repetition (the second, "control", is the same code): `control_ratio` (its
steps/s over the first's) and `start_control_s` (its start-up less the first's) show how far two runs of identical
code differ on this machine, the floor below which raytrain's own overhead cannot be told from noise.
Before the timed runs, raytrain and the matched loop run once each, untimed (`warm_up`): the first Train run in a
fresh Ray instance is slower to start whichever loop it is. Runs alternate (the variants in rotating order); the
table gives each run and the median over repetitions; ratio = steps/s / steps/s of the medians. The headline
`overhead_ratio` is the all-inclusive steady-state ratio for raytrain's default mode; the others are printed beside
it. Timings depend on what else the machine runs (its load average is printed).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, NamedTuple

import torch
from _common import (
    first_rep,
    machine_line,
    median,
    median_interval_rate,
    print_headline,
    read_jsonl,
    start_ray,
    steady_rate,
    stop_ray,
    table,
)
from torch import nn

FEATURES, HIDDEN = 64, 512
WORKERS, MICRO_BATCH, ACCUMULATION = 2, 64, 4
GLOBAL_BATCH = WORKERS * MICRO_BATCH * ACCUMULATION
LR, SEED, SHUFFLE_BUFFER = 0.01, 0, 1024


# The same comparison at a step of real size (the "-large" variants): hidden 2048 (4.3 M parameters), a step of
# ~145 ms here, 60 steps per epoch (120 steps, a checkpoint every 30).
LARGE_HIDDEN, LARGE_STEPS_PER_EPOCH = 2048, 60


class Size(NamedTuple):
    """A comparison's model and run length: the MLP's hidden width, the training set's rows, the steps run."""

    hidden: int
    rows: int
    max_steps: int


def build_model(hidden: int = HIDDEN) -> nn.Module:
    """MLP 64 -> hidden -> hidden -> 1 (296,449 parameters at the default 512; 4,329,473 at 2048)."""
    return nn.Sequential(
        nn.Linear(FEATURES, hidden),
        nn.Tanh(),
        nn.Linear(hidden, hidden),
        nn.Tanh(),
        nn.Linear(hidden, 1),
        nn.Flatten(0),
    )


def sgd(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


# ---------------------------------------------------------------- the matched hand-written loop


def micro_slices(mine: Any, k: int, micro: int) -> list[Any]:
    """This rank's rows of a step (`mine`, positions into the training set) cut into its `k` micro-batches."""
    return [mine[j * micro : (j + 1) * micro] for j in range(k)]


def matched_micro_steps(
    model: nn.parallel.DistributedDataParallel, x_all: Any, y_all: Any, mine: Any, k: int, micro: int, scale: float
) -> float:
    """The matched loop's micro-steps of one optimizer step (the Ray loop's and `step_costs`' matched step are this):
    each micro-batch of `mine` one forward and backward of the summed squared error times `scale` (W / B), DDP's
    gradient sync on the last only (`no_sync` before). Returns the micro-batches' loss sum."""
    local = 0.0
    for j, picked in enumerate(micro_slices(mine, k, micro)):
        x, y = torch.from_numpy(x_all[picked]), torch.from_numpy(y_all[picked])
        with model.no_sync() if j < k - 1 else contextlib.nullcontext():
            losses = (model(x) - y) ** 2
            (losses.sum() * scale).backward()
        local += float(losses.detach().sum())
    return local


def matched_train_func(config: dict[str, Any]) -> None:
    """What raytrain's deterministic loop does, written by hand for this one model and W (see the module doc)."""
    import gc
    import threading

    import numpy as np
    import ray.train
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from ray.train import Checkpoint, CheckpointConsistencyMode
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    entered = time.time()  # the training function runs (the start-up split: Ray's part, the loop's part)
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    k, micro, every, max_steps = config["k"], config["micro_batch"], config["every"], config["max_steps"]
    batch = world * k * micro
    torch.manual_seed(config["seed"])
    model = nn.parallel.DistributedDataParallel(build_model(config["hidden"]))
    optimizer = sgd(model.parameters(), lr=config["lr"])
    columns = ray.get(config["data_ref"])  # every worker holds the training set, as raytrain's default does
    x_all, y_all = columns["x"], columns["y"]
    rows = len(y_all)
    save_group = dist.new_group(backend="gloo")  # the background save's collectives stay off the training group
    pending: tuple[str, dict[str, Any], Any] | None = None  # (directory, metrics, the background write)
    committing: list[threading.Thread] = []

    def report_pending() -> None:
        """Once this rank's files are written: report the checkpoint; wait for Ray's commit in a thread."""
        nonlocal pending
        if pending is None:
            return
        directory, reported, write = pending
        pending = None
        write.result()
        ray.train.report(
            reported, checkpoint=Checkpoint.from_directory(directory), delete_local_checkpoint_after_upload=True
        )
        thread = threading.Thread(
            target=ray.train.get_all_reported_checkpoints,
            kwargs={"consistency_mode": CheckpointConsistencyMode.COMMITTED},
            daemon=True,
        )
        thread.start()
        committing.append(thread)

    times = open(config["times_path"], "a") if rank == 0 else None  # noqa: SIM115  # closed below
    gc.collect(1)  # as raytrain's loop does (`raytrain.worker_loop.settle_heap`): what lives for the whole run is
    gc.freeze()  # kept out of Python's full collections, which otherwise stall a rank mid-step now and then
    step = 0
    for epoch in range(config["epochs"]):
        order = np.random.default_rng([config["seed"], epoch]).permutation(rows)
        for start in range(0, rows - batch + 1, batch):
            started = time.perf_counter()
            mine = order[start + rank * k * micro : start + (rank + 1) * k * micro]
            optimizer.zero_grad(set_to_none=True)
            local = matched_micro_steps(model, x_all, y_all, mine, k, micro, world / batch)
            optimizer.step()
            total = torch.tensor([local], dtype=torch.float64)
            dist.all_reduce(total)
            step += 1
            metrics = {"step": step, "epoch": epoch, "loss": float(total) / batch, "time": time.time()}
            if step == 1:
                metrics["entered"] = entered
            metrics["step_time_s"] = time.perf_counter() - started
            if times is not None:
                times.write(json.dumps(metrics) + "\n")
                times.flush()
            report_pending()  # the checkpoint started after the previous step
            if step % every == 0 or step == max_steps:
                for thread in committing:  # the previous checkpoint is committed before this one is written
                    thread.join()
                committing.clear()
                directory = tempfile.mkdtemp(prefix="matched-ckpt-")
                state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
                pending = (directory, metrics, dcp.async_save(state, checkpoint_id=directory, process_group=save_group))
            if step >= max_steps:
                break
        if step >= max_steps:
            break
    report_pending()
    for thread in committing:
        thread.join()
    if times is not None:
        times.close()


def run_matched(
    storage: str, name: str, rows: int, epochs: int, max_steps: int, every: int, hidden: int = HIDDEN
) -> dict[str, Any]:
    import ray

    from raytrain.toy import regression_arrays

    arrays = regression_arrays(rows, FEATURES, seed=SEED)
    data = {"data_ref": ray.put({"x": arrays["x"], "y": arrays["y"]}), "hidden": hidden}
    return _run_hand_written(matched_train_func, storage, name, epochs, max_steps, every, data, datasets=None)


# ---------------------------------------------------------------- the naive Ray Train loop


def plain_train_func(config: dict[str, Any]) -> None:
    """The naive Ray Train DDP loop: streaming data, a sync on every micro-batch (or, with config["no_sync"], on
    the last micro-batch of a step only), a rank-0 checkpoint."""
    import contextlib

    import ray.train
    import ray.train.torch
    from ray.train import Checkpoint

    context = ray.train.get_context()
    rank = context.get_world_rank()
    k, every, max_steps = config["k"], config["every"], config["max_steps"]
    torch.manual_seed(config["seed"])
    model = ray.train.torch.prepare_model(build_model())
    optimizer = sgd(model.parameters(), lr=config["lr"])
    shard = ray.train.get_dataset_shard("train")
    times = open(config["times_path"], "a") if rank == 0 else None  # noqa: SIM115  # closed below
    step, loss_sum = 0, 0.0
    for epoch in range(config["epochs"]):
        batches = shard.iter_torch_batches(
            batch_size=config["micro_batch"],
            local_shuffle_buffer_size=config["shuffle_buffer"],
            local_shuffle_seed=config["seed"] + epoch,  # a new order every epoch, like DistributedSampler.set_epoch
            drop_last=True,
        )
        micro, fetch, fetch_started = 0, 0.0, time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for batch in batches:
            fetch += time.perf_counter() - fetch_started
            skip_sync = config["no_sync"] and micro < k - 1
            with model.no_sync() if skip_sync else contextlib.nullcontext():
                loss = ((model(batch["x"]) - batch["y"]) ** 2).mean() / k
                loss.backward()  # all-reduces unless inside no_sync
            loss_sum += loss.item()
            micro += 1
            if micro == k:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step, micro = step + 1, 0
                metrics = {"step": step, "epoch": epoch, "loss": loss_sum, "time": time.time(), "fetch_s": fetch}
                loss_sum, fetch = 0.0, 0.0
                if times is not None:
                    times.write(json.dumps(metrics) + "\n")
                    times.flush()
                if step % every == 0 or step == max_steps:
                    if rank == 0:
                        with tempfile.TemporaryDirectory() as directory:
                            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
                            torch.save({**state, "step": step}, os.path.join(directory, "checkpoint.pt"))
                            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))
                    else:
                        ray.train.report(metrics)
                if step >= max_steps:
                    break
            fetch_started = time.perf_counter()
        if step >= max_steps:
            break
    if times is not None:
        times.close()


def run_plain(
    storage: str, name: str, rows: int, epochs: int, max_steps: int, every: int, no_sync: bool
) -> dict[str, Any]:
    from raytrain.toy import regression_dataset

    datasets = {"train": regression_dataset(rows, FEATURES, seed=SEED)}
    extra = {"shuffle_buffer": SHUFFLE_BUFFER, "no_sync": no_sync}
    return _run_hand_written(plain_train_func, storage, name, epochs, max_steps, every, extra, datasets)


def _run_hand_written(
    train_func: Any,
    storage: str,
    name: str,
    epochs: int,
    max_steps: int,
    every: int,
    extra: dict[str, Any],
    datasets: dict[str, Any] | None,
) -> dict[str, Any]:
    """One hand-written loop under Ray Train's `TorchTrainer`, W = 2, with the shared settings; its timestamps."""
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    times_path = os.path.join(storage, f"{name}-times.jsonl")
    config = {
        "k": ACCUMULATION,
        "micro_batch": MICRO_BATCH,
        "every": every,
        "max_steps": max_steps,
        "epochs": epochs,
        "seed": SEED,
        "lr": LR,
        "times_path": times_path,
        **extra,
    }
    trainer = TorchTrainer(
        train_func,
        train_loop_config=config,
        datasets=datasets,
        scaling_config=ScalingConfig(num_workers=WORKERS),
        run_config=RunConfig(
            name=name,
            storage_path=storage,
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            worker_runtime_env={"env_vars": _ray_env()},
        ),
    )
    started = time.time()
    trainer.fit()
    return {"records": read_jsonl(times_path), "started": started, "ended": time.time()}


def _ray_env() -> dict[str, str]:
    from raytrain.trainer import RAY_ENV_DEFAULTS

    return {k: os.environ[k] for k in RAY_ENV_DEFAULTS}


# ---------------------------------------------------------------- raytrain


def run_raytrain(
    storage: str,
    name: str,
    rows: int,
    epochs: int,
    max_steps: int,
    every: int,
    deterministic: bool,
    hidden: int = HIDDEN,
) -> dict[str, Any]:
    from raytrain.config import BatchConfig, CheckpointConfig, ClusterConfig, LoopConfig, LRConfig
    from raytrain.toy import regression_dataset, squared_error
    from raytrain.trainer import ElasticTrainer

    trainer = ElasticTrainer(
        model_fn=functools.partial(build_model, hidden),
        loss_fn=squared_error,
        optimizer_fn=sgd,
        datasets={"train": regression_dataset(rows, FEATURES, seed=SEED)},
        batch=BatchConfig(global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH),
        lr=LRConfig(base_lr=LR),
        loop=LoopConfig(
            epochs=epochs,
            max_steps=max_steps,
            strategy="ddp",
            seed=SEED,
            deterministic=deterministic,
            id_column="id",
            shuffle_buffer=SHUFFLE_BUFFER,
            log_every=10**6,
        ),
        checkpoint=CheckpointConfig(storage_path=storage, run_name=name, every_steps=every, keep=2),
        cluster=ClusterConfig(min_workers=WORKERS, max_workers=WORKERS, max_failures=0),
        required_columns=("x", "y"),
    )
    started = time.time()
    result = trainer.fit()
    records = read_jsonl(result.metrics_path)
    if records:  # rank 0 entered the training function: the first start's line of events.jsonl
        records[0]["entered"] = read_jsonl(result.events_path)[0]["entered"]
    return {"records": records, "started": started, "ended": time.time()}


# ---------------------------------------------------------------- analysis


def summarise(run: dict[str, Any], skip: int, every: int) -> dict[str, float]:
    """One run's figures (see the module doc) from its per-step timestamps."""
    records = run["records"]
    times = [r["time"] for r in records]
    steps = [r["step"] for r in records]
    epochs = [r["epoch"] for r in records]
    window = list(range(skip, len(times)))
    intervals = {steps[i]: times[i] - times[i - 1] for i in window[1:]}  # interval ending at step steps[i]
    typical = median(list(intervals.values()))
    epoch_change = {steps[i]: times[i] - times[i - 1] for i in window[1:] if epochs[i] != epochs[i - 1]}
    epoch_extra = sum(d - typical for d in epoch_change.values())
    checkpoints = [s for s in steps[skip:-1] if s % every == 0]  # started inside the window, before its end
    extra = sum(intervals.values()) - len(intervals) * typical - epoch_extra
    inside = {r["step"]: r.get("step_time_s") for r in records}
    ordinary = [s for s in intervals if s not in epoch_change and not any(0 < s - c <= 2 for c in checkpoints)]
    if all(inside.get(s) is not None for s in intervals):  # raytrain, matched: interval minus its step time
        waits = [intervals[s] - inside[s] for s in ordinary]
    else:  # naive loops: time spent in next() on the Ray Data iterator
        waits = [r["fetch_s"] for r in records if r["step"] in ordinary]
    return {
        "steps": len(records),
        "startup_s": times[0] - run["started"] if times else float("nan"),
        # the start-up split at the training function's entry on rank 0 (the naive loops do not record it)
        "to_entry_s": records[0].get("entered", float("nan")) - run["started"] if records else float("nan"),
        "entry_to_step_s": times[0] - records[0].get("entered", float("nan")) if records else float("nan"),
        "rate_all": steady_rate(times, skip),
        "rate_median": median_interval_rate(times, skip),
        "ckpt_s": extra / len(checkpoints) if checkpoints else float("nan"),
        "epoch_s": epoch_extra if epoch_change else float("nan"),
        "wait_ms": 1000 * median(waits),
        "step_ms": 1000 * typical,
        "wall_s": run["ended"] - run["started"],
    }


def warm_up(storage: str, skip: int) -> None:
    """One short untimed run of raytrain and of the matched loop before any timed one. The first Train run in a
    fresh Ray instance starts slower whichever loop it is (cold worker processes, imports, file caches): measured
    here, 5.1 s more to the training function for whichever variant the rotation put first, which made one
    repetition's `start_overhead_s` 5.9 s while the others' were below 1 s."""
    steps = skip + 4
    rows = steps * GLOBAL_BATCH
    for name, run in (
        ("warm-up-matched", lambda: run_matched(storage, "warm-up-matched", rows, 1, steps, 10**6)),
        ("warm-up-raytrain", lambda: run_raytrain(storage, "warm-up-raytrain", rows, 1, steps, 10**6, True)),
    ):
        started = time.perf_counter()
        run()
        print(f"  {name} (untimed): {time.perf_counter() - started:.1f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one short repetition of each loop (a smoke run)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each loop (default 3)")
    parser.add_argument("--no-streaming", action="store_true", help="skip raytrain's deterministic=False variant")
    parser.add_argument(
        "--only",
        default=None,
        help="loops to run, of raytrain,matched,matched-control,plain,plain-no-sync (default all)",
    )
    args = parser.parse_args()
    if args.quick:
        reps, steps_per_epoch, every, skip = 1, 12, 8, 4
    else:
        reps, steps_per_epoch, every, skip = args.reps, 200, 30, 10
    variants = ["raytrain", "matched", "matched-control", "plain", "plain-no-sync"]
    if not (args.quick or args.no_streaming):
        variants.append("raytrain-streaming")
    if not args.quick:  # the same comparison at a step of real size (LARGE_HIDDEN)
        variants += ["raytrain-large", "matched-large", "matched-large-control"]
    if args.only:
        unknown = set(args.only.split(",")) - set(variants)
        if unknown:
            parser.error(f"--only takes some of {','.join(variants)}, got {sorted(unknown)}")
        variants = [v for v in variants if v in args.only.split(",")]
    epochs = 2
    rows = steps_per_epoch * GLOBAL_BATCH
    max_steps = epochs * steps_per_epoch
    small = Size(HIDDEN, rows, max_steps)
    large = Size(LARGE_HIDDEN, LARGE_STEPS_PER_EPOCH * GLOBAL_BATCH, epochs * LARGE_STEPS_PER_EPOCH)
    wall = time.perf_counter()
    costs: dict[str, Any] = {}
    if {"raytrain", "matched"} <= set(variants):  # raytrain's step against the matched one, piece by piece
        costs = step_costs(blocks=3 if args.quick else 21, steps=10 if args.quick else 50)
    start_ray()
    print(machine_line())
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    order: list[str] = []
    with tempfile.TemporaryDirectory(prefix="raytrain-bench-") as storage:
        if not args.quick:
            warm_up(storage, skip)
        for rep in range(reps):
            turn = (first_rep() + rep) % len(variants)
            rotated = variants[turn:] + variants[:turn]
            for variant in rotated:
                name = f"{variant}-{rep}"
                size = large if "-large" in variant else small
                if variant.startswith("plain"):
                    run = run_plain(storage, name, rows, epochs, max_steps, every, no_sync=variant != "plain")
                elif variant.startswith("matched"):
                    run = run_matched(storage, name, size.rows, epochs, size.max_steps, every, hidden=size.hidden)
                else:
                    deterministic = variant != "raytrain-streaming"
                    run = run_raytrain(
                        storage, name, size.rows, epochs, size.max_steps, every, deterministic, hidden=size.hidden
                    )
                results[variant].append(summarise(run, skip, every))
                order.append(name)
                print(f"  done {name}: {results[variant][-1]['rate_all']:.2f} steps/s", flush=True)
        print(machine_line())
    stop_ray()

    print(
        f"\nLoop overhead, W = {WORKERS} CPU workers (gloo), MLP {FEATURES}-{HIDDEN}-{HIDDEN}-1, global batch "
        f"{GLOBAL_BATCH} = {WORKERS} x {ACCUMULATION} x {MICRO_BATCH}, {max_steps} steps over {epochs} epochs, "
        f"checkpoint every {every} steps, steady state after step {skip}; run order {', '.join(order)}"
    )
    labels = {
        "raytrain": "raytrain (deterministic=True, default)",
        "raytrain-streaming": "raytrain (deterministic=False)",
        "matched": "matched hand-written loop (same design)",
        "matched-control": "the matched loop again (control)",
        "plain": "naive Ray Train DDP loop",
        "plain-no-sync": "naive loop + no_sync (1 sync per step)",
        "raytrain-large": f"raytrain, hidden {LARGE_HIDDEN}",
        "matched-large": f"matched loop, hidden {LARGE_HIDDEN}",
        "matched-large-control": f"matched loop again, hidden {LARGE_HIDDEN}",
    }
    keys = [
        "rate_all",
        "rate_median",
        "step_ms",
        "wait_ms",
        "ckpt_s",
        "epoch_s",
        "startup_s",
        "to_entry_s",
        "entry_to_step_s",
        "wall_s",
    ]
    headers = [
        "loop",
        "run",
        "steps/s (all)",
        "steps/s (median)",
        "median step ms",
        "wait ms",
        "ckpt s",
        "epoch s",
        "start-up s",
        "to entry s",
        "entry to step s",
        "run wall s",
    ]
    rows_out: list[list[Any]] = []
    medians: dict[str, dict[str, float]] = {}
    for variant in variants:
        for i, summary in enumerate(results[variant]):
            rows_out.append([labels[variant], i, *(summary[k] for k in keys)])
        medians[variant] = {k: median([s[k] for s in results[variant]]) for k in keys}
        rows_out.append([labels[variant], "median", *(medians[variant][k] for k in keys)])
    print(table(headers, rows_out))

    compared = [(what, v, b, pair) for what, v, b, *pair in COMPARISONS if {v, b} <= medians.keys()]  # both ran
    ratio_rows = [[what, *(_ratio(medians, v, b, figure) for figure in RATE_FIGURES)] for what, v, b, _ in compared]
    print("\nratio = steps/s / steps/s of the medians over repetitions; goal for raytrain / matched: >= 0.97")
    print(table(["comparison", "ratio (all intervals)", "ratio (median step)"], ratio_rows))
    print(
        "note: 'wait ms' is the median time per step outside the training computation (steps within two of a "
        "checkpoint and the epoch change left out): for raytrain and the matched loop the interval between two "
        "metrics timestamps minus the step's step_time_s (fetching the step's data, logging); for the naive loops "
        "the time spent in next() of their Ray Data iterator (k fetches per step).\n"
        "note: raytrain and the matched loop both save DCP shards from every rank in the background (async_save "
        "on a gloo group of its own), report once the files are written and wait for Ray's commit in a thread; "
        "the naive loops save on rank 0 only (torch.save, blocking) and do not wait for the commit. 'ckpt s' is "
        "the time beyond the median step per checkpoint over the whole window; 'epoch s' the extra time of the "
        "step that starts the second epoch."
    )
    if costs:
        print(
            f"\nraytrain's per-step work without Ray (one process, W = 1 gloo, the model above; "
            f"{costs.pop('blocks')} alternated blocks of steps, medians): the matched step "
            f"{costs['matched_step_us']:.0f} us; raytrain's step {costs['step_cost_us']:+.0f} us, of which the "
            f"gradient norm {costs['step_cost_norm_us']:.0f} us, the micro-batch seeds "
            f"{costs['step_cost_seeds_us']:.0f} us, the step source's hand-over {costs['step_cost_data_us']:.0f} us"
        )
    print(f"wall time {time.perf_counter() - wall:.1f} s")
    headline: dict[str, Any] = dict(costs)
    for _, v, b, pair in compared:  # the headline's ratio keys, in the table's order
        headline |= {key: round(_ratio(medians, v, b, f), 3) for key, f in zip(pair, RATE_FIGURES, strict=True) if key}
    differences = {  # key -> (variant, baseline, figure), seconds, each where both ran
        "start_control_s": ("matched-control", "matched", "startup_s"),
        # fit() called -> first optimizer step finished on rank 0, raytrain less the matched Ray Train loop (same
        # model, data and workers): what raytrain's checks, data index and start add (issue 29: <= 3 s)
        "start_overhead_s": ("raytrain", "matched", "startup_s"),
        # the same split at rank 0's entry into the training function: fit() -> entry (driver checks, Ray Train's
        # controller and worker group), entry -> first step finished (the worker's own start)
        "start_overhead_to_entry_s": ("raytrain", "matched", "to_entry_s"),
        "start_overhead_in_worker_s": ("raytrain", "matched", "entry_to_step_s"),
    }
    headline |= {
        k: round(medians[v][f] - medians[b][f], 2) for k, (v, b, f) in differences.items() if {v, b} <= medians.keys()
    }
    names = {"raytrain": "raytrain", "matched": "matched", "plain": "naive", "plain-no-sync": "naive_no_sync"}
    headline |= {f"{names[v]}_steps_per_s": round(medians[v]["rate_all"], 3) for v in names if v in medians}
    headline |= {f"{v}_checkpoint_s": round(medians[v]["ckpt_s"], 3) for v in ("raytrain", "matched") if v in medians}
    headline |= {f"{v}_startup_s": round(medians[v]["startup_s"], 2) for v in ("raytrain", "matched") if v in medians}
    if "matched-large" in medians:
        headline["large_step_ms"] = round(medians["matched-large"]["step_ms"], 1)
    headline["checkpoint"] = (
        "both save in the background (DCP async_save, report when written, commit waited in a thread)"
    )
    headline["reps"] = reps
    print_headline(headline)


RATE_FIGURES = ("rate_all", "rate_median")  # steps/s over all intervals; per median step
# (what, variant, baseline, headline key of the all-intervals ratio, of the median-step ratio or None): the printed
# comparison table and the headline's ratios, each where both loops ran
COMPARISONS: list[tuple[str, str, str, str, str | None]] = [
    (
        "raytrain (default) / matched loop: raytrain's own overhead",
        "raytrain",
        "matched",
        "overhead_ratio",
        "overhead_ratio_median_step",
    ),
    # the same loop twice (A/A): how far two runs of identical code differ on this machine
    (
        "matched loop again / matched loop: the noise floor",
        "matched-control",
        "matched",
        "control_ratio",
        "control_ratio_median_step",
    ),
    ("matched loop / naive loop: the whole design", "matched", "plain", "design_ratio_matched_vs_naive", None),
    ("naive + no_sync / naive: one sync per step", "plain-no-sync", "plain", "no_sync_ratio_naive", None),
    (
        "matched / naive + no_sync: in-memory data, DCP",
        "matched",
        "plain-no-sync",
        "data_path_ratio_matched_vs_naive_no_sync",
        None,
    ),
    (
        f"raytrain / matched loop, hidden {LARGE_HIDDEN} (a step of real size)",
        "raytrain-large",
        "matched-large",
        "overhead_ratio_large_step",
        "overhead_ratio_large_step_median_step",
    ),
    (
        f"matched loop again / matched loop, hidden {LARGE_HIDDEN}: the noise floor",
        "matched-large-control",
        "matched-large",
        "control_ratio_large_step",
        None,
    ),
    ("raytrain (default) / naive loop", "raytrain", "plain", "ratio_vs_naive_loop", None),
    ("raytrain (streaming) / naive loop", "raytrain-streaming", "plain", "streaming_ratio_vs_naive_loop", None),
]


def _ratio(medians: dict[str, dict[str, float]], variant: str, baseline: str, figure: str) -> float:
    """`variant`'s median `figure` (steps/s) over `baseline`'s."""
    return medians[variant][figure] / medians[baseline][figure]


# ---------------------------------------------------------------- raytrain's per-step work, without Ray


def step_costs(blocks: int, steps: int) -> dict[str, Any]:
    """What raytrain's step does beyond the matched loop's, in microseconds per step, measured in a fresh process
    (`--step-costs`: one torch thread, a W = 1 gloo group, no Ray, so nothing else shares the process): the
    matched step (`matched_step_us`) and raytrain's (`step_cost_us` more), and what leaving out one piece of
    raytrain's step saves: the global gradient norm (`step_cost_norm_us`: the non-finite check, clipping and the
    grad_norm metric read every gradient once more), the micro-batch seeds (`step_cost_seeds_us`: dropout masks
    the same at every W) and the step source's hand-over of the micro-batches (`step_cost_data_us`)."""
    command = [sys.executable, __file__, "--step-costs", f"{blocks},{steps}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _step_costs_here(blocks: int, steps: int) -> dict[str, Any]:
    """`step_costs`' measurement, in this process: the variants alternate in blocks of `steps` steps (the order
    reversed every other block), the first block of each left out; each figure is the median block's time per step,
    a piece's cost the full step's median less the median without it."""
    import gc

    import numpy as np
    import torch.distributed as dist

    import raytrain.step as step_module
    from raytrain.batch_plan import plan_batch
    from raytrain.data.materialized import ColumnData, IndexedSteps
    from raytrain.rng import MicroBatchSeeds
    from raytrain.toy import regression_arrays, squared_error

    torch.set_num_threads(1)
    with tempfile.NamedTemporaryFile(prefix="raytrain-bench-pg-") as rendezvous:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous.name}", rank=0, world_size=1)
    batch = MICRO_BATCH * ACCUMULATION  # one rank's share of the global batch
    arrays = regression_arrays(200 * batch, FEATURES, seed=SEED)
    x_all, y_all, rows = arrays["x"], arrays["y"], len(arrays["y"])
    columns = ColumnData({"id": arrays["id"], "x": x_all, "y": y_all}, arrays["id"])
    source = IndexedSteps(
        columns, seed=SEED, plan=plan_batch(batch, MICRO_BATCH, 1), rank=0, device=torch.device("cpu"), drop_last=True
    )
    order = np.random.default_rng([SEED, 0]).permutation(rows)
    torch.manual_seed(SEED)
    # wrapped as raytrain wraps it (gradients as views of the buckets, zeroed in place by raytrain's step)
    model = nn.parallel.DistributedDataParallel(build_model(), gradient_as_bucket_view=True)
    optimizer = sgd(model.parameters(), LR)
    at = [0]

    def position() -> int:
        at[0] = (at[0] + batch) % (rows - batch)
        return at[0]

    def matched() -> None:
        mine = order[position() :][:batch]
        optimizer.zero_grad(set_to_none=True)
        local = matched_micro_steps(model, x_all, y_all, mine, ACCUMULATION, MICRO_BATCH, 1 / batch)
        optimizer.step()
        total = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(total)
        json.dumps({"step": 1, "loss": float(total) / batch, "time": time.time()})

    def raytrain(norm: bool = True, seeds: bool = True, source_data: bool = True) -> None:
        start = position()
        if source_data:
            data = source.next_step(0, start)
            assert data is not None
            micro_batches = data.micro_batches
        else:
            slices = micro_slices(order[start:][:batch], ACCUMULATION, MICRO_BATCH)  # the matched loop's indexing
            micro_batches = [{"x": torch.from_numpy(x_all[p]), "y": torch.from_numpy(y_all[p])} for p in slices]
        sizes = [MICRO_BATCH] * ACCUMULATION
        seeding = MicroBatchSeeds(SEED, at[0], 0, sizes, 0, torch.device("cpu")) if seeds else None
        real_norm = step_module.global_grad_norm
        if not norm:  # the one piece without a switch of its own: the step's norm replaced for this step only
            step_module.global_grad_norm = lambda parameters: torch.zeros(())
        try:
            step = step_module.Step(model, optimizer, micro_batches, 1, batch, seeds=seeding)
            result = step.train(squared_error)
        finally:
            step_module.global_grad_norm = real_norm
        json.dumps({"step": 1, "loss": result.loss_sum / batch, "grad_norm": result.grad_norm, "time": time.time()})

    variants: dict[str, Any] = {
        "matched": matched,
        "raytrain": raytrain,
        "no_norm": functools.partial(raytrain, norm=False),
        "no_seeds": functools.partial(raytrain, seeds=False),
        "no_source": functools.partial(raytrain, source_data=False),
    }
    gc.collect(1)
    gc.freeze()  # as both loops do
    per_step: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for block in range(blocks + 1):
        for name in names if block % 2 == 0 else names[::-1]:
            started = time.perf_counter()
            for _ in range(steps):
                variants[name]()
            if block:
                per_step[name].append((time.perf_counter() - started) / steps * 1e6)
    dist.destroy_process_group()
    us = {name: median(times) for name, times in per_step.items()}
    return {
        "matched_step_us": round(us["matched"], 1),
        "step_cost_us": round(us["raytrain"] - us["matched"], 1),
        "step_cost_norm_us": round(us["raytrain"] - us["no_norm"], 1),
        "step_cost_seeds_us": round(us["raytrain"] - us["no_seeds"], 1),
        "step_cost_data_us": round(us["raytrain"] - us["no_source"], 1),
        "blocks": blocks,
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["--step-costs"]:
        blocks_, steps_ = (int(n) for n in sys.argv[2].split(","))
        print(json.dumps(_step_costs_here(blocks_, steps_)))
    else:
        main()
