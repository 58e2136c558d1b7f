"""Helpers shared by the benchmark scripts (not a benchmark itself): tables, the JSON headline line, gloo worlds
started with torch.multiprocessing, Ray start-up with raytrain's environment defaults, per-step timestamps.

The scripts import this as `_common` (they run as `python benchmarks/<name>.py`, so `benchmarks/` is on sys.path).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import sys
from collections.abc import Sequence
from typing import Any

# Quiet Ray before anything imports it.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "1")


# ---------------------------------------------------------------- output


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: left-aligned first column, right-aligned others."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def print_headline(result: dict[str, Any]) -> None:
    """The last line of every benchmark: one JSON object with its headline figures."""
    sys.stdout.flush()
    print(json.dumps(result, sort_keys=False), flush=True)


def machine_line() -> str:
    """Load average and core count: the timing figures depend on what else runs on the machine."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"machine: {os.cpu_count()} CPUs, load average (1/5/15 min) {load}"


def quiet_fsdp_warnings() -> None:
    """FSDP2 warns that a Sequential ending in Flatten returns a view; the benchmarks do no in-place op on it."""
    import warnings

    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")


def first_rep() -> int:
    """The repetition this process starts at: `run_all.py` runs a script once per repetition and says which in
    BENCHMARK_REP (0 when run by hand), so that runs alternated per repetition rotate across its repetitions too."""
    return int(os.environ.get("BENCHMARK_REP", "0"))


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# ---------------------------------------------------------------- gloo worlds without Ray


# ---------------------------------------------------------------- Ray


def start_ray(num_cpus: int = 4) -> None:
    """A lean local Ray instance under raytrain's Ray environment defaults (so every loop runs under the same
    settings): 4 logical CPUs leave room for Ray Data beside 2 training workers on a 2-core machine.

    Guard against other Ray clusters on the same machine: Ray Train V2's PlacementGroupCleaner asks the Ray
    *state API* whether the run's controller is alive. Without an explicit address it finds the API server
    through /tmp/ray/ray_current_cluster, i.e. the most recently started cluster on the machine, which may be
    someone else's; that dashboard answers "no such actor", the cleaner concludes the controller is dead and
    removes the live run's placement group ("A worker health check failed ... Destroying worker since its
    placement group was removed"). Seen here while other sessions ran Ray. Our instance has no dashboard, so
    point the state API at an address where nothing listens (`raytrain.trainer.mute_state_api`): the cleaner
    then only logs "Failed to query" (which it tolerates) and never removes a placement group of a live run.
    """
    import ray

    from raytrain.trainer import apply_ray_env_defaults, mute_state_api

    os.environ.pop("RAY_ADDRESS", None)
    mute_state_api()  # inherited by raylet and workers
    apply_ray_env_defaults()
    # address="local": always a fresh instance of our own, even when another Ray cluster runs on the machine.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)


def stop_ray() -> None:
    """Shut Ray down before the results are printed: Ray's own warnings reach stdout asynchronously, and the
    JSON line must be the last one."""
    import ray

    ray.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------- per-step timestamps


def steady_rate(times: Sequence[float], skip: int) -> float:
    """Steps per second over the window after the first `skip` steps: (n - 1) / (t_last - t_first)."""
    window = list(times)[skip:]
    if len(window) < 2:
        return float("nan")
    return (len(window) - 1) / (window[-1] - window[0])


def median_interval_rate(times: Sequence[float], skip: int) -> float:
    """1 / median interval between consecutive steps after `skip` steps (ignores occasional stalls)."""
    window = list(times)[skip:]
    intervals = [b - a for a, b in itertools.pairwise(window)]
    return 1.0 / median(intervals) if intervals else float("nan")
