"""python benchmarks/recovery.py [--storage DIR] [--quick | --live-only]

Recovery after membership events on a local cluster of fake nodes (`raytrain demo`), and the cost of
checkpoints, beside Ray Train's bare worker-group start and restart measured in the same run:

    event           seconds from the event to the first step logged by the next worker group (`recovery s`), to
                    its first step beyond the furthest one the old group trained (`back s`: the steps trained again
                    included), and those steps (work lost since the last checkpoint). raytrain logs each step once
                    (steps trained again are not logged twice), so its first logged step after a restart is already
                    past the old group's last one: the two figures are equal for raytrain
    remove          a node with a worker is killed (no grace period), training must go on at W-1
    kill            one training worker process is SIGKILLed, the same size comes back
    add             a node is added, training must go on at W+1
    drain           a node is drained with an 8 s deadline (a spot notice), then removed at the deadline;
                    seconds counted from the notice (the idle wait for the deadline included: a cloud's 2-minute
                    notice makes it ~110 s longer), and the whole cost beside a node lost without notice: the
                    time from the event back to the pre-event step plus nothing retrained, against node loss's
                    time back (which includes its retrained steps)
    live            `--recovery live`, the kill run's cluster, two kills, then a node added: each kill's pause,
                    the longest interval between committed steps from the kill to the first step at the smaller
                    size (`live_kill_pause_s`: the longer one; a step the killed group had joined may commit just
                    after the kill), steps trained again, and against the same run without events: survivors'
                    pids, the batch, the audit, the loss (issue 17); the heal: from each kill to the first step
                    committed at its pre-kill size again after the drop, and the longest interval between committed
                    steps until then (the add comes 90 steps, ~12 s, after the second kill: its replacement has
                    joined by then, the heal taking 3.4-6 s here, so the growth is the added node's group); and
                    the growth (`live_add_grown_s`): from the node's arrival to the first step committed at a
                    larger world (a new replica group placed, built and healed from a peer while the others
                    trained). Should a heal still be under way at the add (the world then below its largest size
                    so far), the next larger world could be the heal's, not the node's: the growth is then not
                    measured (None, a miss) rather than read from the heal
    autoscale       `raytrain demo --autoscale`: Ray's autoscaler over cluster.yaml's node types, no worker node at
                    the start; `autoscale_grow_s` from fit() to the first step at 3 workers (nodes launched for
                    the trainer's demand), `replace_s` from a node reclaimed by the provider (no notice) to the
                    first step back at 3 workers (the replacement launched for the pending demand), and
                    `autoscale_extra_nodes`: nodes launched beyond the 3 needed and the 1 replacement
    bare start      TorchTrainer.fit() -> the first completed step of a bare train_func (a gloo all-reduce per
                    step, 0.08 s of sleep as the demo's compute, a tiny checkpoint every 4 steps as the demo's)
    bare restart    SIGKILL of one of its workers -> the first step completed by the new group (`bare_sigkill_s`,
                    raytrain's `sigkill_s` end point) and -> the first step beyond the pre-kill one (`bare back s`)
(What checkpoints cost a run is measured in `checkpoint_cost.py`, with steps of real compute.)

Each recovery is split into phases from the run's events.jsonl: Ray (event -> training function entered by
the next group: failure detection, teardown, placement, worker start, process group), of which raytrain's own wait
for the GCS to mark a lost node dead (`RefreshClusterView`, from the run's "marked dead after" line) is given
apart, raytrain's start (model build + wrap, checkpoint load, data), and the first step. Prints tables, then one
JSON line with the headline figures, the settings they were measured with, and whether each goal is met;
`--live-only` runs the kill and the live runs only; `--quick` the kill only (a smoke run).

Settings (also in the headline's "settings"): Ray's environment as raytrain sets it
(`raytrain.trainer.RAY_ENV_DEFAULTS`); node-death detection `raytrain.ray_hooks.FAST_NODE_DEATH` (Ray's default
marks a node dead after ~15-30 s; cluster.yaml sets the same values as the fake clusters here); the demo's resize
monitor interval, 1 s, where `ClusterConfig.resize_monitor_interval_s` defaults to 5 s: `node_add_s` on a cluster
with the default is up to 4 s longer.
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
# Live recovery: the same cluster and workers as the restart path's kill, two kills far enough apart for the first
# replacement to join (it builds in seconds on this machine), then a node added (room for a 4th replica group), and
# the same run without events as the reference. 300 steps (~40 s at ~0.13 s a step): 90 steps (~12 s) from the
# second kill to the add, for its replacement (~6 s to heal here) to have joined, and 120 steps (~16 s) after the
# add for the node to start and a new group (~6 s to start here) to join, so that the heals and the growth are
# measured (with 200 steps and the add at 150 the run ended before the 4th group joined: "never joined").
LIVE_RUN = ["--nodes", "3", "--workers", "2:4", "--steps", "300", "--sample-time", "0.01", "--checkpoint-every", "4"]
LIVE_RUN += ["--recovery", "live", "--audit-samples"]
LIVE_EVENTS = "kill@10,kill@90,add@180"
MONITOR_INTERVAL_S = 1.0  # the demo's resize monitor interval
LIBRARY_MONITOR_INTERVAL_S = 5.0  # ClusterConfig.resize_monitor_interval_s's default
BARE_STEP_S, BARE_CHECKPOINT_EVERY = 0.08, 4  # the demo's per-rank compute at 8 samples x 0.01 s; its checkpoints


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
    since = event["time"]  # a drain: the notice (the node goes at its deadline, `node_gone_time`)
    starts = read_jsonl(os.path.join(summary["run_dir"], "events.jsonl"))
    start = next(s for s in starts if s["time"] > event["time"])
    metrics = read_jsonl(os.path.join(summary["run_dir"], "metrics.jsonl"))
    # the furthest step the old group trained (a drained group trains on until its checkpoint after the notice)
    peak = max(m["step"] for m in metrics if m["time"] < event["recovered_time"])
    back = next(m["time"] for m in metrics if m["time"] >= event["recovered_time"] and m["step"] > peak)
    before = [m["time"] for m in metrics if m["time"] <= event["time"]]
    return {
        "name": name,
        "world_sizes": summary["world_sizes"],
        "recovery_s": event["recovered_time"] - since,
        "back_s": back - since,
        "steps_lost": event["steps_lost"],
        "step_s": median([b - a for a, b in itertools.pairwise(before[-10:])]),
        "node_death_wait_s": node_death_wait(summary["run_dir"]),
        "notice_to_gone_s": None if event["node_gone_time"] is None else event["node_gone_time"] - since,
        "ray_s": start["entered"] - since,
        "raytrain_start_s": start["time"] - start["entered"],
        "phases_s": start["phases_s"],
        "first_step_s": event["recovered_time"] - start["time"],
        "detail": event["detail"],
    }


def node_death_wait(run_dir: str) -> float | None:
    """raytrain's wait for the GCS to mark the group's lost node dead (its "marked dead after N s" line), or None."""
    waits = []
    with open(os.path.join(run_dir, "raytrain.log")) as f:
        for line in f:
            if "(marked dead after " in line:
                waits.append(float(line.split("(marked dead after ")[1].split(" s)")[0]))
    return sum(waits) if waits else None


def kill_timeline(metrics: list[dict[str, Any]], kill_time: float) -> dict[str, float | None]:
    """Pure: a live kill's timeline from the run's committed steps ({"step", "time", "world_size"}): `pause_s`,
    the longest interval between committed steps (the kill's time a boundary) until the first step committed at
    the smaller size (a step the killed group had already contributed to may still commit at the old size just
    after the kill: the survivors' stall comes after it); `to_full_s`, from the kill to the first step at the
    pre-kill size again after that drop (the heal); `longest_interval_s`, the longest interval until then. None
    where the run never got there."""
    before = [m["world_size"] for m in metrics if m["time"] <= kill_time]
    if not before:  # killed before its first committed step: no size to fall from
        return {"pause_s": None, "to_full_s": None, "longest_interval_s": None}
    full = before[-1]  # the size the kill cut
    after = [m for m in metrics if m["time"] > kill_time]
    dropped = next((m for m in after if m["world_size"] < full), None)
    healed = (
        None
        if dropped is None
        else next((m for m in after if m["time"] > dropped["time"] and m["world_size"] >= full), None)
    )

    def longest(until: dict[str, Any] | None) -> float | None:
        if until is None:
            return None
        times = [kill_time] + [m["time"] for m in after if m["time"] <= until["time"]]
        return max(b - a for a, b in itertools.pairwise(times))

    return {
        "pause_s": longest(dropped),
        "to_full_s": None if healed is None else healed["time"] - kill_time,
        "longest_interval_s": longest(healed),
    }


def add_growth(metrics: list[dict[str, Any]], event: dict[str, Any]) -> float | None:
    """Pure: a live run's node-add event's `grown_s` (the demo's: the add -> the first step committed at a larger
    world than at the add), or None where the world at the add was below the largest it had reached before (a
    kill's replacement still healing: the next larger world may be the heal's, not the added node's group)."""
    before = [m["world_size"] for m in metrics if m["step"] <= event["applied_step"]]  # as the demo splits them
    if not before or before[-1] < max(before):
        return None
    grown: float | None = event["grown_s"]
    return grown


def live(storage: str) -> dict[str, Any]:
    """`raytrain demo --recovery live` with two kills and a node added, beside the same run without events: each
    kill's timeline (`kill_timeline`), the node's growth, the steps trained again, and the done-when checks:
    survivors' pids, the batch of every step, the audit, the loss against the fixed run."""
    killed = demo("live", storage, [*LIVE_RUN, "--events", LIVE_EVENTS])
    fixed = demo("live_fixed", storage, [*LIVE_RUN, "--events", "none"])
    metrics = read_jsonl(os.path.join(killed["run_dir"], "metrics.jsonl"))
    curves = [
        [m["loss"] for m in metrics],
        [m["loss"] for m in read_jsonl(os.path.join(fixed["run_dir"], "metrics.jsonl"))],
    ]
    heals = [kill_timeline(metrics, e["time"]) for e in killed["events"] if e["kind"] == "kill"]
    launched = {  # each replica group's worker pids, as started
        r["replica"]: r["pids"]
        for r in read_jsonl(os.path.join(killed["run_dir"], "live.jsonl"))
        if r["kind"] in ("started", "joined")
    }
    info = killed["live"]
    lost = {item["replica"] for item in info["lost"]}
    survivors = [r for r in info["finished"] if "." not in r["replica"] and r["replica"] not in lost]
    return {
        "world_sizes": killed["world_sizes"],
        "pause_s": [h["pause_s"] for h in heals],
        # a node added: from its arrival to the first step committed at a larger world (a group placed, built and
        # healed from a peer while the others trained); None where a heal was still under way at the add
        "grown_s": [add_growth(metrics, e) for e in killed["events"] if e["kind"] == "add"],
        "steps_retrained": info["steps_retrained"],
        "restarts": info["restarts"],
        "survivors": survivors,
        "survivor_pids_unchanged": bool(survivors) and all(r["pid"] in launched[r["replica"]] for r in survivors),
        "batch_exact": killed["global_batch_sizes"] == [24] and len(curves[0]) == len(curves[1]),
        "audit_clean": all(c == {"duplicates": 0, "missing": 0} for c in killed["audit"].values()),
        "loss_max_diff": max(abs(a - b) for a, b in zip(*curves, strict=True)),
        "heals": heals,
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


def _bare_train_func(config: dict[str, Any]) -> None:
    """A bare Ray Train loop with the demo's rhythm: each step 0.08 s of sleep (the compute) and a gloo all-reduce
    (the gradient sync); every 4 steps a tiny checkpoint (the step) reported by every rank; it resumes from Ray
    Train's latest checkpoint. Rank 0 logs each completed step; rank 0 of the first group SIGKILLs itself after
    the kill step."""
    import ray.train
    import torch
    import torch.distributed as dist
    from ray.train import Checkpoint

    rank = ray.train.get_context().get_world_rank()
    step = 0
    latest = ray.train.get_checkpoint()
    if latest is not None:
        with latest.as_directory() as directory, open(os.path.join(directory, "step")) as f:
            step = int(f.read())
    marks = config["marks"]
    while step < config["steps"]:
        time.sleep(BARE_STEP_S)
        dist.all_reduce(torch.ones(1024))
        step += 1
        if rank == 0:
            with open(marks, "a") as f:
                f.write(json.dumps({"step": step, "time": time.time(), "pid": os.getpid()}) + "\n")
        if step % BARE_CHECKPOINT_EVERY == 0:
            with tempfile.TemporaryDirectory() as directory:
                with open(os.path.join(directory, "step"), "w") as f:
                    f.write(str(step))
                ray.train.report({"step": step}, checkpoint=Checkpoint.from_directory(directory))
        if rank == 0 and step == config["kill_step"] and not os.path.exists(marks + ".kill"):
            with open(marks + ".kill", "w") as f:
                f.write(json.dumps({"time": time.time(), "step": step}))
            os.kill(os.getpid(), signal.SIGKILL)


def bare_ray_train(storage: str) -> dict[str, float]:
    """Ray Train's own floor on the same kind of cluster, with raytrain's end points: `fit()` -> the first
    completed step; a SIGKILL -> the first step completed by the new group, and -> the first step beyond the one
    completed when the kill came (the steps since the last checkpoint trained again)."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raytrain.cli.demo import WORKER_SLOT, FakeCluster
    from raytrain.trainer import apply_ray_env_defaults

    apply_ray_env_defaults()
    cluster = FakeCluster(3)
    ray.init(address=cluster.address)
    marks = os.path.join(storage, "bare_marks.jsonl")
    try:
        trainer = TorchTrainer(
            _bare_train_func,
            train_loop_config={"marks": marks, "steps": 30, "kill_step": 10},
            scaling_config=ScalingConfig(num_workers=3, resources_per_worker={"CPU": 1, WORKER_SLOT: 1}),
            run_config=RunConfig(name="bare", storage_path=storage, failure_config=FailureConfig(max_failures=3)),
        )
        started = time.time()
        trainer.fit()
    finally:
        ray.shutdown()
        cluster.shutdown()
    steps = read_jsonl(marks)
    with open(marks + ".kill") as f:
        kill = json.load(f)
    after = [m for m in steps if m["time"] > kill["time"]]
    return {
        "start_s": steps[0]["time"] - started,
        "restart_s": after[0]["time"] - kill["time"],
        "back_s": next(m["time"] for m in after if m["step"] > kill["step"]) - kill["time"],
        "steps_lost": kill["step"] - (after[0]["step"] - 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", default=None, help="where runs go (default: a temporary directory)")
    parser.add_argument("--quick", action="store_true", help="the kill only (a smoke run)")
    parser.add_argument(
        "--live-only", action="store_true", help="only the restart path's kill and live recovery, side by side"
    )
    args = parser.parse_args()
    storage = args.storage or tempfile.mkdtemp(prefix="raytrain-recovery-")
    print(machine_line(), flush=True)
    if args.live_only:
        return live_only(storage)
    if args.quick:
        return quick(storage)
    rows = {name: recovery(name, storage) for name in SCENARIOS}
    live_row = live(storage)
    bare = bare_ray_train(storage)
    auto = autoscale(storage)

    print(
        table(
            [
                "event",
                "world",
                "recovery s",
                "back s",
                "steps lost",
                "Ray s",
                "of it: dead-node wait s",
                "raytrain start s",
                "first step s",
                "detail",
            ],
            [
                [
                    name,
                    " -> ".join(str(w) for w in row["world_sizes"]),
                    f"{row['recovery_s']:.1f}",
                    f"{row['back_s']:.1f}",
                    row["steps_lost"],
                    f"{row['ray_s']:.1f}",
                    "" if row["node_death_wait_s"] is None else f"{row['node_death_wait_s']:.1f}",
                    f"{row['raytrain_start_s']:.2f} ("
                    + ", ".join(f"{k} {v:.2f}" for k, v in row["phases_s"].items())
                    + ")",
                    f"{row['first_step_s']:.2f}",
                    row["detail"],
                ]
                for name, row in rows.items()
            ]
            + [
                ["bare start", "3", f"{bare['start_s']:.1f}", "", "-", "", "", "", "", "fit() -> first step"],
                [
                    "bare restart",
                    "3 -> 3",
                    f"{bare['restart_s']:.1f}",
                    f"{bare['back_s']:.1f}",
                    bare["steps_lost"],
                    "",
                    "",
                    "",
                    "",
                    "SIGKILL -> first step of the new group",
                ],
            ],
        )
    )
    drain, lost = rows["drain"], rows["remove"]
    print(
        table(
            ["a node goes", "from", "back at the pre-event step, s", "steps trained again", "of which idle, s"],
            [
                [
                    "with an 8 s notice (drain)",
                    "the notice",
                    f"{drain['back_s']:.1f}",
                    drain["steps_lost"],
                    f"{drain['notice_to_gone_s']:.1f} (training waits for the deadline)",
                ],
                ["without notice (node loss)", "the loss", f"{lost['back_s']:.1f}", lost["steps_lost"], "-"],
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
    headline = {
        "node_loss_s": round(rows["remove"]["recovery_s"], 2),
        "sigkill_s": round(rows["kill"]["recovery_s"], 2),
        "node_add_s": round(rows["add"]["recovery_s"], 2),
        "node_loss_back_s": round(rows["remove"]["back_s"], 2),
        "node_loss_steps_retrained": rows["remove"]["steps_lost"],
        "node_loss_dead_node_wait_s": rows["remove"]["node_death_wait_s"],
        "sigkill_back_s": round(rows["kill"]["back_s"], 2),
        "drain_s": round(rows["drain"]["recovery_s"], 2),
        "drain_back_s": round(rows["drain"]["back_s"], 2),
        "drain_notice_to_gone_s": round(rows["drain"]["notice_to_gone_s"], 2),
        "drain_steps_retrained": rows["drain"]["steps_lost"],
        "bare_sigkill_s": round(bare["restart_s"], 2),
        "bare_sigkill_back_s": round(bare["back_s"], 2),
        "bare_start_s": round(bare["start_s"], 2),
        "autoscale_grow_s": auto["grow_s"],
        "replace_s": auto["replace_s"],
        "autoscale_scale_down_s": auto["scale_down_s"],
        "autoscale_extra_nodes": auto["extra_nodes"],
        **live_headline(live_row),
        "settings": settings(),
    }
    headline["goals_met"] = {
        "drain_steps_retrained": headline["drain_steps_retrained"] == 0,
        # like for like: both past the old group's last step, retrained steps included
        "sigkill_s": headline["sigkill_back_s"] <= headline["bare_sigkill_back_s"] + 3,
        "node_loss_s": headline["node_loss_back_s"] <= headline["bare_sigkill_back_s"] + 5,
        "node_add_s": headline["node_add_s"] <= MONITOR_INTERVAL_S + headline["bare_start_s"] + 3,
        **live_goals(headline),
    }
    print(live_table(live_row, rows["kill"]))
    print_headline(headline)
    return 0


def settings() -> dict[str, Any]:
    """The settings the figures depend on, beside the library's defaults."""
    from raytrain.ray_hooks import FAST_NODE_DEATH
    from raytrain.trainer import RAY_ENV_DEFAULTS

    return {
        "node_death": FAST_NODE_DEATH,
        "node_death_in_cluster_yaml": True,  # cluster.yaml's head starts with the same --system-config
        "resize_monitor_interval_s": MONITOR_INTERVAL_S,
        "resize_monitor_interval_s_default": LIBRARY_MONITOR_INTERVAL_S,
        "ray_env": RAY_ENV_DEFAULTS,
        "checkpoint_every_steps": 4,
        "drain_notice_s": 8,
    }


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
        # the heal: each kill -> the first step committed at full size again (None: never back), and the longest
        # gap between committed steps until then
        "live_heal_s": None
        if None in (h["to_full_s"] for h in row["heals"])
        else max(round(h["to_full_s"], 2) for h in row["heals"]),
        "live_heal_longest_interval_s": max(round(h["longest_interval_s"] or 0.0, 2) for h in row["heals"]),
        "live_heals_completed": sum(h["to_full_s"] is not None for h in row["heals"]),
        # a node added -> the first step a new replica group committed in (None: it never joined)
        "live_add_grown_s": None if None in row["grown_s"] else max(round(g, 2) for g in row["grown_s"]),
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
    """The restart path's kill beside live recovery's two kills, and the live run's growth."""
    rows = [
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
            ", ".join("-" if p is None else f"{p:.2f}" for p in row["pause_s"]),
            row["steps_retrained"],
            ", ".join(f"{r['replica']} pid {r['pid']}" for r in row["survivors"]) + " (never restarted)",
        ],
    ]
    headers = [
        "SIGKILL of a worker",
        "world",
        "stall, s (live: longest gap to the smaller size)",
        "steps trained again",
        "survivors",
    ]
    growth = ", ".join("never joined" if g is None else f"{g:.2f} s" for g in row["grown_s"])
    return table(headers, rows) + f"\nlive, a node added -> the first step a new replica group committed in: {growth}"


def quick(storage: str) -> int:
    """`--quick`: one event, a worker SIGKILLed, on raytrain's restart path: its figures (the comparison with bare
    Ray Train's restart, and its goal, are in the full run)."""
    kill = recovery("kill", storage)
    row = [kill["recovery_s"], kill["back_s"], kill["steps_lost"], kill["raytrain_start_s"], kill["first_step_s"]]
    print(table(["SIGKILL of a worker: recovery s", "back s", "steps lost", "raytrain start s", "first step s"], [row]))
    headline = {
        "sigkill_s": round(kill["recovery_s"], 2),
        "sigkill_back_s": round(kill["back_s"], 2),
        "sigkill_steps_lost": kill["steps_lost"],
        "world_sizes": kill["world_sizes"],
        "settings": settings(),
    }
    print_headline(headline)
    return 0


def live_only(storage: str) -> int:
    """`--live-only`: the restart path's kill and the live runs, their table and headline."""
    kill = recovery("kill", storage)
    row = live(storage)
    print(live_table(row, kill))
    headline = {"sigkill_s": round(kill["recovery_s"], 2), **live_headline(row), "settings": settings()}
    headline["goals_met"] = live_goals(headline)
    print_headline(headline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
