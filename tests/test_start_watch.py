"""`raytrain.start_watch`: until Ray Train's controller begins the run, the driver says what `fit()` waits for.

The line for each GCS state is pure; the watch itself runs against real actors on the shared local instance (one
that cannot be placed, one alive that is never called), and `test_trainer_ray.py`'s end-to-end run checks that
`fit()` starts and stops it. Live mode's driver waits on its log actor the same way (`get_said`): checked against
an actor slow to answer and one that cannot be placed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from raytrain.console import LOG_FILE
from raytrain.ray_hooks import actor_id, actor_record
from raytrain.start_watch import StartWatch, describe_actor_wait, describe_controller_wait, mark_began

ID = "ab" * 16


@pytest.mark.parametrize(
    ("actor_id", "record", "expected"),
    [
        (None, None, "raytrain has no handle on its actor yet"),
        (ID, None, "(actor abababababab) has not begun the run 31 s after fit() started it: the GCS has no record"),
        (ID, {"State": "DEPENDENCIES_UNREADY"}, "waiting for its creation arguments from this driver"),
        (ID, {"State": "PENDING_CREATION"}, "placing or starting its process or running its constructor"),
        (ID, {"State": "ALIVE", "StartTime": 1_000_000}, "the GCS has had it alive for 25 s, yet its run loop"),
        (ID, {"State": "DEAD", "DeathCause": "out of\n memory"}, "died before beginning (out of memory)"),
        (ID, {"State": "DEAD", "DeathCause": ""}, "died before beginning (no cause recorded)"),
    ],
)
def test_each_gcs_state_of_a_controller_not_begun_is_said_in_words(
    actor_id: str | None, record: Any, expected: str
) -> None:
    line = describe_controller_wait(31.2, actor_id, record, now_ms=1_025_000, repeat_s=60)
    assert expected in line
    assert line.endswith(
        "(said again every 60 s; Ctrl-C stops it, and the same run started again in a new process "
        "resumes from the newest checkpoint)"
    )


def test_a_mark_that_cannot_be_written_does_not_raise_in_the_controller(tmp_path: Path) -> None:
    """Ray Train fails the run for a callback's exception: a run directory the controller cannot write to (here a
    file where the directory should be) leaves the watch talking, nothing more."""
    not_a_dir = tmp_path / "run"
    not_a_dir.write_text("")
    mark_began(str(not_a_dir))
    assert not_a_dir.is_file()


def watch_lines(run_dir: Path) -> list[str]:
    log = run_dir / LOG_FILE
    return [line for line in log.read_text().splitlines() if "has not begun the run" in line] if log.exists() else []


@pytest.mark.ray
def test_the_watch_names_the_actor_and_its_state_until_the_run_begins(ray_local: None, tmp_path: Path) -> None:
    import ray

    @ray.remote(num_cpus=0)
    class Idle:
        def ping(self) -> int:
            return 1

    pending = Idle.options(resources={"no-such-resource": 1}).remote()  # type: ignore[attr-defined]
    alive = Idle.remote()  # type: ignore[attr-defined]
    ray.get(alive.ping.remote())
    try:
        for handle, state in ((pending, "PENDING_CREATION"), (alive, "alive for")):
            run_dir = tmp_path / state.split()[0]
            run_dir.mkdir()
            mark_began(str(run_dir))  # an earlier fit()'s marker: the watch starts afresh
            watch = StartWatch(
                str(run_dir), lambda h=handle: actor_id(h), actor_record, echo=False, say_after_s=0.2, repeat_s=0.3
            ).start()
            deadline = time.monotonic() + 30
            while len(watch_lines(run_dir)) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            lines = watch_lines(run_dir)
            assert len(lines) >= 2, f"the watch said {lines} in 30 s"
            assert f"(actor {handle._actor_id.hex()[:12]})" in lines[0] and state in lines[0]
            mark_began(str(run_dir))  # what RunLog does at the controller's first state change
            time.sleep(1.0)  # three repeat periods
            said = len(watch_lines(run_dir))
            time.sleep(0.6)
            watch.stop()
            assert len(watch_lines(run_dir)) == said  # silent once the run began
    finally:
        ray.kill(pending)
        ray.kill(alive)


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (None, "the GCS has no record of its actor"),
        ({"State": "PENDING_CREATION"}, "placing or starting its process or running its constructor"),
        ({"State": "ALIVE", "StartTime": 1_000_000}, "alive for 25 s: it is busy, or the call has not reached it"),
        ({"State": "DEAD", "DeathCause": "killed"}, "it died (killed); Ray's error follows"),
    ],
)
def test_a_call_to_one_of_raytrains_actors_not_answered_is_said_in_words(record: Any, expected: str) -> None:
    line = describe_actor_wait("raytrain's live log actor", "fence()", 31.2, ID, record, 1_025_000, repeat_s=60)
    assert line.startswith("no answer from raytrain's live log actor (actor abababababab) to fence() 31 s after")
    assert expected in line and line.endswith("resumes from the newest checkpoint)")


@pytest.mark.ray
def test_live_modes_driver_says_what_its_log_actor_has_not_answered(ray_local: None, tmp_path: Path) -> None:
    import threading

    import ray

    from raytrain.live.driver import get_said

    @ray.remote(num_cpus=0)
    class Log:
        def slow(self, seconds: float) -> str:
            time.sleep(seconds)
            return "answered"

    def lines() -> list[str]:
        log = tmp_path / LOG_FILE
        return [line for line in log.read_text().splitlines() if "no answer from" in line] if log.exists() else []

    slow = Log.remote()  # type: ignore[attr-defined]
    pending = Log.options(resources={"no-such-resource": 1}).remote()  # type: ignore[attr-defined]
    kill = threading.Timer(1.5, lambda: ray.kill(pending))  # else the call would wait, saying so, forever
    try:
        ray.get(slow.slow.remote(0))
        ref = slow.slow.remote(1.5)
        assert get_said(ref, slow, "the log", "slow()", str(tmp_path), say_after_s=0.2, repeat_s=0.4) == "answered"
        said = lines()
        assert len(said) >= 2 and f"the log (actor {slow._actor_id.hex()[:12]}) to slow()" in said[0], said
        assert "the GCS has had it alive for" in said[0]
        kill.start()
        with pytest.raises(ray.exceptions.RayActorError):
            get_said(pending.slow.remote(0), pending, "the log", "slow()", str(tmp_path), say_after_s=0.2, repeat_s=0.4)
        assert any("PENDING_CREATION" in line for line in lines()[len(said) :]), lines()
    finally:
        kill.cancel()
        ray.kill(slow)
        ray.kill(pending)
