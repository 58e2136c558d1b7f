"""python benchmarks/run_all.py [--quick] [--reps 3] [--only memory,parallel]

One run regenerates every figure: each benchmark script runs `--reps` times (each a fresh process, so a repetition
sees the machine as it is then), the last line of each run (its JSON headline) is kept, and every numeric figure
is summarised as min / median / max over the repetitions. A goal is "met" only when the worst repetition meets it
(`tables.py`). The results file is

    benchmarks/results/<YYYY-MM-DD>-<commit>.json   {"machine", "versions", "commit", "date", "settings", "complete",
                                                     "benchmarks": {name: {"runs": [...], "figures": {key:
                                                     {"min", "median", "max"}}, "wall_s", "failed"}}}

and `python benchmarks/tables.py` writes README's and benchmarks/README.md's tables from it. `--quick` runs each
script once with its own `--quick` (a smoke run: figures not meant to be read). GPU benchmarks are run only where
CUDA is present (`gpu_check.py`, then `gpu.py`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

# name -> the script's arguments (without --quick); each prints its headline as its last line
BENCHMARKS: dict[str, list[str]] = {
    "memory": ["memory.py"],
    "communication": ["communication.py"],
    "parallel": ["parallel.py"],
    "input_pipeline": ["input_pipeline.py", "--reps", "1"],
    "driver_index": ["driver_index.py"],
    "checkpoint_cost": ["checkpoint_cost.py", "--reps", "1"],
    "overhead": ["overhead.py", "--reps", "1"],
    "recovery": ["recovery.py"],
    "recovery_live": ["recovery.py", "--live-only"],
    "goodput": ["goodput.py"],
    "goodput_node": ["goodput.py", "--events", "node"],
}
GPU_BENCHMARKS: dict[str, list[str]] = {"gpu_check": ["gpu_check.py"], "gpu": ["gpu.py"]}


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]}
    try:
        with open("/proc/meminfo") as f:
            info["memory_gb"] = round(int(f.readline().split()[1]) / 1e6, 1)
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((line.split(":", 1)[1].strip() for line in f if "model name" in line), "")
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    try:
        import ray

        info["ray"] = ray.__version__
    except ImportError:
        pass
    return info


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], capture_output=True, text=True, cwd=HERE)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=HERE
        )
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def run_once(args: list[str], quick: bool, timeout_s: float, rep: int = 0) -> tuple[dict[str, Any] | None, str, float]:
    """One run of a benchmark script: (its headline, the tail of its output, seconds). `rep` (0-based) reaches the
    script as BENCHMARK_REP, so that a script alternating its runs starts each repetition with another one."""
    command = [sys.executable, str(HERE / args[0]), *args[1:], *(["--quick"] if quick else [])]
    started = time.monotonic()
    env = {**os.environ, "BENCHMARK_REP": str(rep)}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=HERE, env=env)
        output, code = done.stdout, done.returncode
    except subprocess.TimeoutExpired as err:
        output, code = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or ""), -9
    seconds = time.monotonic() - started
    lines = [line for line in output.strip().splitlines() if line.strip()]
    headline = None
    if code == 0 and lines:
        try:
            headline = json.loads(lines[-1])
        except json.JSONDecodeError:
            headline = None
    return headline, "\n".join(lines[-20:]), seconds


def summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """min / median / max of every numeric (not boolean) figure over the runs that have it."""
    keys = {
        key
        for run in runs
        for key, value in run.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }
    out = {}
    for key in sorted(keys):
        values = [
            run[key] for run in runs if isinstance(run.get(key), int | float) and not isinstance(run.get(key), bool)
        ]
        out[key] = {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="each script once with --quick (a smoke run)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each script (default %(default)s)")
    parser.add_argument("--only", default="", help="comma-separated benchmark names (default: all)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one run may take (default %(default)s)")
    parser.add_argument("--out", default=None, help="results file (default benchmarks/results/<date>-<commit>.json)")
    parser.add_argument(
        "--commit",
        default=None,
        help="the commit measured, where the tree is a copy without git (a GPU machine's); default: git's HEAD",
    )
    args = parser.parse_args()
    chosen = {**BENCHMARKS}
    try:
        import torch

        if torch.cuda.is_available():
            chosen.update(GPU_BENCHMARKS)
    except ImportError:
        pass
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - set(chosen)
        if unknown:
            parser.error(f"unknown benchmark(s) {sorted(unknown)}; known: {sorted(chosen)}")
        chosen = {name: argv for name, argv in chosen.items() if name in wanted}
    reps = 1 if args.quick else args.reps
    started = time.monotonic()
    results: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": args.commit or commit(),
        "machine": machine(),
        "quick": args.quick,
        "reps": reps,
        "settings": {name: argv for name, argv in chosen.items()},
        "benchmarks": {},
        "complete": False,  # True once every chosen benchmark ran
    }
    day = results["date"][:10]
    out = Path(args.out) if args.out else RESULTS / f"{day}-{results['commit']}{'-quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, argv in chosen.items():
        runs, tails, seconds = [], [], []
        for rep in range(reps):
            headline, tail, took = run_once(argv, args.quick, args.timeout, rep)
            print(f"[run_all] {name} {rep + 1}/{reps}: {'ok' if headline else 'FAILED'} in {took:.0f} s", flush=True)
            seconds.append(round(took, 1))
            if headline is None:
                tails.append(tail)
            else:
                runs.append(headline)
        results["benchmarks"][name] = {
            "runs": runs,
            "figures": summarise(runs),
            "wall_s": seconds,
            "failed": tails,
        }
        # Written after every benchmark: a run stopped part-way keeps what it measured (`complete` stays False)
        results["wall_s"] = round(time.monotonic() - started, 1)
        out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    results["complete"] = True
    out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    failed = [name for name, b in results["benchmarks"].items() if b["failed"]]
    print(f"[run_all] wrote {out} in {results['wall_s']:.0f} s" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
