"""The driver's watch until Ray Train's controller begins the run: `fit()` never waits without saying for what.

`ElasticTrainer.fit` blocks in Ray Train's `ray.get(controller.run.remote())`. Once the controller's run loop has
begun, `raytrain.ray_hooks.RunLog` (in the controller) says whatever the run waits for: room for its workers, a
restart, a resize. Before that, nothing would. The controller's process may be slow to start (a runtime environment
being set up, a node short of memory), or, seen once here (docs/architecture.md, stop 56), the GCS has the
controller alive while this driver never learnt it and so never delivered the `run` call: `fit()` waited with no
word and no end.

`StartWatch` is a driver thread: until `RunLog`'s first state change writes `<run_dir>/STARTED_FILE`
(`mark_began`), it says after `SAY_AFTER_S` seconds, then every `REPEAT_S`, what the GCS knows of the controller
actor and what that means (`describe_controller_wait`). That first state change comes in the controller's `run`;
only when one of Ray Train's start callbacks fails does it come in the constructor, and the run then ends at once
with that error. The watch changes nothing about the run: Ctrl-C stops it, and the same run started again resumes
from the newest checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from raytrain.console import append_line, say

STARTED_FILE = ".controller-began"  # in the run directory: written by the controller when its run loop begins
SAY_AFTER_S = 30.0  # seconds from `fit()` handing over to Ray Train until the first line
REPEAT_S = 60.0  # then one line per this many seconds


def mark_began(run_dir: str) -> None:
    """In the controller, at its first state change: record that the run loop has begun (`STARTED_FILE`). Never
    raises: Ray Train would fail the run for a callback's exception, and a mark not written only leaves the watch
    talking."""
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, STARTED_FILE), "w") as f:
            f.write(f"{os.getpid()} {time.time():.3f}\n")
    except OSError:
        pass


def still_waiting(repeat_s: float) -> str:
    """The end of every wait line: it goes on, how often it is said, and what the user can do."""
    return (
        f"still waiting (said again every {repeat_s:.0f} s; Ctrl-C stops it, and the same run started again in a new "
        "process resumes from the newest checkpoint)"
    )


def _named(actor: str, actor_id: str | None) -> str:
    """An actor in words, with the start of its id when known."""
    return actor + (f" (actor {actor_id[:12]})" if actor_id is not None else "")


def describe_controller_wait(
    waited_s: float, actor_id: str | None, record: dict[str, Any] | None, now_ms: float, repeat_s: float = REPEAT_S
) -> str:
    """One line on a controller that has not begun the run `waited_s` seconds after `fit()` handed over.

    `actor_id` is the controller's actor id (hex), None while raytrain has no handle on it; `record` the GCS's
    actor record (`raytrain.ray_hooks.actor_record`: `State`, `StartTime` in ms, `DeathCause` as text), None when
    the GCS has none or does not answer; `now_ms` the wall clock in ms; `repeat_s` how often the line is repeated."""
    controller = _named("Ray Train's controller", actor_id)
    head = f"{controller} has not begun the run {waited_s:.0f} s after fit() started it"
    tail = still_waiting(repeat_s)
    if actor_id is None:
        why = (
            "raytrain has no handle on its actor yet (Ray Train creates it once the training function and its "
            "arguments are stored; raytrain sees the handle when fit() runs in the main thread)"
        )
        return f"{head}: {why}; {tail}"

    def alive(alive_s: float) -> str:
        return (
            f"the GCS has had it alive for {alive_s:.0f} s, yet its run loop has not begun, so Ray Train's run call "
            "has not reached it (seen here once: this driver never got the actor's ALIVE notification, "
            "docs/guide.md#troubleshooting)"
        )

    return f"{head}: {gcs_state_words(record, now_ms, alive, 'before beginning')}; {tail}"


def describe_actor_wait(
    actor: str,
    call: str,
    waited_s: float,
    actor_id: str | None,
    record: dict[str, Any] | None,
    now_ms: float,
    repeat_s: float = REPEAT_S,
) -> str:
    """One line on a call to an actor of raytrain's (`actor` in words, e.g. "raytrain's live log actor") not
    answered `waited_s` seconds after the driver made it; `actor_id`, `record`, `now_ms` and `repeat_s` as for
    `describe_controller_wait`."""
    name = _named(actor, actor_id)
    head = f"no answer from {name} to {call} {waited_s:.0f} s after the driver asked"
    tail = still_waiting(repeat_s)

    def alive(alive_s: float) -> str:
        return (
            f"the GCS has had it alive for {alive_s:.0f} s: it is busy, or the call has not reached it (seen here "
            "once: a driver that never got an actor's ALIVE notification, docs/guide.md#troubleshooting)"
        )

    return f"{head}: {gcs_state_words(record, now_ms, alive, '')}; {tail}"


def gcs_state_words(record: dict[str, Any] | None, now_ms: float, alive: Callable[[float], str], died_when: str) -> str:
    """What the GCS's record of an actor (`raytrain.ray_hooks.actor_record`; None: no record) means for a caller
    waiting on it; `alive(seconds)` words the ALIVE state, `died_when` qualifies a death ("before beginning")."""
    state = str(record.get("State", "?")) if record else None
    if state is None:
        return "the GCS has no record of its actor (its registration is pending, or the GCS did not answer)"
    if state == "DEPENDENCIES_UNREADY":
        return "the GCS is waiting for its creation arguments from this driver (GCS state DEPENDENCIES_UNREADY)"
    if state == "PENDING_CREATION":
        return (
            "Ray is placing or starting its process or running its constructor (GCS state PENDING_CREATION: a "
            "runtime environment being set up, a node short of memory or worker processes)"
        )
    assert record is not None
    if state == "ALIVE":
        return alive(max(0.0, (now_ms - float(record.get("StartTime") or now_ms)) / 1000))
    if state == "DEAD":
        cause = " ".join(str(record.get("DeathCause") or "no cause recorded").split())[:200]
        return f"it died{' ' + died_when if died_when else ''} ({cause}); Ray's error follows"
    return f"GCS state {state}"


class StartWatch:
    """A daemon thread on the driver saying what `fit()` waits for until the controller begins the run.

    `controller_id` returns the controller's actor id (None before raytrain has its handle); `ask_gcs` the GCS's
    record of an actor id (`raytrain.ray_hooks.actor_record`). Lines go to `<run_dir>/raytrain.log`, and to the
    console too when `echo` (no `RunLogTail` prints the log)."""

    def __init__(
        self,
        run_dir: str,
        controller_id: Callable[[], str | None],
        ask_gcs: Callable[[str], dict[str, Any] | None],
        echo: bool,
        say_after_s: float | None = None,
        repeat_s: float | None = None,
    ) -> None:
        self.run_dir, self.controller_id, self.ask_gcs, self.echo = run_dir, controller_id, ask_gcs, echo
        self.say_after_s = SAY_AFTER_S if say_after_s is None else say_after_s
        self.repeat_s = REPEAT_S if repeat_s is None else repeat_s
        self._marker = os.path.join(run_dir, STARTED_FILE)
        with contextlib.suppress(FileNotFoundError):  # an earlier fit() of this run directory (the run lock is held)
            os.remove(self._marker)
        self._started = 0.0  # set by start()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raytrain-start-watch", daemon=True)

    def start(self) -> StartWatch:
        """Start watching; returns self."""
        self._started = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (at `fit()`'s end, whatever the outcome; again or before `start`: nothing more). A
        question to the GCS in flight is not waited for beyond 2 s (the thread is a daemon)."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=2.0)

    def began(self) -> bool:
        """True once the controller has written `STARTED_FILE`."""
        return os.path.exists(self._marker)

    def _run(self) -> None:
        next_say = self.say_after_s
        while not self._stop.wait(min(0.5, max(0.05, next_say / 4))):
            if self.began():
                return
            waited = time.monotonic() - self._started
            if waited >= next_say:
                try:
                    self._say(waited)
                except Exception:  # e.g. the run directory gone: the run itself is not this thread's to fail
                    return
                next_say = waited + self.repeat_s

    def _say(self, waited_s: float) -> None:
        actor_id = self.controller_id()
        record = self.ask_gcs(actor_id) if actor_id is not None else None
        if self.began() or self._stop.is_set():  # it began, or fit() ended, while the GCS was asked
            return
        line = describe_controller_wait(waited_s, actor_id, record, time.time() * 1000, self.repeat_s)
        append_line(self.run_dir, f"[raytrain] {line}")
        if self.echo:
            say(line)
