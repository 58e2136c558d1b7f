"""python benchmarks/input_pipeline.py [--quick] [--reps 2] [--only parquet,parquet-x4]

Input pipeline: how long raytrain's loop waits for data, how much of the data set a worker holds, samples/s
against a hand-written Ray Data loop, and what the data position costs in a checkpoint.

Data: a Parquet set the script writes (64 float32 features as Ray's tensor type, an int64 id, a float32 target;
8 files, row groups of 256 rows). Model: MLP 64 -> 512 -> 512 -> 1, DDP on CPU workers (gloo), global batch 512
(W x accumulation x micro-batch), two epochs, no checkpoint before the end. Runs, alternated per repetition:
    parquet W=2, W=3   the default path: `ParquetSource` read in place, windows of 2 row groups (512 rows, the
                       data set is 80 windows), prefetched in a background thread;
    materialized W=2   a `ray.data.Dataset` in deterministic mode: loaded whole into every worker;
    streaming W=2      deterministic=False: `get_dataset_shard` + raytrain's per-step agreement;
    hand-written W=2   the baseline: a plain `TorchTrainer` loop over `get_dataset_shard("train")
                       .iter_torch_batches(prefetch_batches=4)` with the same model, accumulation and DDP no_sync;
    parquet, materialized W=2 on a data set 4x as large (`... x4`), for the same number of steps: what a
                       worker's memory does when the data set grows.
    materialized again W=2  the materialized run once more, same code (A/A): `materialized_control_ratio`, its
                       samples/s over the first's, is how far two runs of identical code differ on this machine,
                       the noise floor of `parquet_over_materialized`.

Measured on rank 0 from metrics.jsonl, in the steady state (after the first `skip` steps, without the first step
of each epoch):
    data_wait_fraction = sum(data_wait_s) / sum(interval between consecutive steps)    (rank 0's wait)
    data_wait_fraction_max_rank = the same with the slowest rank's wait (data_wait_max_s: agreed about once a
                                  second, each the slowest rank's wait in all since the previous agreement)
where data_wait_s is the loop's real wall time inside `source.next_step` (reading, waiting for a prefetch,
gathering rows, agreeing the step); samples/s = samples of the steady steps / their wall time (the hand-written
loop records its own step times the same way);
    parquet_over_materialized = samples/s of the Parquet path / the materialized path's, same run.
Memory, measured for real on **every rank**: the loss function of each run is wrapped by a probe that records,
every 10 micro-batches, the worker process's peak RSS (`getrusage`) and pyarrow's allocated bytes; per run the
largest rank's peaks are kept. A worker's memory for data is the growth of its peak RSS when the data set is 4x
as large (same model, steps and batch): `worker_rss_growth_bytes_parquet` (bounded: the windows it holds do not
grow) against `worker_rss_growth_bytes_materialized` (every worker holds the whole set). `data_held_bytes` (the
numpy bytes of rank 0's windows, raytrain's own bookkeeping) is printed beside them, no longer as a headline.
Where the CPU goes (2 workers on a 2-core machine have no core to spare): the same probe samples the process's CPU
seconds and the training thread's (`time.process_time`, `time.thread_time`), so each raytrain run reports the cores a
rank kept busy and how many of them its training thread (mean over ranks; the hand-written loop samples rank 0 every
step); the Parquet path's metrics also carry `data_cpu_s`, rank 0's two data threads' CPU seconds, and
`data_cpu_fraction` = their CPU per steady step / the step interval: the share of a core the reading and assembling
take, which on a machine without a spare core is taken from the compute.
Data position in a checkpoint: `position_checkpoint_bytes` is the size of the position files of the Parquet run's
real final checkpoint (the train state and the consumed-id ranges); and halfway through an epoch of 1e7 samples,
the bytes and time of what each mode writes for it (the position modes: the train state's JSON; streaming: the
consumed-id set as ranges, for the ids a real Ray Data streaming split consumed and for ids in random order, each
beside the id array written before), written for real to a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from _common import first_rep, machine_line, median, print_headline, read_jsonl, start_ray, stop_ray, table
from torch import nn

FEATURES, HIDDEN = 64, 512
MICRO_BATCH, ACCUMULATION = 64, 4
GLOBAL_BATCH = 512
FILES, ROW_GROUP, WINDOW = 8, 256, 2
PARTITIONS = 32  # ParquetSource's default
ROW_BYTES = FEATURES * 4 + 4 + 8  # x, y and the id as numpy arrays
SKIP_CPU = 3  # the hand-written loop's CPU samples (one per step) left out as its start-up


def build_model() -> nn.Module:
    """MLP 64 -> 512 -> 512 -> 1 (296,449 parameters)."""
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, 1),
        nn.Flatten(0),
    )


def sgd(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def write_parquet(directory: str, rows: int) -> None:
    """`rows` samples in FILES Parquet files of ROW_GROUP-row row groups: "id" int64, "x" float32 [FEATURES]
    (Ray's tensor type), "y" float32."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from ray.data.extensions import ArrowTensorArray

    from raytrain.toy import regression_arrays

    arrays = regression_arrays(rows, FEATURES, seed=0)
    os.makedirs(directory, exist_ok=True)
    for part, index in enumerate(np.array_split(np.arange(rows), FILES)):
        table_ = pa.table(
            {
                "id": pa.array(arrays["id"][index]),
                "x": ArrowTensorArray.from_numpy(arrays["x"][index]),
                "y": pa.array(arrays["y"][index]),
            }
        )
        pq.write_table(table_, os.path.join(directory, f"part-{part:02d}.parquet"), row_group_size=ROW_GROUP)


class MemoryProbe:
    """The loss function, and every `every` calls a line {pid, peak RSS bytes, pyarrow allocated bytes, wall time,
    the process's CPU seconds, the training thread's CPU seconds} appended to `<directory>/memory-<pid>.jsonl`: the
    worker's real memory and where its CPU goes, on every rank. Not in the driver, which calls the loss once on
    real rows before any worker starts (its process is not a rank's)."""

    def __init__(self, directory: str, every: int = 10) -> None:
        self.directory, self.every, self.calls, self.driver = directory, every, 0, os.getpid()

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.calls += 1
        if self.calls % self.every == 1 and os.getpid() != self.driver:
            import resource

            import pyarrow as pa

            peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
            record = {"pid": os.getpid(), "peak_rss": peak_rss, "arrow": pa.total_allocated_bytes(), **cpu_now()}
            with open(os.path.join(self.directory, f"memory-{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
        return (model(batch["x"]) - batch["y"]) ** 2


def cpu_now() -> dict[str, float]:
    """Now: wall time, this process's CPU seconds (every thread) and the calling thread's."""
    return {"time": time.time(), "cpu": time.process_time(), "train_cpu": time.thread_time()}


def cores_used(samples: list[dict[str, float]]) -> tuple[float, float]:
    """(process, calling thread) CPU seconds per wall second between the first and the last of one process's
    `cpu_now()` samples: how many cores it kept busy, and how many of them its training thread."""
    if len(samples) < 2 or samples[-1]["time"] <= samples[0]["time"]:
        return float("nan"), float("nan")
    wall = samples[-1]["time"] - samples[0]["time"]
    return (
        (samples[-1]["cpu"] - samples[0]["cpu"]) / wall,
        (samples[-1]["train_cpu"] - samples[0]["train_cpu"]) / wall,
    )


def memory_peaks(directory: str) -> dict[str, float]:
    """The largest rank's peak RSS and pyarrow bytes recorded by `MemoryProbe` in `directory`, and the cores a
    rank kept busy (mean over ranks; from its second sample on, past the start-up)."""
    records = [r for name in os.listdir(directory) for r in read_jsonl(os.path.join(directory, name))]
    if not records:
        return {"peak_rss": float("nan"), "arrow": float("nan"), "ranks": 0}
    by_pid: dict[int, list[dict[str, float]]] = {}
    for r in records:
        by_pid.setdefault(r["pid"], []).append(r)
    cores = [cores_used(samples[1:]) for samples in by_pid.values() if len(samples) > 2]
    return {
        "peak_rss": max(r["peak_rss"] for r in records),
        "arrow": max(r["arrow"] for r in records),
        "ranks": len(by_pid),
        "cpu_cores": float(np.mean([c[0] for c in cores])) if cores else float("nan"),
        "train_cpu_cores": float(np.mean([c[1] for c in cores])) if cores else float("nan"),
    }


def position_bytes(checkpoint_dir: str | None) -> float:
    """Bytes of the data position in a real checkpoint: the train state file and the consumed-id ranges."""
    from raytrain.checkpoint import CONSUMED_FILE
    from raytrain.checkpoint_files import STATE_FILE

    if checkpoint_dir is None:
        return float("nan")
    names = [n for n in (STATE_FILE, CONSUMED_FILE) if os.path.exists(os.path.join(checkpoint_dir, n))]
    return float(sum(os.path.getsize(os.path.join(checkpoint_dir, n)) for n in names)) if names else float("nan")


def run_raytrain(
    storage: str, data_dir: str, name: str, mode: str, workers: int, epochs: int, max_steps: int | None = None
) -> dict[str, Any]:
    """One raytrain run; returns rank 0's metrics records, the run's start/end times, every rank's memory peaks
    and the position bytes of its final checkpoint."""
    import ray.data

    from raytrain.config import BatchConfig, CheckpointConfig, ClusterConfig, LoopConfig, LRConfig
    from raytrain.data.parquet import ParquetSource
    from raytrain.trainer import ElasticTrainer

    train: Any = (
        ParquetSource(data_dir, shuffle_window=WINDOW) if mode == "parquet" else ray.data.read_parquet(data_dir)
    )
    probe_dir = os.path.join(storage, f"{name}-memory")
    os.makedirs(probe_dir)
    trainer = ElasticTrainer(
        model_fn=build_model,
        loss_fn=MemoryProbe(probe_dir),
        optimizer_fn=sgd,
        datasets={"train": train},
        batch=BatchConfig(global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH),
        lr=LRConfig(base_lr=0.01),
        loop=LoopConfig(
            epochs=epochs,
            max_steps=max_steps,
            strategy="ddp",
            deterministic=mode != "streaming",
            id_column="id",
            log_every=10**6,
        ),
        checkpoint=CheckpointConfig(storage_path=storage, run_name=name, every_steps=10**6, keep=1),
        cluster=ClusterConfig(min_workers=workers, max_workers=workers, max_failures=0),
        required_columns=("x", "y"),
    )
    started = time.time()
    result = trainer.fit()
    ended = time.time()
    checkpoint = result.checkpoint.path if result.checkpoint is not None else None
    return {
        "records": read_jsonl(result.metrics_path),
        "started": started,
        "ended": ended,
        "memory": memory_peaks(probe_dir),
        "position_bytes": position_bytes(checkpoint),
    }


def hand_written_loop(config: dict[str, Any]) -> None:
    """The baseline: what a user writes with Ray Data and DDP by hand (no exactness, no bookkeeping)."""
    import ray.train
    import ray.train.torch

    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(build_model())
    optimizer = sgd(model.parameters(), lr=0.01)
    shard = ray.train.get_dataset_shard("train")
    world = ray.train.get_context().get_world_size()
    per_rank = GLOBAL_BATCH // world
    times: list[float] = []
    cpu: list[dict[str, float]] = []
    for _ in range(config["epochs"]):
        for batch in shard.iter_torch_batches(batch_size=per_rank, prefetch_batches=4, drop_last=True):
            optimizer.zero_grad(set_to_none=True)
            micro = torch.tensor_split(torch.arange(len(batch["y"])), ACCUMULATION)
            for j, index in enumerate(micro):
                context = model.no_sync() if j < len(micro) - 1 else torch.enable_grad()
                with context:
                    loss = ((model(batch["x"][index]) - batch["y"][index]) ** 2).sum() * world / GLOBAL_BATCH
                    loss.backward()
            optimizer.step()
            times.append(time.time())
            cpu.append(cpu_now())
    if ray.train.get_context().get_world_rank() == 0:
        with open(config["out"], "w") as f:
            json.dump({"times": times, "cpu": cpu}, f)


def run_hand_written(storage: str, data_dir: str, workers: int, epochs: int) -> dict[str, Any]:
    """The baseline run; returns records shaped like raytrain's (time, samples) for the same summary."""
    import ray.data
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = os.path.join(storage, f"hand-written-{time.time_ns()}.json")
    started = time.time()
    TorchTrainer(
        hand_written_loop,
        train_loop_config={"epochs": epochs, "out": out},
        datasets={"train": ray.data.read_parquet(data_dir)},
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(storage_path=storage, name=f"hand-{time.time_ns()}"),
    ).fit()
    with open(out) as f:
        found = json.load(f)
    times = found["times"]
    steps_per_epoch = len(times) // epochs
    records = [
        {"step": i + 1, "epoch": i // steps_per_epoch, "time": t, "global_batch_size": GLOBAL_BATCH}
        for i, t in enumerate(times)
    ]
    process, thread = cores_used(found["cpu"][SKIP_CPU:])  # rank 0, past the start-up like the probe's
    memory = {"cpu_cores": process, "train_cpu_cores": thread}
    return {"records": records, "started": started, "ended": time.time(), "memory": memory}


def summarise(run_: dict[str, Any], skip: int, data_bytes: int) -> dict[str, float]:
    """Steady-state data wait fraction, samples/s and peak data bytes held (see the module docstring)."""
    records = run_["records"]
    wait = wait_max = total = samples = data_cpu = 0.0
    for prev, cur in zip(records[skip:], records[skip + 1 :], strict=False):
        if cur["epoch"] != prev["epoch"]:
            continue
        interval = cur["time"] - prev["time"]
        total += interval
        wait += cur.get("data_wait_s", float("nan"))
        # the slowest rank's wait in all since the previous agreement, on the lines of the steps that agree
        # (about once a second: raytrain.agreement); the hand-written loop's lines carry none (nan)
        wait_max += cur.get("data_wait_max_s", 0.0 if "data_wait_s" in cur else float("nan"))
        data_cpu += cur.get("data_cpu_s", float("nan")) - prev.get("data_cpu_s", float("nan"))  # rank 0's threads
        samples += cur["global_batch_size"]
    held = [r["data_held_bytes"] for r in records if "data_held_bytes" in r]
    memory = run_.get("memory", {})
    return {
        "peak_rss_mb": memory.get("peak_rss", float("nan")) / 1e6,
        "arrow_mb": memory.get("arrow", float("nan")) / 1e6,
        "ranks_probed": memory.get("ranks", 0),
        "cpu_cores": memory.get("cpu_cores", float("nan")),
        "train_cpu_cores": memory.get("train_cpu_cores", float("nan")),
        "data_cpu_fraction": data_cpu / total if total else float("nan"),
        "position_bytes": run_.get("position_bytes", float("nan")),
        "steps": len(records),
        "wait_fraction": wait / total if total else float("nan"),
        "wait_fraction_max_rank": wait_max / total if total else float("nan"),
        "samples_per_s": samples / total if total else float("nan"),
        "data_bytes_fraction": max(held) / data_bytes if held else float("nan"),
        "startup_s": records[0]["time"] - run_["started"] if records else float("nan"),
        "wall_s": run_["ended"] - run_["started"],
    }


def streaming_consumed_ids(samples: int, workers: int, shuffle_buffer: int, read_batch: int) -> list[np.ndarray]:
    """The ids streaming mode has consumed halfway through an epoch of `samples` rows, per rank, from a real Ray
    Data pipeline read as `raytrain.data.streaming` reads it: `ray.data.range(samples)` split with
    `streaming_split(equal=False)`, each of `workers` consumers iterating its split in batches of `read_batch` with
    a local shuffle buffer of `shuffle_buffer` rows, until half the rows are consumed."""
    import threading

    import ray.data

    splits = ray.data.range(samples).streaming_split(workers, equal=False)
    taken: list[list[np.ndarray]] = [[] for _ in range(workers)]
    quota = samples // 2 // workers

    def consume(rank: int) -> None:
        count = 0
        for batch in splits[rank].iter_batches(
            batch_size=read_batch,
            batch_format="numpy",
            local_shuffle_buffer_size=shuffle_buffer,
            local_shuffle_seed=rank,
        ):
            if count < quota:
                taken[rank].append(batch["id"][: quota - count].astype(np.int64))
                count += len(taken[rank][-1])
            # read on to the end: a split's epoch completes only when every consumer finishes it

    threads = [threading.Thread(target=consume, args=(r,)) for r in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [np.concatenate(parts) for parts in taken]


def position_checkpoint_cost(samples: int) -> dict[str, float]:
    """Bytes and seconds of writing the data position halfway through an epoch of `samples` samples. The position
    modes write the train state (a few numbers as JSON). Streaming mode writes the set of consumed ids as ranges
    (`raytrain.data.id_ranges`), merged at each checkpoint with the last interval's ids: measured on the ids a real
    Ray Data streaming split consumed (2 workers, raytrain's default shuffle buffer), then on ids in no order
    at all (a random half: the worst case), each against the sorted id array raytrain wrote before."""
    from raytrain.checkpoint import TrainState
    from raytrain.config import LoopConfig
    from raytrain.data.id_ranges import IdRanges

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as directory:
        state = TrainState(step=samples // GLOBAL_BATCH, epoch=0, sample_in_epoch=samples, samples_seen=samples)
        began = time.perf_counter()
        path = os.path.join(directory, "state.json")
        with open(path, "w") as f:
            json.dump(asdict(state), f)
        out["position_s"], out["position_bytes"] = time.perf_counter() - began, os.path.getsize(path)
        began = time.perf_counter()
        per_rank = streaming_consumed_ids(samples, 2, LoopConfig().shuffle_buffer, 64)
        out["streaming_read_s"] = time.perf_counter() - began
        layout = np.concatenate(per_rank)
        random_half = np.random.default_rng(0).permutation(samples)[: samples // 2].astype(np.int64)
        interval = 20 * GLOBAL_BATCH  # the ids of one checkpoint interval (20 steps), merged into the rest
        for name, ids in (("streaming", layout), ("streaming_random", random_half)):
            before = IdRanges.from_ids(ids[:-interval])
            began = time.perf_counter()
            merged = before.union(ids[-interval:])
            path = os.path.join(directory, f"{name}.npy")
            np.save(path, merged.ranges)
            out[f"{name}_s"], out[f"{name}_bytes"] = time.perf_counter() - began, os.path.getsize(path)
            out[f"{name}_ranges"] = len(merged.ranges)
            out[f"{name}_ids"] = len(merged)
            np.save(path, np.sort(ids))  # what raytrain wrote before ranges: every id
            out[f"{name}_array_bytes"] = os.path.getsize(path)
    return out


def _rchar() -> int:
    """Bytes this process has passed through read() calls so far (`/proc/self/io`: every byte read from a
    file, from the page cache or the disk alike, as object storage would serve them)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def read_one_epoch(data_dir: str, world: int, rank: int, partitions: int, window: int) -> dict[str, float]:
    """(In its own process, as a worker is.) Rank `rank` of `world` through one epoch of raytrain's Parquet step
    source (`ParquetSteps`, all columns, global batch GLOBAL_BATCH): the bytes it read and the samples it got."""
    from raytrain.batch_plan import plan_batch
    from raytrain.data.parquet import ParquetSource, ParquetSteps

    index = ParquetSource(data_dir, shuffle_window=window, partitions=partitions).index(("x", "y"), "id", GLOBAL_BATCH)
    plan = plan_batch(GLOBAL_BATCH, MICRO_BATCH, world)
    source = ParquetSteps(index, seed=0, plan=plan, rank=rank, device=torch.device("cpu"), drop_last=False, epochs=1)
    index.head(1)  # the modules a read imports are read before the count starts (tens of MB of Ray's)
    began, start = _rchar(), time.perf_counter()
    position, samples = 0, 0
    while (step := source.next_step(0, position)) is not None:
        samples += len(step.ids)
        position += GLOBAL_BATCH
    seconds = time.perf_counter() - start
    read = _rchar() - began
    source.close()
    return {"bytes": float(read), "samples": float(samples), "seconds": seconds}


def read_amplification(data_dir: str, world: int, partitions: int, window: int) -> dict[str, float]:
    """W processes, one per rank, run through one epoch at once (`read_one_epoch`); returns the bytes they read
    together / the data set's bytes on disk (`amplification`), the largest rank's bytes / the mean (`imbalance`)
    and the slowest rank's seconds."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    on_disk = sum(os.path.getsize(os.path.join(data_dir, n)) for n in os.listdir(data_dir) if n.endswith(".parquet"))
    with ProcessPoolExecutor(world, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(read_one_epoch, data_dir, world, r, partitions, window) for r in range(world)]
        ranks = [f.result() for f in futures]
    read = [r["bytes"] for r in ranks]
    return {
        "amplification": sum(read) / on_disk,
        "imbalance": max(read) / (sum(read) / world),
        "seconds": max(r["seconds"] for r in ranks),
        "samples": sum(r["samples"] for r in ranks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short parquet runs at W=2, 1x and 4x data (a smoke run)")
    parser.add_argument("--reps", type=int, default=2, help="repetitions of each run (default 2)")
    parser.add_argument(
        "--only", default=None, help="the runs to keep, by mode (parquet, parquet-x4, materialized, ...)"
    )
    args = parser.parse_args()
    if args.quick:
        reps, steps_per_epoch, skip, epochs = 1, 20, 3, 1
        runs = [("parquet", 2), ("parquet x4", 2)]
    else:
        reps, steps_per_epoch, skip, epochs = args.reps, 80, 10, 2
        runs = [("parquet", 2), ("parquet", 3), ("materialized", 2), ("streaming", 2), ("hand-written", 2)]
        runs += [("parquet x4", 2), ("materialized x4", 2), ("materialized again", 2)]
    if args.only:
        known = {mode.replace(" ", "-") for mode, _ in runs}
        if set(args.only.split(",")) - known:
            parser.error(f"--only takes some of {','.join(sorted(known))}, got {args.only!r}")
        runs = [(mode, w) for mode, w in runs if mode.replace(" ", "-") in args.only.split(",")]
    rows = steps_per_epoch * GLOBAL_BATCH
    data_bytes = rows * ROW_BYTES
    wall = time.perf_counter()
    start_ray()
    print(machine_line())
    results: dict[str, list[dict[str, float]]] = {f"{m} W={w}": [] for m, w in runs}
    with tempfile.TemporaryDirectory(prefix="raytrain-bench-") as storage:
        data_dir, large_dir = os.path.join(storage, "data"), os.path.join(storage, "data-x4")
        write_parquet(data_dir, rows)
        write_parquet(large_dir, 4 * rows)
        for rep in range(reps):
            for mode, workers in runs if (first_rep() + rep) % 2 == 0 else runs[::-1]:
                key = f"{mode} W={workers}"
                name = f"{mode.replace(' ', '-')}-{workers}-{rep}"
                if mode == "hand-written":
                    run_ = run_hand_written(storage, data_dir, workers, epochs)
                elif mode.endswith(" x4"):  # 4x the data, the same steps
                    base = mode.split()[0]
                    run_ = run_raytrain(storage, large_dir, name, base, workers, 1, max_steps=epochs * steps_per_epoch)
                else:
                    same_as = "materialized" if mode == "materialized again" else mode  # the A/A control
                    run_ = run_raytrain(storage, data_dir, name, same_as, workers, epochs)
                results[key].append(summarise(run_, skip, data_bytes))
                print(f"  done {key} rep {rep}: wait fraction {results[key][-1]['wait_fraction']:.3f}", flush=True)
        # Storage reads at W = 4, one epoch of the 4x data set: the default layout against one partition.
        reads: dict[str, list[dict[str, float]]] = {"partitions": [], "one partition": []}
        for rep in range(reps):
            reads["partitions"].append(read_amplification(large_dir, 4, PARTITIONS, WINDOW))
            reads["one partition"].append(read_amplification(large_dir, 4, 1, 8))
            for layout, found in reads.items():
                assert found[-1]["samples"] == 4 * rows, f"{layout}: an epoch of {found[-1]['samples']} samples"
                print(f"  done reads {layout} rep {rep}: amplification {found[-1]['amplification']:.3f}", flush=True)
    cost = position_checkpoint_cost(10**6 if args.quick else 10**7)
    print(machine_line())
    stop_ray()
    windows = rows // (ROW_GROUP * WINDOW)
    print(
        f"\nInput pipeline: Parquet {rows:,} rows x {FEATURES} float32 features ({data_bytes / 1e6:.1f} MB in memory) "
        f"in {FILES} files of {ROW_GROUP}-row row groups ({windows} windows of {WINDOW}), global batch {GLOBAL_BATCH}, "
        f"micro-batch {MICRO_BATCH}, {epochs} epoch(s) of {steps_per_epoch} steps, steady state after step {skip}"
    )
    keys = [
        "wait_fraction",
        "wait_fraction_max_rank",
        "samples_per_s",
        "peak_rss_mb",
        "arrow_mb",
        "ranks_probed",
        "cpu_cores",
        "train_cpu_cores",
        "data_cpu_fraction",
        "data_bytes_fraction",
        "position_bytes",
        "startup_s",
        "wall_s",
    ]
    headers = [
        "run",
        "rep",
        "data wait fraction",
        "the same, slowest rank",
        "samples/s",
        "peak RSS MB (largest rank)",
        "pyarrow MB",
        "ranks probed",
        "cores busy per rank",
        "of them the training thread",
        "rank 0 data threads CPU / step",
        "rank 0 windows / data set",
        "position bytes",
        "start-up s",
        "wall s",
    ]
    out_rows: list[list[Any]] = []
    medians: dict[str, dict[str, float]] = {}
    for key, reps_ in results.items():
        for i, s in enumerate(reps_):
            out_rows.append([key, i, *(s[k] for k in keys)])
        medians[key] = {k: median([s[k] for s in reps_]) for k in keys}
        out_rows.append([key, "median", *(medians[key][k] for k in keys)])
    print(table(headers, out_rows))
    print(
        f"data position in a checkpoint halfway through an epoch of {cost['streaming_ids'] * 2:.0e} samples: "
        f"position modes {cost['position_bytes']:.0f} bytes in {cost['position_s'] * 1000:.2f} ms;\n"
        f"  streaming, ids as a Ray Data streaming split consumed them ({cost['streaming_read_s']:.0f} s to read): "
        f"{cost['streaming_ids']:.0f} ids in {cost['streaming_ranges']:.0f} ranges, "
        f"{cost['streaming_bytes'] / 1e3:.1f} kB "
        f"in {cost['streaming_s'] * 1000:.1f} ms (merge + write, without the all-gather); as an id array "
        f"{cost['streaming_array_bytes'] / 1e6:.1f} MB;\n"
        f"  streaming, ids in random order (worst case): {cost['streaming_random_ranges']:.0f} ranges, "
        f"{cost['streaming_random_bytes'] / 1e6:.1f} MB in {cost['streaming_random_s'] * 1000:.0f} ms; as an id array "
        f"{cost['streaming_random_array_bytes'] / 1e6:.1f} MB"
    )
    print(
        table(
            [
                "W = 4, one epoch of the x4 data",
                "rep",
                "bytes read / data set",
                "largest rank / mean",
                "slowest rank s",
            ],
            [
                [
                    f"{PARTITIONS} partitions, windows of {WINDOW}"
                    if k == "partitions"
                    else "1 partition, windows of 8",
                    i,
                    r["amplification"],
                    r["imbalance"],
                    r["seconds"],
                ]
                for k, found in reads.items()
                for i, r in enumerate(found)
            ],
        )
    )
    print(
        "goals: data wait fraction <= 0.05 at W = 2 and 3; Parquet samples/s >= 0.95 of the materialized path's; "
        "a worker's peak RSS does not grow with the data set on the Parquet path"
    )
    print(f"wall time {time.perf_counter() - wall:.1f} s")

    def pick(key: str, field: str) -> float | None:
        value = medians.get(key, {}).get(field)
        return None if value is None or value != value else round(value, 4)

    hand = pick("hand-written W=2", "samples_per_s")
    parquet2 = pick("parquet W=2", "samples_per_s")
    materialized2 = pick("materialized W=2", "samples_per_s")
    again2 = pick("materialized again W=2", "samples_per_s")

    def growth(mode: str) -> float | None:
        small, large = pick(f"{mode} W=2", "peak_rss_mb"), pick(f"{mode} x4 W=2", "peak_rss_mb")
        return None if small is None or large is None else round((large - small) * 1e6)

    print_headline(
        {
            "data_wait_fraction": pick("parquet W=2", "wait_fraction"),
            "read_amplification": round(median([r["amplification"] for r in reads["partitions"]]), 4),
            "read_amplification_one_partition": round(median([r["amplification"] for r in reads["one partition"]]), 4),
            "read_imbalance": round(median([r["imbalance"] for r in reads["partitions"]]), 4),
            "data_wait_fraction_w3": pick("parquet W=3", "wait_fraction"),
            "data_wait_fraction_max_rank": pick("parquet W=2", "wait_fraction_max_rank"),
            "data_wait_fraction_max_rank_w3": pick("parquet W=3", "wait_fraction_max_rank"),
            "parquet_over_materialized": round(parquet2 / materialized2, 3) if parquet2 and materialized2 else None,
            "materialized_control_ratio": round(again2 / materialized2, 3) if again2 and materialized2 else None,
            "worker_peak_rss_bytes_parquet": None if (v := pick("parquet W=2", "peak_rss_mb")) is None else v * 1e6,
            "worker_rss_growth_bytes_parquet": growth("parquet"),
            "worker_rss_growth_bytes_materialized": growth("materialized"),
            "data_set_bytes": data_bytes,
            "data_set_bytes_x4": 4 * data_bytes,
            "position_checkpoint_bytes": pick("parquet W=2", "position_bytes"),
            "data_wait_fraction_materialized": pick("materialized W=2", "wait_fraction"),
            "data_wait_fraction_streaming": pick("streaming W=2", "wait_fraction"),
            "samples_per_s_parquet_w2": parquet2,
            "samples_per_s_materialized_w2": materialized2,
            "cpu_count": os.cpu_count(),
            "data_cpu_fraction_parquet_w2": pick("parquet W=2", "data_cpu_fraction"),
            "cpu_cores_per_rank_parquet_w2": pick("parquet W=2", "cpu_cores"),
            "train_cpu_cores_per_rank_parquet_w2": pick("parquet W=2", "train_cpu_cores"),
            "cpu_cores_per_rank_materialized_w2": pick("materialized W=2", "cpu_cores"),
            "train_cpu_cores_per_rank_materialized_w2": pick("materialized W=2", "train_cpu_cores"),
            "cpu_cores_rank0_hand_written_w2": pick("hand-written W=2", "cpu_cores"),
            "train_cpu_cores_rank0_hand_written_w2": pick("hand-written W=2", "train_cpu_cores"),
            "samples_per_s_hand_written_w2": hand,
            "parquet_over_hand_written": round(parquet2 / hand, 3) if parquet2 and hand else None,
            "samples_per_s_streaming_w2": pick("streaming W=2", "samples_per_s"),
            "position_checkpoint_bytes_1e7": cost["position_bytes"],
            "streaming_checkpoint_bytes_1e7": cost["streaming_bytes"],
            "streaming_checkpoint_s_1e7": round(cost["streaming_s"], 4),
            "streaming_checkpoint_ranges_1e7": cost["streaming_ranges"],
            "streaming_checkpoint_array_bytes_1e7": cost["streaming_array_bytes"],
            "streaming_checkpoint_bytes_1e7_random_ids": cost["streaming_random_bytes"],
            "reps": reps,
        }
    )


if __name__ == "__main__":
    main()
