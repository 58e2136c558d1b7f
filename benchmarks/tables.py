"""python benchmarks/tables.py [RESULTS.json]

Writes the headline table of a results file (`run_all.py`'s; default: the newest full run in benchmarks/results/)
between the `benchmark-table` markers of README.md and benchmarks/README.md, naming the file it came from. Each
row is one figure: its median over the repetitions with min-max, and whether its goal is met by the *worst*
repetition (max for an upper bound, min for a lower bound). A figure the results file lacks is left out; nothing
is typed by hand.
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
    ("overhead", "design_ratio_matched_vs_naive", "the matched loop ÷ a naive one (a sync per micro-step)", None),
    (
        "input_pipeline",
        "parquet_over_hand_written",
        "Parquet path ÷ a hand-written Ray Data loop, samples/s",
        (">=", 0.95),
    ),
    ("input_pipeline", "data_wait_fraction", "Parquet path: data wait ÷ step time, W = 2", ("<=", 0.05)),
    ("communication", "syncs_per_step_raytrain", "gradient syncs per optimizer step, DDP, k = 8", ("<=", 1.0)),
    ("communication", "syncs_per_step_naive", "the same for a naive accumulation loop", None),
    ("memory", "worst_planner_error", "memory planner vs measured peak, worst row", ("<=", 0.10)),
    ("memory", "init_peak_fraction", "sharded build: init peak per rank ÷ model, zero3 W = 4", None),
    (
        "memory",
        "pretrained_load_peak_fraction",
        "pretrained load: RSS growth per rank ÷ model, zero3 W = 4",
        ("<=", 0.5),
    ),
    ("memory", "pretrained_load_read_fraction", "pretrained load: bytes read per rank ÷ model, zero3 W = 4", None),
    ("recovery", "sigkill_s", "a worker SIGKILLed → first step of the new group, s", None),
    ("recovery", "bare_sigkill_s", "bare Ray Train: SIGKILL → train_func entered again, s", None),
    ("recovery", "node_loss_s", "a node lost → first step at the smaller size, s", None),
    ("recovery", "node_add_s", "a node added → first step at the larger size, s", None),
    ("recovery", "drain_steps_retrained", "a node drained with notice: steps trained again", ("<=", 0)),
    ("recovery", "checkpoint_overhead_fraction", "training time lost to checkpoints every 5 steps", ("<=", 0.05)),
    ("recovery_live", "live_kill_pause_s", "live recovery: kill → next committed step, s", None),
    ("recovery_live", "live_loss_max_diff", "live recovery: loss vs the run without kills", ("<=", 1e-4)),
]


def newest_results() -> Path:
    files = sorted(
        (p for p in (HERE / "results").glob("*.json") if not p.stem.endswith("-quick")), key=lambda p: p.stat().st_mtime
    )
    if not files:
        sys.exit("no results file in benchmarks/results/: run python benchmarks/run_all.py first")
    return files[-1]


def _number(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) < 1e-3:
        return f"{value:.1e}"
    return f"{value:.3g}"


def render(results: dict[str, Any], name: str) -> str:
    """The markdown table of `results` (a run_all.py results file named `name`)."""
    machine = results["machine"]
    head = (
        f"From `benchmarks/results/{name}` ({results['date'][:10]}, commit {results['commit']}, "
        f"{results['reps']} repetition(s) per script; {machine.get('cpus')} CPUs, {machine.get('memory_gb')} GB, "
        f"GPU: {machine.get('gpu') or 'none'}; torch {machine.get('torch')}, ray {machine.get('ray')}):"
    )
    lines = [head, "", "| figure | median (min-max) | goal |", "|---|---|---|"]
    for bench, key, what, goal in ROWS:
        figure = results["benchmarks"].get(bench, {}).get("figures", {}).get(key)
        if figure is None:
            continue
        spread = "" if figure["min"] == figure["max"] else f" ({_number(figure['min'])}-{_number(figure['max'])})"
        verdict = "-"
        if goal is not None:
            op, bound = goal
            worst = figure["max"] if op == "<=" else figure["min"]
            met = worst <= bound if op == "<=" else worst >= bound
            verdict = f"{op} {_number(bound)}: {'met' if met else '**missed**'}"
        lines.append(f"| {what} (`{key}`) | {_number(figure['median'])}{spread} | {verdict} |")
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
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else newest_results()
    table = render(json.loads(path.read_text()), path.name)
    for target in (ROOT / "README.md", HERE / "README.md"):
        write_between_markers(target, table)
    print(table)


if __name__ == "__main__":
    main()
