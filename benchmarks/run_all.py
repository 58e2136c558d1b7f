"""python benchmarks/run_all.py [--quick] [--reps 3] [--only memory,parallel] [--resume FILE] [--deadline-s S]

One run regenerates every figure: each benchmark script runs `--reps` times (each a fresh process, so a repetition
sees the machine as it is then), the last line of each run (its JSON headline) is kept, and every numeric figure
is summarised as min / median / max over the repetitions. A goal is "met" only when the worst repetition meets it
(`tables.py`). The results file is

    benchmarks/results/<YYYY-MM-DD>-<commit>.json   {"machine", "versions", "commit", "code", "date", "settings",
                                                     "complete", "parts", "benchmarks": {name: {"runs": [...],
                                                     "figures": {key: {"min", "median", "max"}}, "wall_s",
                                                     "failed"}}}

and `python benchmarks/tables.py` writes README's and benchmarks/README.md's tables from it. `--quick` runs each
script once with its own `--quick`, narrowed to raytrain's loop and its baseline where that runs several
(`QUICK_ONLY`; goodput.py once, as goodput_node): a smoke run of the harness and of every script, its figures not
meant to be read (`python -m pytest -m benchmark` runs each script's whole `--quick`). GPU benchmarks are run only
where CUDA is present (`gpu_check.py`, then `gpu.py`). `--only` runs the benchmarks named, in the order named.

A full run takes about 2 hours on a 2-core machine (6809 s on 2026-12-06; `benchmarks/README.md` lists each script's
time), more than one sitting may have. The file is written after every repetition; `--resume FILE` continues it,
running only the repetitions it lacks (a repetition that failed is run again: its traceback stays under "failed"),
and refuses unless the code measured is the same: `code` hashes the content of every tracked file under raytrain/,
of benchmarks/*.py but tables.py and of pyproject.toml (a commit that changes only docs, results or the tables'
rendering keeps it).
`--deadline-s S` starts no repetition that would, at the longest time that benchmark took before (in this file or
the newest other results file), end more than S seconds after the start: the run stops cleanly, to be resumed.
Each invocation is one entry of `parts` (its commit, start and seconds).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
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
    "recovery": ["recovery.py"],  # its headline holds the live figures too (`recovery.py --live-only`: those alone)
    "goodput": ["goodput.py"],
    "goodput_node": ["goodput.py", "--events", "node"],
    "startup": ["startup.py", "--reps", "1"],
}
GPU_BENCHMARKS: dict[str, list[str]] = {"gpu_check": ["gpu_check.py"], "gpu": ["gpu.py"]}
# name -> the arguments `run_all.py --quick` adds to a script's `--quick` where that runs several loops: the smoke
# run keeps raytrain's own (and the baseline it is compared with), so that it stays under 5 minutes; `python -m
# pytest -m benchmark` runs each script's whole `--quick`
QUICK_ONLY: dict[str, list[str]] = {
    "input_pipeline": ["--only", "parquet"],
    "checkpoint_cost": ["--only", "none,background"],
    "overhead": ["--only", "raytrain,matched"],
    "goodput_node": ["--only", "live"],
}
QUICK_LEAVES_OUT = {"goodput"}  # goodput.py runs once in the smoke run, as goodput_node


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


# what `code` hashes: what a figure depends on (tables.py only renders the figures)
CODE_PATHS = ["raytrain", "benchmarks/*.py", ":(exclude)benchmarks/tables.py", "pyproject.toml"]


def code_hash() -> str:
    """A hash of what a figure depends on: the path and the content, as on disk now, of every tracked file in
    `CODE_PATHS` (committed or not); "unknown" without git."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--", *CODE_PATHS], capture_output=True, text=True, cwd=HERE.parent, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    digest = hashlib.sha1()
    for path in sorted(listed.stdout.split()):
        file = HERE.parent / path
        digest.update(path.encode() + b"\0" + (file.read_bytes() if file.exists() else b"<deleted>") + b"\0")
    return digest.hexdigest()[:12]


def longest_before(name: str, results: dict[str, Any], others: list[Path]) -> float | None:
    """The longest one repetition of benchmark `name` took: in `results` (this run), else in the newest other full
    results file that ran it; None where none did."""
    seconds = results["benchmarks"].get(name, {}).get("wall_s") or []
    if seconds:
        return float(max(seconds))
    for path in sorted(others, key=lambda p: p.name, reverse=True):
        try:
            earlier = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        seconds = earlier.get("benchmarks", {}).get(name, {}).get("wall_s") or []
        if seconds and not earlier.get("quick"):
            return float(max(seconds))
    return None


def run_once(args: list[str], quick: bool, timeout_s: float, rep: int = 0) -> tuple[dict[str, Any] | None, str, float]:
    """One run of a benchmark script: (its headline, the tail of its output, seconds). `rep` (0-based) reaches the
    script as BENCHMARK_REP, so that a script alternating its runs starts each repetition with another one. The
    tail of a failed run holds the last lines of its standard error too (the traceback says why it failed)."""
    command = [sys.executable, str(HERE / args[0]), *args[1:], *(["--quick"] if quick else [])]
    started = time.monotonic()
    env = {**os.environ, "BENCHMARK_REP": str(rep)}

    def text(stream: str | bytes | None) -> str:
        return stream.decode(errors="replace") if isinstance(stream, bytes) else (stream or "")

    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=HERE, env=env)
        output, errors, code = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        output, errors, code = text(err.stdout), text(err.stderr) + f"\ntimed out after {timeout_s:.0f} s", -9
    seconds = time.monotonic() - started
    lines = [line for line in output.strip().splitlines() if line.strip()]
    headline = None
    if code == 0 and lines:
        try:
            headline = json.loads(lines[-1])
        except json.JSONDecodeError:
            headline = None
    tail = lines[-20:]
    if headline is None:
        tail += [f"--- standard error (exit status {code}), last lines:"]
        tail += [line for line in errors.strip().splitlines() if line.strip()][-20:]
    return headline, "\n".join(tail), seconds


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
    parser.add_argument("--quick", action="store_true", help="each script once with --quick, narrowed (a smoke run)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each script (default %(default)s)")
    parser.add_argument("--only", default="", help="comma-separated benchmark names, run in that order (default: all)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one run may take (default %(default)s)")
    parser.add_argument("--out", default=None, help="results file (default benchmarks/results/<date>-<commit>.json)")
    parser.add_argument("--resume", default=None, help="a results file to continue: only its missing repetitions run")
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="start no repetition expected to end later than this many seconds after the start",
    )
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
        wanted = [name for name in args.only.split(",") if name]
        unknown = sorted(set(wanted) - set(chosen))
        if unknown:
            parser.error(f"unknown benchmark(s) {unknown}; known: {sorted(chosen)}")
        chosen = {name: chosen[name] for name in wanted}
    if args.quick:  # a benchmark left out of the smoke run still runs where --only names it
        quick = {name: argv + QUICK_ONLY.get(name, []) for name, argv in chosen.items()}
        chosen = {name: argv for name, argv in quick.items() if args.only or name not in QUICK_LEAVES_OUT}
    reps = 1 if args.quick else args.reps
    started = time.monotonic()
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    here_commit, code = args.commit or commit(), code_hash()
    if args.resume:
        out = Path(args.resume)
        results = json.loads(out.read_text())
        if results.get("code") != code or code == "unknown":
            parser.error(
                f"--resume {out}: it measured code {results.get('code')!r}, this tree is {code!r}: a resumed run "
                "must measure the same code (raytrain/, benchmarks/*.py and pyproject.toml as they were)"
            )
        if results.get("reps") != reps or bool(results.get("quick")) != args.quick:
            parser.error(
                f"--resume {out}: it ran reps={results.get('reps')} quick={results.get('quick')}, "
                f"this run asks reps={reps} quick={args.quick}: pass the same --reps and --quick"
            )
        results["settings"].update(chosen)
    else:
        results = {
            "date": now,
            "commit": here_commit,
            "code": code,
            "machine": machine(),
            "quick": args.quick,
            "reps": reps,
            "settings": {name: argv for name, argv in chosen.items()},
            "benchmarks": {},
            "parts": [],
        }
        day = results["date"][:10]
        name = f"{day}-{results['commit']}{'-quick' if args.quick else ''}.json"
        out = Path(args.out) if args.out else RESULTS / name
    results["complete"] = False  # True once every chosen benchmark has all its repetitions
    part = {"commit": here_commit, "date": now, "wall_s": 0.0}
    results.setdefault("parts", []).append(part)
    out.parent.mkdir(parents=True, exist_ok=True)
    others = [p for p in RESULTS.glob("*.json") if p.resolve() != out.resolve()]
    stopped = None
    for name, argv in chosen.items():
        entry = results["benchmarks"].setdefault(name, {"runs": [], "figures": {}, "wall_s": [], "failed": []})
        for rep in range(len(entry["runs"]), reps):  # a failed repetition is lacking: a resumed run tries it again
            expected = longest_before(name, results, others)
            elapsed = time.monotonic() - started
            if args.deadline_s is not None and elapsed + (expected or 0.0) > args.deadline_s:
                stopped = f"{name} {rep + 1}/{reps} (up to {expected or 0:.0f} s) would end past --deadline-s"
                break
            headline, tail, took = run_once(argv, args.quick, args.timeout, rep)
            print(f"[run_all] {name} {rep + 1}/{reps}: {'ok' if headline else 'FAILED'} in {took:.0f} s", flush=True)
            entry["wall_s"].append(round(took, 1))
            if headline is None:
                entry["failed"].append(tail)
            else:
                entry["runs"].append(headline)
            entry["figures"] = summarise(entry["runs"])
            # Written after every repetition: a run stopped part-way keeps what it measured (`complete` stays False)
            part["wall_s"] = round(time.monotonic() - started, 1)
            results["wall_s"] = round(sum(p["wall_s"] for p in results["parts"]), 1)
            out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        if stopped:
            break
    results["complete"] = stopped is None and all(
        len(results["benchmarks"].get(name, {}).get("runs", [])) >= reps for name in chosen
    )
    part["wall_s"] = round(time.monotonic() - started, 1)
    results["wall_s"] = round(sum(p["wall_s"] for p in results["parts"]), 1)
    out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    failed = [name for name, b in results["benchmarks"].items() if b["failed"]]
    print(
        f"[run_all] wrote {out} in {part['wall_s']:.0f} s"
        + (f"; stopped before {stopped}: continue with --resume {out}" if stopped else "")
        + (f"; FAILED: {', '.join(failed)}" if failed else ""),
        flush=True,
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
