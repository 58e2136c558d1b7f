"""python benchmarks/tables.py [RESULTS.json]

Writes the table between the `benchmark-table` markers of benchmarks/README.md, and its rows with a goal in
README.md's: from the
results file given (`run_all.py`'s), or by default each benchmark from the newest full (not --quick) results file
in benchmarks/results/ in which it ran (so `run_all.py --only NAME` renews that benchmark's rows), the header
naming every file used with its date, commit and repetitions. Each
row is one figure: its median over the repetitions with min-max, and whether its goal is met by the *worst*
repetition (max for an upper bound, min for a lower bound); where the figure has an A/A control (`NOISE`) that
strayed further than the goal's margin, the verdict adds "within noise" and the control's range. A figure the
results file lacks is left out; nothing is typed by hand.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
START, END = "<!-- benchmark-table", "<!-- /benchmark-table -->"

# (benchmark, figure, what it is, goal: ("<=" | ">=", bound) or None)
ROWS: list[tuple[str, str, str, tuple[str, float] | None]] = [
    (
        "overhead",
        "overhead_ratio",
        "raytrain ÷ a matched hand-written Ray Train loop, steps/s, all intervals",
        (">=", 0.97),
    ),
    ("overhead", "overhead_ratio_median_step", "the same, median step (checkpoints and epoch change left out)", None),
    ("overhead", "control_ratio", "the matched loop run twice, second ÷ first (A/A): the noise floor", None),
    (
        "overhead",
        "overhead_ratio_large_step",
        "the same comparison with hidden 2048 instead of 512 (4.3 M parameters), all intervals",
        None,
    ),
    ("overhead", "control_ratio_large_step", "its A/A control", None),
    (
        "overhead",
        "step_cost_us",
        "raytrain's step less the matched step, in one process without Ray, µs per step",
        None,
    ),
    ("overhead", "step_cost_norm_us", "of it: the global gradient norm (non-finite check, grad_norm), µs", None),
    (
        "overhead",
        "start_overhead_s",
        "fit() -> first step: raytrain less the matched Ray Train loop, s",
        ("<=", 3.0),
    ),
    (
        "overhead",
        "start_overhead_in_worker_s",
        "of it: in the worker, training function entered -> first step, s",
        None,
    ),
    (
        "startup",
        "dry_run_s",
        "`raytrain fit` README's example `--dry-run`: launch -> exit, fresh process, s",
        ("<=", 10.0),
    ),
    ("startup", "ray_start_s", "a process that starts a local Ray instance and exits: the floor, s", None),
    (
        "startup",
        "fit_start_s",
        "`raytrain fit` README's example (validation set): launch -> first step, fresh process, s",
        None,
    ),
    ("startup", "bare_start_s", "a bare Ray Train script, the same work: launch -> first step, s", None),
    ("startup", "fit_start_overhead_s", "the two's difference, s", ("<=", 3.0)),
    ("overhead", "start_control_s", "the matched loop's start-up, second run less first (A/A), s", None),
    ("overhead", "design_ratio_matched_vs_naive", "the matched loop ÷ a naive one (a sync per micro-step)", None),
    ("overhead", "no_sync_ratio_naive", "the naive loop with no_sync ÷ without: one sync per step", None),
    ("overhead", "raytrain_checkpoint_s", "raytrain: time per checkpoint beyond the median step, s", None),
    ("overhead", "matched_checkpoint_s", "the matched loop: the same (both save in the background)", None),
    (
        "input_pipeline",
        "parquet_over_hand_written",
        "Parquet path ÷ a hand-written Ray Data loop, samples/s",
        (">=", 0.95),
    ),
    ("input_pipeline", "data_wait_fraction", "Parquet path: data wait ÷ step time, W = 2", ("<=", 0.05)),
    (
        "input_pipeline",
        "data_wait_fraction_max_rank",
        "the same with the slowest rank's wait (agreed about once a second), W = 2",
        ("<=", 0.05),
    ),
    (
        "input_pipeline",
        "parquet_over_materialized",
        "Parquet path ÷ the materialized path, samples/s, same run",
        (">=", 0.95),
    ),
    (
        "input_pipeline",
        "materialized_control_ratio",
        "the materialized path run twice, second ÷ first (A/A): the noise floor",
        None,
    ),
    (
        "input_pipeline",
        "data_cpu_fraction_parquet_w2",
        "Parquet path: rank 0's data threads' CPU ÷ step time, W = 2 (cores: 2 workers on 2)",
        None,
    ),
    (
        "input_pipeline",
        "worker_rss_growth_bytes_parquet",
        "Parquet path: a worker's peak RSS growth, data set x4, bytes",
        None,
    ),
    (
        "input_pipeline",
        "worker_rss_growth_bytes_materialized",
        "materialized path: the same, bytes",
        None,
    ),
    ("input_pipeline", "position_checkpoint_bytes", "data position in a real checkpoint, bytes", None),
    (
        "input_pipeline",
        "read_amplification",
        "bytes read from storage in an epoch, all ranks ÷ the files' bytes, W = 4",
        ("<=", 1.1),
    ),
    ("input_pipeline", "read_amplification_one_partition", "the same with one partition (the layout before)", None),
    ("driver_index", "driver_index_s", "driver's index of 100,000 row groups in 10,000 files, s", ("<=", 30.0)),
    ("driver_index", "driver_index_rss_bytes", "its peak memory growth, bytes", ("<=", 1e9)),
    ("communication", "syncs_per_step_raytrain", "gradient syncs per optimizer step, DDP, k = 8", ("<=", 1.0)),
    ("communication", "syncs_per_step_naive", "the same for a naive accumulation loop", None),
    (
        "communication",
        "zero3_syncs_per_step_raytrain_sharded",
        "zero3 with grad_accumulation='sharded', k = 8: a sync per micro-step",
        None,
    ),
    ("parallel", "peak_ratio_zero3", "peak bytes per rank, zero3 dp 4 ÷ ddp dp 4", None),
    ("parallel", "peak_ratio_tp2pp2_vs_zero3", "peak bytes per rank, tp 2 x pp 2 ÷ zero3 dp 4", None),
    ("parallel", "bubble_1f1b", "pipeline bubble (largest stage's idle fraction), 1F1B, pp 4, 8 micro-batches", None),
    ("parallel", "bubble_interleaved_1f1b", "the same, interleaved 1F1B (2 chunks per stage)", None),
    ("parallel", "activation_peak_ratio_sp", "activation peak per rank, sequence parallel ÷ without, Llama tp 4", None),
    (
        "memory",
        "worst_planner_error",
        "memory planner vs measured peak, worst row (model state; activations excluded)",
        ("<=", 0.10),
    ),
    (
        "memory",
        "worst_planner_error_out_of_sample",
        "the same on torch's nn.TransformerEncoder, a model it was not written against, fp32",
        ("<=", 0.10),
    ),
    ("memory", "worst_planner_error_bf16", "the same model in bf16", ("<=", 0.10)),
    ("memory", "init_peak_fraction", "sharded build: init peak per rank ÷ model, zero3 W = 4", None),
    (
        "memory",
        "pretrained_load_peak_fraction",
        "pretrained load: RSS growth per rank ÷ model, zero3 W = 4",
        ("<=", 0.5),
    ),
    ("memory", "pretrained_load_read_fraction", "pretrained load: bytes read per rank ÷ model, zero3 W = 4", None),
    (
        "memory",
        "export_peak_fraction",
        "export of a zero3 checkpoint (24 tensors): RSS growth ÷ model",
        ("<=", 0.25),
    ),
    ("recovery", "sigkill_back_s", "a worker SIGKILLed → past the old group's last step, s", None),
    ("recovery", "bare_sigkill_back_s", "bare Ray Train (all-reduce loop), the same end point, s", None),
    ("recovery", "bare_sigkill_s", "bare Ray Train: SIGKILL → first step of the new group, s", None),
    ("recovery", "node_loss_s", "a node lost → first step at the smaller size, s", None),
    ("recovery", "node_loss_dead_node_wait_s", "of it: raytrain's wait for the GCS to mark the node dead, s", None),
    ("recovery", "node_add_s", "a node added → first step at the larger size (monitor 1 s), s", None),
    ("recovery", "drain_s", "an 8 s drain notice → first step of the smaller group, s", None),
    ("recovery", "node_loss_back_s", "a node lost without notice → past the old group's last step, s", None),
    ("recovery", "drain_steps_retrained", "a node drained with notice: steps trained again", ("<=", 0)),
    (
        "checkpoint_cost",
        "checkpoint_overhead_fraction",
        "training time lost to checkpoints every 10 steps, steps of ≥ 0.3 s of compute",
        ("<=", 0.05),
    ),
    ("checkpoint_cost", "checkpoint_stall_s", "of it: the training thread's own time per checkpoint, s", None),
    (
        "checkpoint_cost",
        "checkpoint_control_fraction",
        "the same fraction between two runs without checkpoints (A/A): the noise floor",
        None,
    ),
    ("recovery", "live_kill_pause_s", "live recovery: the survivors' stall after a kill, s", None),
    ("recovery", "live_heal_s", "live recovery: kill → first step at the pre-kill size again, s", None),
    (
        "recovery",
        "live_add_grown_s",
        "live recovery: a node added → first step a new replica group committed in, s",
        None,
    ),
    ("recovery", "live_loss_max_diff", "live recovery: loss vs the run without kills", ("<=", 1e-4)),
    ("goodput", "goodput_bare", "goodput, a SIGKILL every 50 steps: bare Ray Train, restart from its checkpoint", None),
    ("goodput", "goodput_restart", "goodput, the same kills: raytrain, recovery restart", None),
    ("goodput", "goodput_live", "goodput, the same kills: raytrain, recovery live (ddp replicas)", None),
    (
        "goodput",
        "goodput_live_hsdp",
        "goodput, the same kills: raytrain, recovery live (2 groups of dp_shard 2, zero3)",
        (">=", 0.9),
    ),
    ("goodput", "goodput_live_hsdp_over_restart", "goodput: live (HSDP) ÷ restart", (">=", 1.5)),
    (
        "goodput_node",
        "goodput_node_bare",
        "goodput, a node lost every 50 steps (replaced at once): bare Ray Train",
        None,
    ),
    ("goodput_node", "goodput_node_restart", "goodput, the same node losses: raytrain, recovery restart", None),
    (
        "goodput_node",
        "goodput_node_live_hsdp",
        "goodput, the same node losses: raytrain, recovery live (2 groups of dp_shard 2)",
        None,
    ),
    ("gpu", "mfu_ddp", "GPT-small (136 M), 1 H200, bf16: model FLOPs utilisation, raytrain's step, ddp", None),
    ("gpu", "mfu_zero3", "the same, zero3 (FSDP2)", None),
    ("gpu", "raytrain_over_hand_zero3", "the same: raytrain's zero3 ÷ FSDP2 written by hand, tokens/s", None),
]


def results_files() -> list[Path]:
    """The full (not --quick) results files in benchmarks/results/, oldest first."""
    files = [p for p in (HERE / "results").glob("*.json") if not p.stem.endswith("-quick")]
    return sorted(files, key=lambda p: (json.loads(p.read_text())["date"], p.name))


def resumed(results: dict[str, Any]) -> str:
    """ "" or, for a run continued with `run_all.py --resume`, how many sittings it took and the code they measured
    (one `code` hash: the same code in every part)."""
    parts = results.get("parts") or []
    if len(parts) < 2:
        return ""
    commits = ", ".join(part["commit"] for part in parts)
    return f", run in {len(parts)} parts on code {results.get('code')} (commits {commits})"


def newest_per_benchmark(files: list[Path]) -> tuple[dict[str, Any], str]:
    """One results dict holding, for each benchmark, its entry from the newest file in which it has the figures of
    all its repetitions (a `run_all.py --only` run replaces only the benchmarks it ran; one stopped part-way by
    `--deadline-s` only those it finished; a repetition that failed counts once a resumed run ran it again; a
    benchmark no row reads is left out), and the header naming every file used: which benchmarks came from which
    file, its date, commit, repetitions and failed repetitions run again."""
    chosen: dict[str, tuple[Path, dict[str, Any]]] = {}
    shown = {bench for bench, _, _, _ in ROWS}  # a benchmark no row reads (one retired) is not named
    for path in files:
        results = json.loads(path.read_text())
        for bench, entry in results["benchmarks"].items():
            runs = entry.get("runs") or []
            # every repetition there (a run stopped part-way, to be resumed, has fewer: not yet its figure)
            if bench in shown and len(runs) >= results.get("reps", 1):  # a failed one run again counts once it ran
                chosen[bench] = (path, results)
    if not chosen:
        sys.exit("no results file in benchmarks/results/: run python benchmarks/run_all.py first")
    by_file: dict[Path, tuple[dict[str, Any], list[str]]] = {}  # each file read once, above
    for bench, (path, results) in chosen.items():
        by_file.setdefault(path, (results, []))[1].append(bench)
    parts = []
    for path, (results, benches) in sorted(by_file.items(), key=lambda item: item[0].name):
        machine = results["machine"]
        failures = [
            f"{bench} {len(results['benchmarks'][bench]['failed'])}"
            for bench in sorted(benches)
            if results["benchmarks"][bench].get("failed")
        ]
        parts.append(
            f"{', '.join(sorted(benches))} from `benchmarks/results/{path.name}` ({results['date'][:10]}, commit "
            f"{results['commit']}{resumed(results)}, {results['reps']} repetition(s)"
            + (f", failed and run again: {', '.join(failures)} (tracebacks in the file)" if failures else "")
            + f"; {machine.get('cpus')} CPUs, {machine.get('memory_gb')} GB, GPU: {machine.get('gpu') or 'none'}; "
            f"torch {machine.get('torch')}, ray {machine.get('ray')})"
        )
    merged = {"benchmarks": {bench: results["benchmarks"][bench] for bench, (_, results) in chosen.items()}}
    return merged, "Sources: " + "; ".join(parts) + "."


def _number(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) < 1e-3:
        return f"{value:.1e}"
    if 0.1 <= abs(value) < 10:  # three decimals: a ratio of 1.003 is not printed as "1"
        return f"{value:.3f}".rstrip("0").rstrip(".")
    return f"{value:.3g}"


# A goal's figure -> (its A/A control: the same measurement between two runs of identical code, the value the control
# reads without noise). Where the control strays from that value by more than the goal's margin (|ideal - bound|),
# the verdict says so: the machine cannot tell whether the goal is met.
NOISE: dict[str, tuple[str, float]] = {
    "overhead_ratio": ("control_ratio", 1.0),
    "start_overhead_s": ("start_control_s", 0.0),
    "checkpoint_overhead_fraction": ("checkpoint_control_fraction", 0.0),
    "parquet_over_materialized": ("materialized_control_ratio", 1.0),
}


def noise_note(figures: dict[str, Any], key: str, bound: float) -> str:
    """ "" or, where `key`'s A/A control (`NOISE`) strayed further from its ideal than the goal's margin, a note
    naming the control's range: the verdict is then within this machine's noise."""
    if key not in NOISE or NOISE[key][0] not in figures:
        return ""
    control, ideal = NOISE[key]
    low, high = figures[control]["min"], figures[control]["max"]
    if max(abs(low - ideal), abs(high - ideal)) <= abs(ideal - bound):
        return ""
    return f" (within noise: A/A `{control}` {_number(low)}-{_number(high)})"


def render(results: dict[str, Any], name: str, head: str | None = None, goals_only: bool = False) -> str:
    """The markdown table of `results` (a run_all.py results file named `name`, or with `head` the merged
    results of `newest_per_benchmark`); `goals_only` (README's): the figures with a goal, and a line pointing to
    benchmarks/README.md for the rest."""
    if head is None:
        machine = results["machine"]
        head = (
            f"From `benchmarks/results/{name}` ({results['date'][:10]}, commit {results['commit']}{resumed(results)}, "
            f"{results['reps']} repetition(s) per script; {machine.get('cpus')} CPUs, {machine.get('memory_gb')} "
            f"GB, GPU: {machine.get('gpu') or 'none'}; torch {machine.get('torch')}, ray {machine.get('ray')}):"
        )
    lines = [head, "", "| figure | median (min-max) | goal |", "|---|---|---|"]
    left_out = 0
    for bench, key, what, goal in ROWS:
        figures = results["benchmarks"].get(bench, {}).get("figures", {})
        figure = figures.get(key)
        if figure is None:
            continue
        if goals_only and goal is None:
            left_out += 1
            continue
        spread = "" if figure["min"] == figure["max"] else f" ({_number(figure['min'])}-{_number(figure['max'])})"
        verdict = "-"
        if goal is not None:
            op, bound = goal
            worst = figure["max"] if op == "<=" else figure["min"]
            met = worst <= bound if op == "<=" else worst >= bound
            verdict = f"{op} {_number(bound)}: {'met' if met else '**missed**'}{noise_note(figures, key, bound)}"
        lines.append(f"| {what} (`{key}`) | {_number(figure['median'])}{spread} | {verdict} |")
    if left_out:
        lines += ["", f"{left_out} more figures (the baselines, A/A controls and parts): benchmarks/README.md."]
    failed = [b for b, v in results["benchmarks"].items() if v.get("failed")]
    if failed:
        lines += ["", f"Runs that failed (see the results file): {', '.join(failed)}."]
    return "\n".join(lines)


def write_between_markers(path: Path, table: str) -> None:
    text = path.read_text()
    pattern = re.compile(re.escape(START) + r"[^\n]*\n.*?" + re.escape(END), re.S)
    if not pattern.search(text):
        sys.exit(f"{path} has no {START} ... {END} markers")
    block = f"{START}: generated by benchmarks/tables.py from benchmarks/results/; do not edit -->\n{table}\n{END}"
    path.write_text(pattern.sub(lambda _: block, text))


def main() -> None:
    """`tables.py FILE`: the tables from one results file; `tables.py`: each benchmark from the newest file it ran
    in."""
    if len(sys.argv) > 1:
        path = Path(sys.argv[1])
        results, name, head = json.loads(path.read_text()), path.name, None
    else:
        results, head = newest_per_benchmark(results_files())
        name = ""
    table = render(results, name, head)
    write_between_markers(ROOT / "README.md", render(results, name, head, goals_only=True))
    write_between_markers(HERE / "README.md", table)
    print(table)


if __name__ == "__main__":
    main()
