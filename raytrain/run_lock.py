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
    """Hold the run's lock for the block; `ConfigError` when another process holds it."""
    run_dir = os.path.abspath(run_dir)
    if _held.get(run_dir):
        _held[run_dir] += 1
        try:
            yield
        finally:
            _held[run_dir] -= 1
        return
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
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
    finally:
        handle.close()
