"""Checkpoints: every rank saves its share with torch.distributed.checkpoint (DCP), so state written at W workers
loads at any W' (DCP reshards on load), for DDP and FSDP2 alike.

Layout of one checkpoint directory (Ray merges the per-rank directories into it):
    .metadata, __<rank>_0.distcp   model and optimizer state (DCP)
    optimizer_zero1.pt             zero1 only: the optimizer state consolidated on rank 0 (torch.save)
    raytrain_state.json            rank 0: step, epoch, data position, batch plan, config, LR, and the model's
                                   record for its export (`raytrain.model_record`)
    consumed_ranges.npy            rank 0: the ids consumed so far in the current epoch (streaming mode; empty on
                                   the position paths) as (R, 2) ranges [start, end); a checkpoint written
                                   before ranges holds consumed_ids.npy (every id) instead, which still loads
    manifest.json                  rank 0, last: every file above (every rank's) and its size

Saving is a collective: every rank must call `save_checkpoint`, or `start_save` and later `finish_save` (DCP plans
the write together; zero1 consolidates the optimizer on rank 0; the file sizes are gathered for the manifest). With
a background group `start_save` returns once this rank's shard is copied to host memory and DCP writes it in a
thread, so training goes on while the files are written; the manifest, written last, marks the files complete.
Nothing is loaded with arbitrary unpickling: DCP through `SafeReader` /
`SafeLoadPlanner`, the torch file with `weights_only=True`, the ids with `allow_pickle=False`, the state as JSON.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from raytrain.checkpoint_files import METADATA_FILE, STATE_FILE, file_sizes, read_metadata, write_manifest
from raytrain.collectives import all_gather_objects
from raytrain.data.id_ranges import IdRanges


class SafeReader(FileSystemReader):
    """DCP's file-system reader with the metadata read by `checkpoint_files.read_metadata` (DCP's own classes
    only) instead of `pickle.load`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, refusing anything but DCP's own classes."""
        metadata: Metadata = read_metadata(os.path.join(str(self.path), METADATA_FILE))
        storage_meta = metadata.storage_meta or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor items read by `torch.load(weights_only=True)` (the same placement as
    `DefaultLoadPlanner.load_bytes`, which uses `weights_only=False`)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        """Set one non-tensor item (e.g. an optimizer's param_groups) from its bytes, without arbitrary objects."""
        from torch.distributed.checkpoint._traverse import set_element  # DCP's own helper for flattened dicts

        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


CONSUMED_FILE = "consumed_ranges.npy"
CONSUMED_IDS_FILE = "consumed_ids.npy"  # written before ranges (every id, sorted): still read
ZERO1_OPTIMIZER_FILE = "optimizer_zero1.pt"


@dataclass
class TrainState:
    """Where training stands after `step` completed optimizer steps; the JSON part of a checkpoint.

    `epoch` and `sample_in_epoch` are the data position of the NEXT step: how many samples of epoch `epoch`'s
    order are consumed. It is kept in samples, not steps, so a resume with another global batch continues at the
    same sample. `base_batch` and `peak_lr` let such a resume rescale the LR by its rule.
    """

    step: int = 0
    epoch: int = 0
    sample_in_epoch: int = 0
    format_version: int = 2  # 2: the checkpoint has a manifest.json (raytrain 0.1 wrote none and no version)
    samples_seen: int = 0
    skipped_steps: int = 0  # steps whose update was dropped for a NaN or Inf (on_nonfinite="skip")
    world_size: int = 0
    global_batch: int = 0
    base_batch: int = 0
    peak_lr: float = 0.0
    loss_scale: dict[str, Any] = field(default_factory=dict)  # fp16: the GradScaler's state
    schedule: dict[str, Any] = field(default_factory=dict)  # the LR schedule's clock (`lr_rules.ScheduleClock`)
    plan: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    data_order: dict[str, int] = field(default_factory=dict)  # Parquet: what epoch `epoch`'s order depends on
    num_rows: int = 0  # the training set's rows (deterministic mode; 0: streaming, or written before it was kept)
    model: dict[str, Any] = field(default_factory=dict)  # what the export needs (`raytrain.model_record`)

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> TrainState:
        """Read a stored state, also one written by raytrain 0.1 (data position in steps, no base batch)."""
        record = dict(record)
        if "step_in_epoch" in record:  # 0.1: every step of an epoch but its last held exactly global_batch samples
            record.setdefault("sample_in_epoch", record.pop("step_in_epoch") * record.get("global_batch", 0))
        record.setdefault("base_batch", record.get("global_batch", 0))
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in known})


def _is_zero_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """zero1's optimizer? Without importing torch.distributed.optim (0.1-0.4 s, paid at the first checkpoint):
    if nothing imported it, no optimizer can be one."""
    module = sys.modules.get("torch.distributed.optim")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


@dataclass
class PendingSave:
    """A checkpoint whose state is copied and whose files are being written (`start_save`); `finish_save`
    completes it. `metrics` is what the run reports with it once every rank's files are written."""

    directory: str
    step: int
    metrics: dict[str, Any]
    write: Future[Any] | None  # DCP's background write; None when it was written before `start_save` returned

    def written(self) -> bool:
        """Whether this rank's files are on disk (no wait)."""
        return self.write is None or self.write.done()


def checkpoint_group() -> Any:
    """A gloo process group of its own for background checkpoint writes (collective: every rank must call it
    once per worker-group start), so the writer thread's collectives never interleave with the training
    thread's on the default group; None without torch.distributed (one process)."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo") if dist.is_available() and dist.is_initialized() else None


USER_KEY = "user"  # the user's own state (`start_save(extras=...)`) is stored under user.<name>
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def start_save(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
    rank: int,
    consumed: IdRanges,
    *,
    metrics: dict[str, Any] | None = None,
    background_group: Any = None,
    flat_optimizer: bool = False,
    extras: dict[str, Any] | None = None,
) -> PendingSave:
    """Begin a checkpoint of the current model, optimizer and train state in a fresh directory (collective: all
    ranks call it at the same step).

    With `background_group` (see `checkpoint_group`) DCP copies this rank's model and optimizer shard to host
    memory before returning and writes it in a background thread: training may change the parameters at once.
    Without it the files are written before it returns. zero1's consolidated optimizer, the train state and the
    consumed ids are always written before it returns (small, or a collective of the training thread).
    `flat_optimizer`: store each parameter group's options under every parameter's name (pipeline stages hold
    different parameters, so a shared list of groups would be overwritten by one stage's); about twice the bytes
    of the optimizer's options, so only where needed. `load_checkpoint` recognises either form. `extras`: the
    user's own state, {name: object with state_dict() and load_state_dict()}, saved under "user.<name>" (DCP
    reshards its DTensors; `load_extras` reads it back)."""
    directory = tempfile.mkdtemp(prefix="raytrain-ckpt-")  # new: it outlives the call while Ray uploads it
    zero1 = _is_zero_optimizer(optimizer)
    sharded: dict[str, Any] = {"model": get_model_state_dict(model)}
    if zero1:
        optimizer.consolidate_state_dict(to=0)  # type: ignore[attr-defined]  # collective
        if rank == 0:
            torch.save(optimizer.state_dict(), os.path.join(directory, ZERO1_OPTIMIZER_FILE))
    else:
        sharded["optim"] = get_optimizer_state_dict(model, optimizer, options=FLAT if flat_optimizer else None)
    if extras:
        sharded[USER_KEY] = {name: value.state_dict() for name, value in extras.items()}
    if rank == 0:
        with open(os.path.join(directory, STATE_FILE), "w") as f:
            json.dump(asdict(state), f)
        np.save(os.path.join(directory, CONSUMED_FILE), consumed.ranges)
    write: Future[Any] | None = None
    if background_group is not None:
        write = dcp.async_save(sharded, checkpoint_id=directory, process_group=background_group)  # type: ignore[assignment]
    else:
        dcp.save(sharded, checkpoint_id=directory)
    return PendingSave(directory, state.step, dict(metrics or {}), write)


def finish_save(pending: PendingSave, rank: int) -> str:
    """Wait until this rank's files of `pending` are written, then have rank 0 write the manifest of every rank's
    files (collective: all ranks call it for the same checkpoint); return the directory. Raises what the
    background write raised."""
    if pending.write is not None:
        pending.write.result()
    every_rank = all_gather_objects(file_sizes(pending.directory))
    if rank == 0:
        write_manifest(pending.directory, {name: size for files in every_rank for name, size in files.items()})
    return pending.directory


def save_checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
    rank: int,
    consumed: IdRanges,
    *,
    flat_optimizer: bool = False,
    extras: dict[str, Any] | None = None,
) -> str:
    """Write this rank's share of the checkpoint into a fresh directory and return it, before returning (all
    ranks must call; `start_save` + `finish_save` without a background write)."""
    pending = start_save(model, optimizer, state, rank, consumed, flat_optimizer=flat_optimizer, extras=extras)
    return finish_save(pending, rank)


def load_checkpoint(
    directory: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    aliases: Mapping[str, Sequence[str]] | None = None,
) -> tuple[TrainState, IdRanges]:
    """Load model and optimizer state from `directory` into the (already wrapped) model; all ranks must call.

    Returns the train state and the ids consumed in the current epoch (streaming mode). Works at any world
    size and layout: DCP reshards. Model and optimizer are set one after the other (setting both at
    once with a broadcast hangs at W >= 2, see ../shared/notes). `aliases`: {parameter name: the other names of
    the same (tied) parameter in the whole model}: the optimizer state of a tied parameter is stored under one of
    its names (a single process sees the first; a pipeline stage its own), so a name missing from the checkpoint
    is read under another.
    """
    zero1 = _is_zero_optimizer(optimizer)
    zero1_file = os.path.join(directory, ZERO1_OPTIMIZER_FILE)
    sharded: dict[str, Any] = {"model": get_model_state_dict(model)}
    reader = SafeReader(directory)
    # Checkpoints written before the optimizer state was flattened hold the groups as a list, each with its
    # "params" ("optim.param_groups.0.params"); the flattened form stores options per parameter name only.
    stored = set(reader.read_metadata().state_dict_metadata)
    options = None if "optim.param_groups.0.params" in stored else FLAT
    renamed: dict[str, str] = {}
    if not os.path.exists(zero1_file):
        sharded["optim"] = get_optimizer_state_dict(model, optimizer, options=options)
        renamed = _read_under_aliases(sharded["optim"], stored, aliases or {})
    with one_process_quietly():
        dcp.load(sharded, storage_reader=reader, planner=SafeLoadPlanner())
    _back_to_own_names(sharded.get("optim"), renamed)
    set_model_state_dict(model, sharded["model"])
    if "optim" in sharded and not zero1:
        set_optimizer_state_dict(model, optimizer, sharded["optim"], options=options)
    elif os.path.exists(zero1_file):
        full = torch.load(zero1_file, weights_only=True, map_location="cpu")
        optimizer.load_state_dict(full)
    else:
        raise ValueError(
            f"checkpoint {directory} holds a sharded optimizer state but the run uses zero1; "
            "resume with the strategy the checkpoint was written with"
        )
    with open(os.path.join(directory, STATE_FILE)) as f:
        state = TrainState.from_json(json.load(f))
    return state, load_consumed(directory)


@contextlib.contextmanager
def one_process_quietly() -> Iterator[None]:
    """DCP in one process without a process group (live mode's log writing a checkpoint, a replica group of one
    loading it) is meant: without the warning DCP prints about it on every call."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _read_under_aliases(
    optim: dict[str, Any], stored: set[str], aliases: Mapping[str, Sequence[str]]
) -> dict[str, str]:
    """Rename (in place) the entries of the optimizer state dict `optim` of each tied parameter the checkpoint
    (`stored`: its keys) holds under another of its names to that name; returns {name read: own name} to undo it
    after loading. `optim` is nested ({"state": {name: ...}, "param_groups": [...]}) or flat ("state.<name>.<field>",
    "param_groups.<name>.<option>")."""
    nested = isinstance(optim.get("state"), dict)
    entries: dict[str, Any] = optim["state"] if nested else optim
    renamed: dict[str, str] = {}
    for own, others in aliases.items():
        if any(key.startswith(f"optim.state.{own}.") for key in stored):
            continue  # stored under its own name
        other = next((o for o in others if any(key.startswith(f"optim.state.{o}.") for key in stored)), None)
        if other is None:
            continue  # stored under no name: DCP's load names the missing key
        if nested:
            moves = {own: other} if own in entries else {}
        else:
            moves = {
                key: f"{kind}{other}.{key[len(kind) + len(own) + 1 :]}"
                for key in entries
                for kind in ("state.", "param_groups.")
                if key.startswith(f"{kind}{own}.")
            }
        for key, alias in moves.items():
            entries[alias] = entries.pop(key)
            renamed[alias] = key
    return renamed


def _back_to_own_names(optim: dict[str, Any] | None, renamed: dict[str, str]) -> None:
    """Undo `_read_under_aliases` after loading."""
    if optim is not None and renamed:
        entries = optim["state"] if isinstance(optim.get("state"), dict) else optim
        for alias, key in renamed.items():
            entries[key] = entries.pop(alias)


def load_extras(directory: str, extras: dict[str, Any]) -> list[str]:
    """Load the user's own state saved by `start_save(extras=...)` from `directory` into each object of `extras`
    (collective: every rank calls it with the same names); returns the names the checkpoint does not hold (they
    keep their fresh state). Each object's `state_dict()` gives the shapes (and, for DTensors, this run's
    sharding) to read into; its `load_state_dict()` receives what was read."""
    reader = SafeReader(directory)
    stored = reader.read_metadata().state_dict_metadata
    held = {
        name: {k for k in stored if k == f"{USER_KEY}.{name}" or k.startswith(f"{USER_KEY}.{name}.")} for name in extras
    }
    present = {name: value for name, value in extras.items() if held[name]}
    if present:
        wanted = {USER_KEY: {name: value.state_dict() for name, value in present.items()}}
        for name, state in wanted[USER_KEY].items():
            asked = set(_flat_keys(state, f"{USER_KEY}.{name}"))
            if asked - held[name]:
                cut = len(USER_KEY) + len(name) + 2  # "user.<name>."
                stored_keys, missing = sorted(k[cut:] for k in held[name]), sorted(k[cut:] for k in asked - held[name])
                raise ValueError(
                    f"the checkpoint's {name!r} holds {stored_keys[:4]}..., not {missing[:4]}: key it by "
                    "names that do not change with the world size (the module's own, `Session.module`; DDP adds "
                    "'module.' only when the world has more than one rank)"
                )
        dcp.load(wanted, storage_reader=reader, planner=SafeLoadPlanner())
        for name, value in present.items():
            value.load_state_dict(wanted[USER_KEY][name])
    return sorted(set(extras) - set(present))


def _flat_keys(value: Any, prefix: str) -> list[str]:
    """The keys DCP stores the nested state `value` under, below `prefix` (its own flattening)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict({prefix: value})
    return list(flat)


def load_consumed(directory: str) -> IdRanges:
    """The consumed ids a checkpoint directory holds: its ranges, or the id array of an older checkpoint."""
    ranges = os.path.join(directory, CONSUMED_FILE)
    if os.path.exists(ranges):
        return IdRanges(np.load(ranges, allow_pickle=False))
    return IdRanges.from_ids(np.load(os.path.join(directory, CONSUMED_IDS_FILE), allow_pickle=False))
