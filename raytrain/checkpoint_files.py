"""The checkpoint directories of a run, on disk or object storage: finding them, proving them whole, and reading
them safely.

    manifest.json   rank 0 writes it last: every file of the checkpoint (all ranks' shards included) and its size

`verify` checks a directory against its manifest (every file present, at its size), so a checkpoint cut short by a
full disk, a crash during the upload or a lost file is recognised before anything is loaded, identically on every
rank. `SafeReader` and `SafeLoadPlanner` read DCP checkpoints without unpickling arbitrary objects: DCP's own
reader unpickles `.metadata` with `pickle.load` and non-tensor items with `torch.load(weights_only=False)`, either
of which runs code from a crafted file; here the metadata unpickler admits only DCP's metadata classes and the
items go through `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import posixpath
from typing import Any

import torch

STATE_FILE = "raytrain_state.json"
LIVE_CHECKPOINT_PREFIX = "live-checkpoint-"  # live mode's checkpoints: live-checkpoint-<step>/ in the run directory
MANIFEST_FILE = "manifest.json"
METADATA_FILE = ".metadata"


def _fs(fs: Any) -> Any:
    """`fs`, or the local file system for None."""
    import pyarrow.fs as pafs

    return fs if fs is not None else pafs.LocalFileSystem()


def _read(fs: Any, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return bytes(f.read())


def read_step(directory: str, fs: Any = None) -> int:
    """The step a checkpoint directory (on the pyarrow filesystem `fs`, None: local) was written at (its train
    state only; nothing is loaded)."""
    return int(json.loads(_read(_fs(fs), posixpath.join(directory, STATE_FILE))).get("step", 0))


def file_sizes(directory: str) -> dict[str, int]:
    """Name -> size of the files directly in the local `directory`."""
    return {
        entry.name: entry.stat().st_size
        for entry in os.scandir(directory)
        if entry.is_file() and entry.name != MANIFEST_FILE
    }


def write_manifest(directory: str, files: dict[str, int]) -> None:
    """Record `files` (every rank's, merged) as the checkpoint's contents; rank 0, after every file is written."""
    with open(os.path.join(directory, MANIFEST_FILE), "w") as f:
        json.dump({"files": files}, f)


def verify(directory: str, fs: Any = None) -> str | None:
    """Why the checkpoint in `directory` (on the pyarrow filesystem `fs`, None: local) cannot be loaded (a file
    missing or shorter than written, metadata that does not parse), or None when it is whole. Reads sizes and the
    small metadata file only: nothing is downloaded from object storage but those."""
    import pyarrow.fs as pafs

    fs = _fs(fs)
    if fs.get_file_info(directory).type != pafs.FileType.Directory:
        return "the directory is missing"
    if fs.get_file_info(posixpath.join(directory, LOST_MARKER)).type == pafs.FileType.File:
        return "the directory is missing"  # `replace_lost` stands in for it
    manifest = posixpath.join(directory, MANIFEST_FILE)
    if fs.get_file_info(manifest).type == pafs.FileType.NotFound:
        if _written_before_manifests(directory, fs):
            return None  # raytrain 0.1 wrote no manifest: nothing to check sizes against
        return "no manifest.json (the save did not finish)"
    try:
        expected: dict[str, int] = json.loads(_read(fs, manifest))["files"]
    except (OSError, ValueError, KeyError) as err:
        return f"manifest.json is unreadable ({err})"
    names = sorted(expected)
    for name, info in zip(names, fs.get_file_info([posixpath.join(directory, n) for n in names]), strict=True):
        if info.type == pafs.FileType.NotFound:
            return f"{name} is missing"
        if info.size != expected[name]:
            return f"{name} has {info.size} of its {expected[name]} bytes"
    try:
        parse_metadata(_read(fs, posixpath.join(directory, METADATA_FILE)), directory)
    except Exception as err:
        return f"{METADATA_FILE} does not parse ({type(err).__name__}: {err})"
    return None


def _written_before_manifests(directory: str, fs: Any) -> bool:
    """A checkpoint of raytrain 0.1: a readable train state without `format_version` (and DCP metadata)."""
    import pyarrow.fs as pafs

    try:
        state = json.loads(_read(fs, posixpath.join(directory, STATE_FILE)))
    except (OSError, ValueError):
        return False
    metadata = fs.get_file_info(posixpath.join(directory, METADATA_FILE))
    return "format_version" not in state and metadata.type == pafs.FileType.File


RAY_SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"  # Ray Train's controller: its committed checkpoints


def latest_committed_path(run_dir: str, fs: Any = None) -> str | None:
    """The directory of the checkpoint Ray Train has committed last for the run in `run_dir` (on the pyarrow
    filesystem `fs`, None: local), from its controller's record, readable or not; None without a record."""
    try:
        latest = json.loads(_read(_fs(fs), posixpath.join(run_dir, RAY_SNAPSHOT_FILE))).get("latest_checkpoint_result")
        return posixpath.join(run_dir, (latest or {})["checkpoint_dir_name"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def latest_committed(run_dir: str, fs: Any = None) -> tuple[int, str] | None:
    """(step, path) of the checkpoint Ray Train has committed last for the run in `run_dir` (on the pyarrow
    filesystem `fs`, None: local), the one a restart restores, from the record Ray Train's controller keeps in the
    run directory; None when there is none (or the record cannot be read). A newer checkpoint directory may
    exist: reported, never committed."""
    path = latest_committed_path(run_dir, fs)
    if path is None:
        return None
    try:
        return read_step(path, fs), path
    except (OSError, ValueError):
        return None


LOST_MARKER = "raytrain_lost.txt"  # in an empty directory standing in for a committed checkpoint that is gone


def replace_lost(run_dir: str, fs: Any = None) -> list[str]:
    """Put an empty directory, marked lost, in place of every checkpoint Ray Train's record of the run lists but
    storage no longer holds (deleted by hand, lost with a disk), so that Ray Train starts (it refuses a record that
    names a missing directory) and `verify` reports it as missing: the run then resumes from the newest intact one.
    Returns the directories replaced (call on the driver, before the run starts)."""
    import pyarrow.fs as pafs

    fs = _fs(fs)
    try:
        record = json.loads(_read(fs, posixpath.join(run_dir, RAY_SNAPSHOT_FILE)))
        names = [entry["checkpoint_dir_name"] for entry in record.get("checkpoint_results", [])]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    replaced = []
    for name in names:
        path = posixpath.join(run_dir, name)
        if fs.get_file_info(path).type == pafs.FileType.NotFound:
            fs.create_dir(path, recursive=True)
            with fs.open_output_stream(posixpath.join(path, LOST_MARKER)) as out:
                out.write(b"this checkpoint was gone when the run was resumed; raytrain resumed from an older one\n")
            replaced.append(path)
    return replaced


def checkpoint_paths(run_dir: str, fs: Any = None) -> list[str]:
    """Every checkpoint directory in `run_dir` (on the pyarrow filesystem `fs`, None: local), readable or not, in
    the order Ray Train wrote them (it names them `checkpoint_<timestamp>`)."""
    import pyarrow.fs as pafs

    try:
        entries = _fs(fs).get_file_info(pafs.FileSelector(run_dir, allow_not_found=True))
    except OSError:  # run_dir is a file
        return []
    return sorted(
        (e.path for e in entries if e.base_name.startswith("checkpoint_") and e.type == pafs.FileType.Directory),
        key=posixpath.basename,
    )


def checkpoint_dirs(run_dir: str, fs: Any = None) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint directory in `run_dir` (on the pyarrow filesystem `fs`, None: local) whose
    train state can be read, oldest step first. A directory without one (a save cut short) is left out."""
    found: list[tuple[int, str]] = []
    for path in checkpoint_paths(run_dir, fs):
        try:
            found.append((read_step(path, fs), path))
        except (OSError, ValueError):
            continue
    return sorted(found)


def remove_uncommitted(latest: str, fs: Any = None) -> list[str]:
    """Delete the checkpoint directories written after `latest`, Ray's latest committed checkpoint (on the pyarrow
    filesystem `fs`, None: local): those of later steps, written by a worker group that failed before Ray
    committed them, and those named after it with no train state, a save cut short (by Ctrl-C or a lost node), so
    that Ray's `num_to_keep`, which only counts what it committed, leaves no more than that on disk. Call on rank 0
    at a (re)start, before any new checkpoint. Returns the paths removed."""
    fs = _fs(fs)
    latest_step, latest_name = read_step(latest, fs), posixpath.basename(latest.rstrip("/"))
    removed = []
    for path in checkpoint_paths(posixpath.dirname(latest.rstrip("/")), fs):
        try:
            after = read_step(path, fs) > latest_step
        except (OSError, ValueError):
            after = posixpath.basename(path) > latest_name  # Ray names them checkpoint_<timestamp>
        if after:
            try:
                fs.delete_dir(path)
            except OSError:
                continue  # left for the next start (or Ray) to remove
            removed.append(path)
    return removed


# ---------------------------------------------------------------- reading without arbitrary unpickling

_METADATA_GLOBALS = {
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
}
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes, torch dtypes and sizes, paths; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if module == _METADATA_MODULE or (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which raytrain does not load")


def parse_metadata(data: bytes, where: str) -> Any:
    """DCP's `Metadata` from its file's bytes, unpickled by `_MetadataUnpickler` (torch.distributed.checkpoint is
    imported here, not with this module: a new run's checks need none of its 3 s of imports)."""
    from torch.distributed.checkpoint.metadata import Metadata

    metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"{where} does not hold DCP metadata")
    return metadata


def read_metadata(path: str) -> Any:
    """The DCP `Metadata` in the file at `path`, read safely (`_MetadataUnpickler`)."""
    with open(path, "rb") as f:
        return parse_metadata(f.read(), path)


def live_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """(step, directory) of the run's complete live checkpoints, oldest first."""
    if not os.path.isdir(run_dir):
        return []
    found = []
    for name in os.listdir(run_dir):
        if name.startswith(LIVE_CHECKPOINT_PREFIX) and name[len(LIVE_CHECKPOINT_PREFIX) :].isdigit():
            found.append((int(name[len(LIVE_CHECKPOINT_PREFIX) :]), os.path.join(run_dir, name)))
    return sorted(found)


def restore_candidates(latest: str, fs: Any = None) -> list[str]:
    """The checkpoint directories to try, newest first: Ray's latest committed one, then the older ones of its run
    directory (never a newer one: written after the latest commit, it was never committed). Older means a lower
    step; when the latest's own state is gone (its file or its whole directory lost), older means written before
    it, as Ray Train's time-stamped names tell. Paths on the pyarrow filesystem `fs` (None: local)."""
    run_dir = posixpath.dirname(latest.rstrip("/"))
    try:
        newest = read_step(latest, fs)
    except (OSError, ValueError):
        name = posixpath.basename(latest.rstrip("/"))
        return [latest, *reversed([p for p in checkpoint_paths(run_dir, fs) if posixpath.basename(p) < name])]
    older = [path for step, path in reversed(checkpoint_dirs(run_dir, fs)) if step <= newest and path != latest]
    return [latest, *older]


def newest_checkpoint(
    run_dir: str, live_too: bool, fs: Any = None, damaged: list[tuple[str, str]] | None = None
) -> tuple[int, str] | None:
    """(step, path) of the newest intact checkpoint a run in `run_dir` resumes from, of either recovery mode (one
    format: `raytrain.checkpoint`): the restart path's committed ones (Ray Train's latest and those before it) or,
    with `live_too` (a local run directory), the live ones, newest step first, the first that `verify` finds whole.
    Each damaged one passed over is appended to `damaged` as (path, why) when given. None when none is intact."""
    candidates: list[tuple[int, int, str]] = []  # (step, 1 for the restart path's: first at a tie, path)
    latest = latest_committed_path(run_dir, fs)
    for path in restore_candidates(latest, fs) if latest is not None else []:
        try:
            candidates.append((read_step(path, fs), 1, path))
        except (OSError, ValueError):
            continue  # its state is lost: nothing to resume from there
    if live_too:
        candidates += [(step, 0, path) for step, path in live_checkpoints(run_dir)]
    for step, _, path in sorted(candidates, reverse=True):
        why = verify(path, fs)
        if why is None:
            return step, path
        if damaged is not None:
            damaged.append((path, why))
    return None
