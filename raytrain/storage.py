"""Where a run's checkpoints live: a local or shared directory, or object storage (`s3://`, `gs://`, ... through a
pyarrow filesystem, as Ray Train stores them).

A run has two places:
    checkpoints   `<storage_path>/<run_name>` on the storage's filesystem: Ray Train's checkpoint directories and
                  its record of the committed ones (`checkpoint_manager_snapshot.json`);
    run files     `CheckpointConfig.run_dir()`, always a local (or shared) directory: metrics.jsonl, events.jsonl,
                  samples.jsonl, raytrain.log and the run lock. For a local `storage_path` both are one directory.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from raytrain.config import CheckpointConfig
from raytrain.errors import ConfigError


@dataclass(frozen=True)
class RunStorage:
    """The run's checkpoint directory: `path` on the pyarrow filesystem `fs`; `uri` names it in messages."""

    fs: Any  # pyarrow.fs.FileSystem
    path: str
    uri: str

    @property
    def is_local(self) -> bool:
        """True for the local file system (a local or shared directory)."""
        import pyarrow.fs as pafs

        return isinstance(self.fs, pafs.LocalFileSystem)

    def newest_checkpoint(self) -> tuple[int, str] | None:
        """(step, path) of the checkpoint a run here resumes from, of either recovery mode
        (`raytrain.checkpoint_files.newest_checkpoint`; live checkpoints are local only). None when there is none;
        `OSError` when the storage cannot be read."""
        from raytrain.checkpoint_files import newest_checkpoint

        return newest_checkpoint(self.path, live_too=self.is_local, fs=self.fs)


def filesystem_of(uri: str, what: str) -> tuple[Any, str]:
    """(pyarrow filesystem, path on it) of a local path (made absolute) or a URI (its query options such as
    endpoint_override reach pyarrow; credentials from the environment); `ConfigError` naming `what` (the
    setting, e.g. "init_from") and the URI when pyarrow cannot open it."""
    import pyarrow.fs as pafs

    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    try:
        return pafs.FileSystem.from_uri(uri)
    except (ValueError, OSError) as err:
        raise ConfigError(f"{what} {uri!r} is not a path or a URI pyarrow can open: {err}") from None


def run_storage(checkpoint: CheckpointConfig, filesystem: Any = None) -> RunStorage:
    """The run directory of `checkpoint` on its filesystem: the local file system for a path, else `filesystem`
    (a `pyarrow.fs.FileSystem`; the URI without its scheme and options is the path on it, as Ray's
    `storage_filesystem` wants) or the one pyarrow derives from the URI (its query options such as
    `endpoint_override`, credentials from the environment; `CheckpointConfig` refuses credentials in the URI).
    Raises `ConfigError` naming the URI when pyarrow cannot make a filesystem of it."""
    import pyarrow.fs as pafs

    if checkpoint.is_local:
        path = checkpoint.run_dir()  # checkpoints and run files share the run directory
        return RunStorage(pafs.LocalFileSystem(), path, path)
    base = checkpoint.storage_path.split("?", 1)[0].rstrip("/")
    rest = base.split("://", 1)[1]
    if filesystem is not None:
        root = rest
    else:
        try:
            filesystem, root = pafs.FileSystem.from_uri(checkpoint.storage_path)
        except (ValueError, OSError) as err:
            raise ConfigError(f"storage_path {base!r} is not a URI pyarrow can open: {err}") from None
    root = root.rstrip("/")
    return RunStorage(filesystem, posixpath.join(root, checkpoint.run_name), f"{base}/{checkpoint.run_name}")


RUN_OUTPUTS_IGNORE = (
    "# raytrain created this directory for run outputs (checkpoints, logs): kept out of git, and out of\n"
    "# `ray job submit --working-dir .` uploads (Ray honours .gitignore files)\n*\n"
)


def keep_out_of_uploads(storage_path: str) -> bool:
    """Create the local directory `storage_path` with a `.gitignore` of `*` in it when it does not exist yet, so
    a project that keeps its runs inside (the default `./raytrain_runs`) neither commits them nor uploads them with
    `ray job submit --working-dir .`; True when created. A directory that exists is the user's: left untouched."""
    if os.path.exists(storage_path):
        return False
    os.makedirs(storage_path, exist_ok=True)
    with open(os.path.join(storage_path, ".gitignore"), "w") as f:
        f.write(RUN_OUTPUTS_IGNORE)
    return True


def check_writable(storage: RunStorage) -> None:
    """Raise `ConfigError` naming the URI unless a file can be written into, and deleted from, the run's
    directory on object storage (a missing bucket, wrong credentials or an unreachable endpoint fail here, in
    seconds, before any worker starts). Local directories are checked by `trainer.check_storage_writable`."""
    probe = posixpath.join(storage.path, ".raytrain-write-probe")
    try:
        storage.fs.create_dir(storage.path, recursive=True)
        with storage.fs.open_output_stream(probe) as out:
            out.write(b"raytrain")
        storage.fs.delete_file(probe)
    except OSError as err:
        raise ConfigError(f"storage_path {storage.uri!r} is not writable: {err}") from None


@contextmanager
def node_local_copy(
    directory: str, fs: Any, *, node: str, local_rank: int, barrier: Callable[[], object]
) -> Iterator[str]:
    """`directory` of filesystem `fs` as a local directory, once per node (collective: every rank of the group
    enters it, with `barrier` a barrier of the whole group). On the local file system: the directory itself. On
    object storage: the node's local rank 0 downloads it into a temporary directory named by (`node`, the path),
    the node's other ranks wait and read the same copy, and it is removed once every rank has left; so a node
    with 8 ranks downloads a checkpoint once, not 8 times."""
    import pyarrow.fs as pafs

    if fs is None or isinstance(fs, pafs.LocalFileSystem):
        yield directory
        return
    key = hashlib.sha256(f"{node}|{fs.type_name}|{directory}".encode()).hexdigest()[:16]
    target = os.path.join(tempfile.gettempdir(), f"raytrain-restore-{key}")
    if local_rank == 0:
        shutil.rmtree(target, ignore_errors=True)  # a copy left by a start that crashed
        os.makedirs(target)
        pafs.copy_files(directory, target, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
    barrier()
    try:
        yield target
    finally:
        barrier()
        if local_rank == 0:
            shutil.rmtree(target, ignore_errors=True)
