"""python benchmarks/recovery.py [--storage DIR] [--quick]

Recovery after membership events on a local cluster of fake nodes (`raytrain demo`), and the cost of
checkpoints, beside Ray Train's bare worker-group start and restart measured in the same run:

    event           seconds from the event to the first step finished by the next worker group,
                    and steps that had to be trained again (work lost since the last checkpoint)
    remove          a node with a worker is killed (no grace period), training must go on at W-1
    kill            one training worker process is SIGKILLed, the same size comes back
    add             a node is added, training must go on at W+1
    drain           a node is drained with an 8 s deadline (a spot notice), then removed at the deadline;
                    seconds counted from the removal
    live            `--recovery live`, the kill run's cluster, two kills: seconds from each kill to the next
                    committed step (`live_kill_pause_s`: the longer one), steps trained again, and against the
                    same run without events: survivors' pids, the batch, the audit, the loss (issue 17)
    autoscale       `raytrain demo --autoscale`: Ray's autoscaler over cluster.yaml's node types, no worker node at
                    the start; `autoscale_grow_s` from fit() to the first step at 3 workers (nodes launched for
                    the trainer's demand), `replace_s` from a node reclaimed by the provider (no notice) to the
                    first step back at 3 workers (the replacement launched for the pending demand), and
                    `autoscale_extra_nodes`: nodes launched beyond the 3 needed and the 1 replacement
    bare start      TorchTrainer.fit() -> train_func entered, trivial train_func
    bare restart    SIGKILL of a worker in a trivial train_func -> train_func entered again
    checkpoints     a fixed 3-worker run checkpointing every 5 steps vs the same run without checkpoints:
                    the extra wall time of steps 11-60 over the run without, with the files written in the
                    background (`checkpoint_overhead_fraction`, the default) and on the training thread
                    (`..._sync`), and where it goes: the median gap between logged steps at each position of
                    the 5-step cycle

Each recovery is split into phases from the run's events.jsonl: Ray (event -> training function entered by
the next group: failure detection, teardown, placement, worker start, process group), raytrain's start (model
build + wrap, checkpoint load, data), and the first step. Prints tables, then one JSON line with the headline
figures and whether each goal of issues 13 and 17 is met; `--live-only` runs the kill and the live runs only.
Ray settings: raytrain's defaults (`raytrain.trainer.RAY_ENV_DEFAULTS`), resize monitor interval 1 s.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from _common import machine_line, median, print_headline, read_jsonl, table

EVENT_RUN = ["--nodes", "3", "--workers", "2:3", "--steps", "40", "--sample-time", "0.01", "--checkpoint-every", "4"]
ADD_RUN = ["--nodes", "2", "--workers", "2:3", "--steps", "100", "--sample-time", "0.02", "--checkpoint-every", "4"]
SCENARIOS = {
    "remove": [*EVENT_RUN, "--events", "remove@10"],
    "kill": [*EVENT_RUN, "--events", "kill@10"],
    "add": [*ADD_RUN, "--events", "add@6"],
    "drain": [*EVENT_RUN, "--events", "drain@10"],
}
AUTOSCALE_RUN = [
    "--autoscale",
    "--workers",
    "1:3",
    "--steps",
    "60",
    "--sample-time",
    "0.01",
    "--checkpoint-every",
    "4",
    "--events",
    "reclaim@25",
    "--idle-timeout",
    "8",
]
FIXED_RUN = ["--nodes", "3", "--workers", "3", "--events", "none", "--steps", "60", "--sample-time", "0.01"]
# Live recovery: the same cluster and workers as the restart path's kill, two kills far enough apart for the first
# replacement to join (it builds in seconds on this machine), and the same run without events as the reference.
LIVE_RUN = ["--nodes", "3", "--workers", "2:3", "--steps", "70", "--sample-time", "0.01", "--checkpoint-every", "4"]
LIVE_RUN += ["--recovery", "live", "--audit-samples"]
LIVE_EVENTS = "kill@10,kill@45"
MONITOR_INTERVAL_S = 1.0  # the demo's resize monitor interval


def demo(name: str, storage: str, args: list[str]) -> dict[str, Any]:
    """One `raytrain demo --json` run; its summary."""
    command = [sys.executable, "-m", "raytrain.cli", "demo", "--json", "--storage", storage, "--run-name", name]
    command += ["--global-batch", "24", "--micro-batch", "4", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: demo failed\n{done.stderr[-3000:]}")
    summary: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    summary["run_dir"] = os.path.join(storage, name)
    return summary


def recovery(name: str, storage: str) -> dict[str, Any]:
    """The scenario's event, its recovery time and the phases of the recovery."""
    summary = demo(name, storage, SCENARIOS[name])
    (event,) = summary["events"]
    since = event["node_gone_time"] if name == "drain" else event["time"]
    starts = read_jsonl(os.path.join(summary["run_dir"], "events.jsonl"))
    start = next(s for s in starts if s["time"] > event["time"])
    return {
        "name": name,
        "world_sizes": summary["world_sizes"],
        "recovery_s": event["recovered_time"] - since,
        "steps_lost": event["steps_lost"],
        "ray_s": start["entered"] - since,
        "raytrain_start_s": start["time"] - start["entered"],
        "phases_s": start["phases_s"],
        "first_step_s": event["recovered_time"] - start["time"],
        "detail": event["detail"],
    }


def live(storage: str) -> dict[str, Any]:
    """`raytrain demo --recovery live` with two kills beside the same run without events: each kill's pause (from
    the kill to the next committed step, the measure of a restart's `recovery_s`), the steps trained again, and
    the done-when checks: survivors' pids, the batch of every step, the audit, the loss against the fixed run."""
    killed = demo("live", storage, [*LIVE_RUN, "--events", LIVE_EVENTS])
    fixed = demo("live_fixed", storage, [*LIVE_RUN, "--events", "none"])
    curves = [[m["loss"] for m in read_jsonl(os.path.join(s["run_dir"], "metrics.jsonl"))] for s in (killed, fixed)]
    launched = {
        r["replica"]: r["pid"]
        for r in read_jsonl(os.path.join(killed["run_dir"], "live.jsonl"))
        if r["kind"] in ("started", "joined")
    }
    info = killed["live"]
    lost = {item["replica"] for item in info["lost"]}
    survivors = [r for r in info["finished"] if "." not in r["replica"] and r["replica"] not in lost]
    return {
        "world_sizes": killed["world_sizes"],
        "pause_s": info["pause_s"],
        "steps_retrained": info["steps_retrained"],
        "restarts": info["restarts"],
        "survivors": survivors,
        "survivor_pids_unchanged": bool(survivors) and all(r["pid"] == launched[r["replica"]] for r in survivors),
        "batch_exact": killed["global_batch_sizes"] == [24] and len(curves[0]) == len(curves[1]),
        "audit_clean": all(c == {"duplicates": 0, "missing": 0} for c in killed["audit"].values()),
        "loss_max_diff": max(abs(a - b) for a, b in zip(*curves, strict=True)),
        "wall_s": (killed["wall_s"], fixed["wall_s"]),
    }


def autoscale(storage: str) -> dict[str, Any]:
    """The --autoscale run's growth, replacement and scale-down times, and the nodes it launched."""
    auto: dict[str, Any] = demo("autoscale", storage, AUTOSCALE_RUN)["autoscale"]
    launched = sum(auto["launched_by_type"].values())
    return {
        "grow_s": auto["grow_s"],
        "replace_s": auto["replace_s"][0],
        "scale_down_s": auto["scale_down_s"],
        "launched_by_type": auto["launched_by_type"],
        "extra_nodes": launched - 3 - len(auto["replace"]),
    }


def run_gaps(name: str, storage: str, flags: list[str]) -> list[float]:
    """Seconds between consecutive logged steps 10..60 of a fixed 3-worker run with the demo `flags` (50 gaps;
    the first one ends at step 11)."""
    summary = demo(name, storage, [*FIXED_RUN, *flags])
    times = [m["time"] for m in read_jsonl(os.path.join(summary["run_dir"], "metrics.jsonl"))]
    return [later - earlier for earlier, later in itertools.pairwise(times[9:60])]


CHECKPOINT_MODES = {  # name -> demo flags; "none" is the baseline
    "background": ["--checkpoint-every", "5"],
    "sync": ["--checkpoint-every", "5", "--no-background-save"],
    "none": ["--checkpoint-every", str(10**6)],
}


def checkpoint_overhead(storage: str, reps: int) -> dict[str, Any]:
    """Extra wall time of checkpointing every 5 steps, written in the background (the default) and on the
    training thread, as a fraction of the same run without checkpoints (runs alternated; the median of the
    per-repetition fractions of steps 11-60's wall time), and the profile: the median gap before each position of
    the 5-step cycle (position 1 follows the checkpointing step: the copy to host memory, or the whole write; 2
    the step whose end reports a background checkpoint: manifest, `ray.train.report`)."""
    gaps: dict[str, list[list[float]]] = {mode: [] for mode in CHECKPOINT_MODES}
    for rep in range(reps):
        for mode, flags in CHECKPOINT_MODES.items():
            gaps[mode].append(run_gaps(f"ckpt_{mode}_{rep}", storage, flags))
    walls = {mode: [sum(run) for run in runs] for mode, runs in gaps.items()}
    fractions = {
        mode: median([(a - b) / b for a, b in zip(walls[mode], walls["none"], strict=True)])
        for mode in ("background", "sync")
    }
    profile = {
        mode: [median([g for run in runs for i, g in enumerate(run) if (11 + i) % 5 == pos % 5]) for pos in range(1, 6)]
        for mode, runs in gaps.items()
    }
    return {"walls_s": walls, "fraction": fractions, "profile_s": profile}


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

    from raytrain.cli.demo import WORKER_SLOT, FakeCluster
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
    parser.add_argument("--quick", action="store_true", help="one checkpoint-cost pair instead of three")
    parser.add_argument(
        "--live-only", action="store_true", help="only the restart path's kill and live recovery, side by side"
    )
    args = parser.parse_args()
    storage = args.storage or tempfile.mkdtemp(prefix="raytrain-recovery-")
    print(machine_line(), flush=True)
    if args.live_only:
        return live_only(storage)
    rows = {name: recovery(name, storage) for name in SCENARIOS}
    live_row = live(storage)
    bare = bare_ray_train(storage)
    auto = autoscale(storage)
    costs = checkpoint_overhead(storage, 1 if args.quick else 3)

    print(
        table(
            ["event", "world", "recovery s", "steps lost", "Ray s", "raytrain start s", "first step s", "detail"],
            [
                [
                    name,
                    " -> ".join(str(w) for w in row["world_sizes"]),
                    f"{row['recovery_s']:.1f}",
                    row["steps_lost"],
                    f"{row['ray_s']:.1f}",
                    f"{row['raytrain_start_s']:.2f} ("
                    + ", ".join(f"{k} {v:.2f}" for k, v in row["phases_s"].items())
                    + ")",
                    f"{row['first_step_s']:.2f}",
                    row["detail"],
                ]
                for name, row in rows.items()
            ]
            + [
                ["bare start", "3", f"{bare['start_s']:.1f}", "-", "", "", "", "TorchTrainer.fit() -> train_func"],
                ["bare restart", "3 -> 3", f"{bare['restart_s']:.1f}", "-", "", "", "", "SIGKILL -> train_func"],
            ],
        )
    )
    print(
        table(
            ["autoscaler", "seconds", "beside, same run", "detail"],
            [
                [
                    "start -> 3 workers",
                    auto["grow_s"],
                    f"bare start {bare['start_s']:.1f} s (nodes there)",
                    "launched " + ", ".join(f"{n} x {t}" for t, n in auto["launched_by_type"].items()),
                ],
                [
                    "reclaim -> back at 3",
                    auto["replace_s"],
                    f"node loss {rows['remove']['recovery_s']:.1f} s (to 2)",
                    f"{auto['extra_nodes']} node(s) launched beyond demand",
                ],
                ["training end -> 0 nodes", auto["scale_down_s"], "", "idle timeout 8 s"],
            ],
        )
    )
    print(
        table(
            ["checkpoints every 5", *(f"steps 11-60, {mode} (s)" for mode in CHECKPOINT_MODES)],
            [
                [f"repetition {i + 1}", *(f"{costs['walls_s'][mode][i]:.3f}" for mode in CHECKPOINT_MODES)]
                for i in range(len(costs["walls_s"]["none"]))
            ],
        )
    )
    print(
        table(
            ["step after a checkpoint", *(f"median gap, {mode} (ms)" for mode in CHECKPOINT_MODES)],
            [
                [position, *(f"{costs['profile_s'][mode][position - 1] * 1000:.1f}" for mode in CHECKPOINT_MODES)]
                for position in range(1, 6)
            ],
        )
    )
    headline = {
        "node_loss_s": round(rows["remove"]["recovery_s"], 2),
        "sigkill_s": round(rows["kill"]["recovery_s"], 2),
        "node_add_s": round(rows["add"]["recovery_s"], 2),
        "drain_s": round(rows["drain"]["recovery_s"], 2),
        "drain_steps_retrained": rows["drain"]["steps_lost"],
        "bare_sigkill_s": round(bare["restart_s"], 2),
        "bare_start_s": round(bare["start_s"], 2),
        "autoscale_grow_s": auto["grow_s"],
        "replace_s": auto["replace_s"],
        "autoscale_scale_down_s": auto["scale_down_s"],
        "autoscale_extra_nodes": auto["extra_nodes"],
        "checkpoint_overhead_fraction": round(costs["fraction"]["background"], 4),
        "checkpoint_overhead_fraction_sync": round(costs["fraction"]["sync"], 4),
        **live_headline(live_row),
    }
    headline["goals_met"] = {
        "drain_steps_retrained": headline["drain_steps_retrained"] == 0,
        "sigkill_s": headline["sigkill_s"] <= headline["bare_sigkill_s"] + 3,
        "node_loss_s": headline["node_loss_s"] <= headline["bare_sigkill_s"] + 5,
        "node_add_s": headline["node_add_s"] <= MONITOR_INTERVAL_S + headline["bare_start_s"] + 3,
        "checkpoint_overhead_fraction": headline["checkpoint_overhead_fraction"] <= 0.05,
        **live_goals(headline),
    }
    print(live_table(live_row, rows["kill"]))
    print_headline(headline)
    return 0


def live_headline(row: dict[str, Any]) -> dict[str, Any]:
    """The live run's headline keys (issue 17)."""
    return {
        # the longer of the two kills' pauses; None when a kill was never followed by a committed step (a miss)
        "live_kill_pause_s": None if None in row["pause_s"] else max(row["pause_s"]),
        "live_steps_retrained": row["steps_retrained"],
        "live_restarts": row["restarts"],
        "live_survivor_pids_unchanged": row["survivor_pids_unchanged"],
        "live_batch_exact": row["batch_exact"],
        "live_audit_clean": row["audit_clean"],
        "live_loss_max_diff": row["loss_max_diff"],
    }


def live_goals(headline: dict[str, Any]) -> dict[str, bool]:
    """Issue 17's done-when, from the headline of the same run."""
    return {
        "live_kill_pause_s": headline["live_kill_pause_s"] is not None
        and headline["live_kill_pause_s"] <= headline["sigkill_s"] / 3,
        "live_survivors": headline["live_survivor_pids_unchanged"] and headline["live_restarts"] == 0,
        "live_exact": headline["live_batch_exact"] and headline["live_audit_clean"],
        "live_loss": headline["live_loss_max_diff"] <= 1e-4,
    }


def live_table(row: dict[str, Any], kill: dict[str, Any]) -> str:
    """The restart path's kill beside live recovery's two kills."""
    return table(
        ["SIGKILL of a worker", "world", "seconds to the next step", "steps trained again", "survivors"],
        [
            [
                "restart path",
                " -> ".join(str(w) for w in kill["world_sizes"]),
                f"{kill['recovery_s']:.2f}",
                kill["steps_lost"],
                "restarted",
            ],
            [
                "live, 2 kills",
                " -> ".join(str(w) for w in row["world_sizes"]),
                ", ".join(f"{p:.2f}" for p in row["pause_s"]),
                row["steps_retrained"],
                ", ".join(f"{r['replica']} pid {r['pid']}" for r in row["survivors"]) + " (never restarted)",
            ],
        ],
    )


def live_only(storage: str) -> int:
    """`--live-only`: the restart path's kill and the live runs, their table and headline."""
    kill = recovery("kill", storage)
    row = live(storage)
    print(live_table(row, kill))
    headline = {"sigkill_s": round(kill["recovery_s"], 2), **live_headline(row)}
    headline["goals_met"] = live_goals(headline)
    print_headline(headline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
