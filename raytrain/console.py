"""What a user sees on the driver: raytrain's own lines and real errors, not Ray's internals.

By default Ray instances raytrain starts or joins are initialised with `log_to_driver=False` (no worker, actor or
raylet output on the driver) and Ray's driver-side INFO logging and Data progress bars are turned off. What raytrain
has to say reaches the driver through the run's log file, `<run>/raytrain.log`: rank 0 appends its lines (start,
resize, progress, summary) and the controller callback `raytrain.ray_hooks.RunLog` appends one line per restart,
resize or failure; `RunLogTail` prints new lines while training runs. `RAYTRAIN_VERBOSE=1` (`raytrain --verbose`)
keeps Ray's own output instead (then nothing is tailed: the lines arrive through Ray).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any, TextIO

LOG_FILE = "raytrain.log"
VERBOSE_ENV = "RAYTRAIN_VERBOSE"
# Ray initialised quietly by raytrain; where lines go; whether the caller says where a Ctrl-C left the run
_state: dict[str, Any] = {"quiet": False, "out": None, "caller_says_interrupt": False}


def counted(count: int, noun: str) -> str:
    """`count` and `noun` as a line says them: "1 worker", "2 workers", "0 nodes" (regular plurals only)."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def set_output(stream: TextIO | None) -> None:
    """Send raytrain's driver lines to `stream` (None: stdout); `--json` sends them to stderr."""
    _state["out"] = stream


def output() -> TextIO:
    """Where raytrain's driver lines go (stdout unless `set_output` chose otherwise)."""
    return _state["out"] or sys.stdout


def leave_interrupt_line_to_caller(leave: bool) -> None:
    """Set by the `raytrain` CLI while it runs a command (and unset after): it says where a Ctrl-C left the run
    and the command that resumes it, so `fit()` does not say it too (one line, not two)."""
    _state["caller_says_interrupt"] = leave


def interrupt_line_left_to_caller() -> bool:
    """The flag `leave_interrupt_line_to_caller` last set (False before any call): whether `fit()` leaves the
    line on a Ctrl-C to its caller."""
    return bool(_state["caller_says_interrupt"])


DETAIL_PREFIX = "[raytrain:detail]"  # raytrain.log lines kept for the record, not echoed on the console


def say(message: str) -> None:
    """Print one `[raytrain] ...` line on the driver."""
    print(f"[raytrain] {message}", file=output(), flush=True)


def verbose() -> bool:
    """True when the user asked for Ray's own output (`RAYTRAIN_VERBOSE=1`)."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def quiet_ray_logging() -> None:
    """Ray's driver-side loggers at WARNING (unless `verbose()`); call before starting or joining Ray. Imports
    Ray Data first: its import configures the "ray.data" logger (DEBUG, an INFO handler on stderr), which set after
    this printed `INFO streaming_executor ...` lines each time the driver read a dataset."""
    if not verbose():
        import ray.data  # noqa: F401  # its logging configuration, done now, before the levels below

        for name in ("ray", "ray.data", "ray.train"):
            logging.getLogger(name).setLevel(logging.WARNING)
        # "Progress bars disabled" (a warning) each time the driver executes a dataset: raytrain disabled them
        logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)


def init_ray(**kwargs: Any) -> None:
    """`ray.init(**kwargs)`, quiet unless `verbose()`: no worker/actor/raylet output forwarded to the driver, Ray's
    driver loggers at WARNING, no Ray Data progress bars. `is_quiet()` says which happened."""
    import ray

    quiet = not verbose()
    if quiet:
        kwargs.setdefault("log_to_driver", False)
        kwargs.setdefault("logging_level", logging.WARNING)
        quiet_ray_logging()
    ray.init(**kwargs)
    if quiet:
        from ray.data import DataContext

        from raytrain.ray_hooks import quiet_driver_error_messages

        DataContext.get_current().enable_progress_bars = False
        quiet_driver_error_messages()
    _state["quiet"] = quiet and not kwargs.get("log_to_driver", False)


def is_quiet() -> bool:
    """True when raytrain initialised Ray without forwarding worker output: its lines must be tailed."""
    import ray

    return _state["quiet"] and ray.is_initialized()


class RunLogTail:
    """Prints the lines appended to `<run_dir>/raytrain.log` after `start`, from a background thread, until `stop`
    (which prints what is left). Used by `ElasticTrainer.fit` when `is_quiet()`."""

    def __init__(self, run_dir: str, out: TextIO | None = None, interval_s: float = 0.2) -> None:
        self.path = os.path.join(run_dir, LOG_FILE)
        self.out = out or output()
        self.interval_s = interval_s
        self._offset = os.path.getsize(self.path) if os.path.exists(self.path) else 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raytrain-log-tail", daemon=True)

    def start(self) -> RunLogTail:
        """Start following the file; returns self."""
        self._thread.start()
        return self

    def _print_new(self) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            f.seek(self._offset)
            text = f.read()
        complete = text[: text.rfind("\n") + 1]  # a line still being written waits for the next round
        self._offset += len(complete.encode())
        shown = "".join(line for line in complete.splitlines(keepends=True) if not line.startswith(DETAIL_PREFIX))
        if shown:
            self.out.write(shown)
            self.out.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._print_new()

    def stop(self) -> None:
        """Stop the thread and print the lines written since the last round."""
        self._stop.set()
        self._thread.join()
        self._print_new()


def append_line(run_dir: str | None, line: str) -> None:
    """Append one line to `<run_dir>/raytrain.log` (no-op without a run directory)."""
    if run_dir:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, LOG_FILE), "a") as f:
            f.write(line.rstrip("\n") + "\n")
