"""One training process per run directory: the same run started twice at once must refuse, not corrupt the first.

`run_lock(run_dir)` holds an exclusive `flock` on `<run>/.lock` for the life of the driver that trains the run
(the lock dies with the process, so a crash leaves no stale lock to clean up; `flock` works on local disks and on
NFS/EFS shares). A second driver fails at once with `ConfigError` naming the process that holds the run. The
same process may take the lock again (the CLI takes it before building the data, `ElasticTrainer.fit` inside).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Iterator

from raytrain.errors import ConfigError

LOCK_FILE = ".lock"
_held: dict[str, int] = {}  # run directory -> how many times this process holds it


@contextlib.contextmanager
def run_lock(run_dir: str) -> Iterator[None]:
    """Hold the run's lock for the block; `ConfigError` when another process holds it.

    Directories it had to create for the lock are removed again when the block wrote nothing else into them, so
    a run refused before any worker started (a bad config, bad data) leaves no trace in the storage path."""
    run_dir = os.path.abspath(run_dir)
    if _held.get(run_dir):
        _held[run_dir] += 1
        try:
            yield
        finally:
            _held[run_dir] -= 1
        return
    created = _missing_dirs(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LOCK_FILE)
    handle = open(path, "a+")  # noqa: SIM115  # held open for the whole block: the lock lives as long as the file
    try:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise ConfigError(
                f"run {run_dir} is already being trained by {holder}; wait for it to finish or choose another "
                "run_name (two drivers on one run would overwrite each other's checkpoints and logs)"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        handle.flush()
        _held[run_dir] = 1
        try:
            yield
        finally:
            _held.pop(run_dir, None)
            if created and os.listdir(run_dir) == [LOCK_FILE]:
                _remove_unused(path, created)  # still locked: nobody can take a lock file about to go
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
    finally:
        handle.close()


def _missing_dirs(path: str) -> list[str]:
    """The directories `os.makedirs(path)` would create, deepest first."""
    missing = []
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _remove_unused(lock_path: str, created: list[str]) -> None:
    """Remove the lock file and the directories created for it (deepest first) while they are empty."""
    try:
        os.unlink(lock_path)
        for path in created:
            os.rmdir(path)  # OSError when something else appeared in it: then it stays
    except OSError:
        pass
