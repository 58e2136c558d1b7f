"""All rank-0-only logic in one place: metrics, the sample audit, resize lines, progress and summaries.

Every rank builds a `Rank0Log`; on ranks other than 0 its methods do nothing, so the loop calls them
unconditionally. Files live in the run directory (local storage):
    metrics.jsonl   one line per committed-or-current optimizer step
    samples.jsonl   with audit on: {"step", "epoch", "ids"} per step
    events.jsonl    one line per (re)start of the worker group: world size before and after, plans, step
    raytrain.log    the lines printed on rank 0 (and the controller's restart lines), which the driver shows
On restart, lines for steps after the restored checkpoint are removed: those steps are replayed (the model
was rolled back too), so each file describes exactly one history.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

from raytrain.console import LOG_FILE
from raytrain.trackers import Tracker, numeric

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
EVENTS_FILE = "events.jsonl"


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The records of a JSON-lines file written here ([] when it does not exist yet). Stops at a line that is still
    being written, so it is safe to call while training appends to the file."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records


def _truncate_after(path: str, step: int) -> int:
    """Keep only the JSON lines of `path` whose "step" is <= `step`; return how many unreadable lines were dropped
    (a line torn by a crash or a full disk mid-write, which would otherwise break every later read)."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    records = read_jsonl(path)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records if r.get("step", 0) <= step)
    return len(lines) - len(records)


class Rank0Log:
    """Writes metrics and logs on rank 0; a no-op elsewhere. Not thread-safe; one per worker process."""

    def __init__(
        self,
        rank: int,
        run_dir: str | None,
        *,
        audit: bool,
        log_every: int,
        out: TextIO = sys.stdout,
        trackers: Sequence[Tracker] = (),
    ):
        self.active = rank == 0
        self.run_dir = run_dir
        self.audit = audit
        self.log_every = log_every
        self.out = out
        self.trackers = list(trackers) if self.active else []  # experiment trackers, rank 0 only
        self._tracking = False
        self._started = time.monotonic()
        self._files: dict[str, TextIO] = {}  # open for appending, one per file name, after `start` trimmed them
        self.total_steps: int | None = None  # for the progress bar, when known
        if self.active and run_dir:
            os.makedirs(run_dir, exist_ok=True)

    def _path(self, name: str) -> str | None:
        return os.path.join(self.run_dir, name) if self.run_dir else None

    def _write(self, name: str, line: str) -> None:
        """Append one line and flush it (a reader, e.g. the driver, follows the file while training runs)."""
        path = self._path(name)
        if not path:
            return
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = open(path, "a")  # noqa: SIM115  # kept open for the worker's lifetime
        f.write(line + "\n")
        f.flush()

    def _append(self, name: str, record: dict[str, Any]) -> None:
        self._write(name, json.dumps(record))

    def print(self, message: str) -> None:
        """Print one line on rank 0 and append it to the run's log (what the driver shows; `raytrain.console`)."""
        if self.active:
            line = f"[raytrain] {message}"
            # written, not print()ed: under a plain ray.init() Ray Train patches print() in its workers to log each
            # line and also print it, so a print appeared twice on the driver's terminal
            self.out.write(line + "\n")
            self.out.flush()
            self._write(LOG_FILE, line)

    def _last_event(self) -> dict[str, Any] | None:
        path = self._path(EVENTS_FILE)
        events = read_jsonl(path) if path else []
        return events[-1] if events else None

    def start(self, *, restored_step: int, event: dict[str, Any]) -> None:
        """Called once per (re)start, after restoring: trims replayed history, appends `event` (which holds at
        least world_size, plan, lr, strategy) to events.jsonl and logs the resize line against the previous start."""
        if not self.active:
            return
        self.close()  # the files are rewritten below; appends reopen them
        for tracker in self.trackers:
            tracker.start(self.run_dir or ".", restored_step)
        self._tracking = bool(self.trackers)
        for name in (METRICS_FILE, SAMPLES_FILE, EVENTS_FILE):
            path = self._path(name)
            if path and (torn := _truncate_after(path, restored_step if name != EVENTS_FILE else 2**62)):
                self.print(f"WARNING: {name}: dropped {torn} unreadable line(s) at its end (torn by a crash mid-write)")
        previous = self._last_event()
        event = {**event, "previous_world_size": previous["world_size"] if previous else None, "time": time.time()}
        self._append(EVENTS_FILE, event)
        # from step 0 nothing carries over: no "(as before)", though a resize before any checkpoint still shows
        resized = previous is not None and previous["plan"] != event["plan"]
        before = previous if restored_step or resized else None
        line = resize_line(
            before["plan"] if before else None,
            event["plan"],
            event["lr"],
            before["lr"] if before else None,
            event.get("layout"),
        )
        if restored_step:
            line += f", strategy {event['strategy']}, resumed at step {restored_step}"
        elif previous is not None:
            line += f", strategy {event['strategy']}, from step 0 (no checkpoint to resume from)"
        else:
            line += f", strategy {event['strategy']}"
        self.print(line)

    def step(self, metrics: dict[str, Any], sample_ids: Iterable[int] | None, shown: Sequence[str] = ()) -> None:
        """Record one finished optimizer step (and its sample ids when auditing). The progress line (every
        `log_every` steps, the first and the last) also comes at a step with a `val_loss`, which it shows, as it
        shows the numeric metrics named in `shown` (what the user's loop reported)."""
        if not self.active:
            return
        self._append(METRICS_FILE, metrics)
        if self._tracking:
            scalars = {k: v for k, v in numeric(metrics).items() if k not in ("step", "time")}
            for tracker in self.trackers:
                tracker.log(scalars, metrics["step"])
        if self.audit and sample_ids is not None:
            ids = [int(i) for i in sample_ids]
            self._append(SAMPLES_FILE, {"step": metrics["step"], "epoch": metrics["epoch"], "ids": ids})
        step = metrics["step"]
        validated = "val_loss" in metrics
        if step % self.log_every == 0 or step == 1 or step == self.total_steps or validated:  # the bar ends at 100 %
            rate = metrics["global_batch_size"] / max(metrics["step_time_s"], 1e-9)
            extra = "".join(
                f" | {name} {metrics[name]:.4g}"
                for name in ("val_loss", *shown)
                if isinstance(metrics.get(name), int | float) and not isinstance(metrics[name], bool)
            )
            self.print(
                f"{progress_bar(step, self.total_steps)}step {step:>5} | epoch {metrics['epoch']} | "
                f"loss {metrics['loss']:.4f}{extra} | "
                f"world {metrics['world_size']} | lr {metrics['lr']:.3e} | {rate:,.0f} samples/s"
            )

    def close(self) -> None:
        """Close the files `_append` keeps open and finish the trackers (the loop calls it when the worker's
        training ends)."""
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self._tracking:
            for tracker in self.trackers:
                tracker.finish()
            self._tracking = False

    def finish(self, summary: dict[str, Any]) -> None:
        """Print the end-of-run summary, with where the run's files are (a `fit()` from Python prints nothing
        else that says so)."""
        self.print(
            "done: "
            + ", ".join(f"{k} {v}" for k, v in summary.items())
            + f" ({time.monotonic() - self._started:.1f} s in this worker group)"
            + (f"; files in {self.run_dir}" if self.run_dir else "")
        )


def progress_bar(step: int, total: int | None, width: int = 20) -> str:
    """``[#######.............]  35% `` for `step` of `total`, or "" when the total is unknown."""
    if not total:
        return ""
    done = min(width, width * step // total)
    return f"[{'#' * done}{'.' * (width - done)}] {100 * step // total:>3}% "


def resize_line(
    previous: dict[str, Any] | None,
    current: dict[str, Any],
    lr: float,
    previous_lr: float | None,
    layout: dict[str, int] | None = None,
    lr_label: str = "peak lr",
) -> str:
    """The line logged when the worker group (re)starts, e.g.
    ``world 3 -> 2: accumulation 2 -> 3, samples/rank [32,32,32] -> [48,48], global batch 96 (unchanged),
    peak lr 3.0e-03 (unchanged)``: the LR the schedule peaks at (each step's own LR is on its progress line and in
    metrics.jsonl); `lr_label` names what `lr` is. `previous`/`current` are `BatchPlan.to_dict()` forms (computed
    for the data-parallel replicas). With a model-parallel `layout` ({"dp", "tp", "pp"}) the line names it:
    ``dp 2 -> 1, tp 2, pp 1: accumulation 1 -> 2, samples/replica [4,4] -> [8], ...``. A restart whose split is
    the one before (a kill, a resume at the same size and batch) says so instead of showing arrows:
    ``world 2 (as before): accumulation 2, samples/rank [64,64], global batch 256 (unchanged), ...``. `previous`
    None (a first start, or one from step 0 with nothing to resume) gives the split alone."""

    def samples(plan: dict[str, Any]) -> str:
        return "[" + ",".join(str(n) for n in plan["per_rank_samples"]) + "]"

    split = layout is not None and (layout.get("tp", 1) > 1 or layout.get("pp", 1) > 1)
    who, per = ("dp", "samples/replica") if split else ("world", "samples/rank")
    fixed = f", tp {layout['tp']}, pp {layout['pp']}" if split and layout is not None else ""
    if previous is None:
        return (
            f"{who} {current['world_size']}{fixed}: accumulation {current['accumulation_steps']}, "
            f"{per} {samples(current)}, global batch {current['global_batch']}, {lr_label} {lr:.1e}"
        )
    batch_note = (
        "(unchanged)" if previous["global_batch"] == current["global_batch"] else f"(was {previous['global_batch']})"
    )
    lr_note = (
        "(unchanged)" if previous_lr is None or abs(previous_lr - lr) <= 1e-12 * lr else f"(was {previous_lr:.1e})"
    )
    if all(previous[key] == current[key] for key in ("world_size", "accumulation_steps", "per_rank_samples")):
        return (  # a restart at the same size (a kill, a resume): nothing was resized
            f"{who} {current['world_size']}{fixed} (as before): accumulation {current['accumulation_steps']}, "
            f"{per} {samples(current)}, global batch {current['global_batch']} {batch_note}, "
            f"{lr_label} {lr:.1e} {lr_note}"
        )
    return (
        f"{who} {previous['world_size']} -> {current['world_size']}{fixed}: accumulation "
        f"{previous['accumulation_steps']} -> {current['accumulation_steps']}, {per} {samples(previous)} -> "
        f"{samples(current)}, global batch {current['global_batch']} {batch_note}, {lr_label} {lr:.1e} {lr_note}"
    )
