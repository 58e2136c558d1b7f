"""The trained model, out: a checkpoint's model as safetensors files a user hands to transformers, an inference
server or a colleague; or loaded into the user's model in one process.

    raytrain export RUN_DIR OUT_DIR [--step N] [--dtype bf16] [--max-shard-size 5GB] [--overwrite]
    raytrain.export("runs/mlp", "exported/")                  # the same, from Python
    model = raytrain.load_model("runs/mlp", model_fn)          # evaluation, inference

`RUN_DIR` is the run's checkpoint directory (`<storage_path>/<run_name>`, local or a URI such as
`s3://bucket/runs/name?endpoint_override=...`). The checkpoint is the newest intact committed one of either
recovery mode, a damaged one skipped with a line as a resume skips it, or the one of `--step`. Every strategy and
layout writes one format (DCP shards of the global tensors, `raytrain.checkpoint`), so the export of a run at
W = 1 and at W = 2, ddp or zero3, tensor or pipeline parallel, is the same.

What is written: `model.safetensors`, or `model-0000i-of-0000n.safetensors` shards of at most `max_shard_size`
bytes with `model.safetensors.index.json` (transformers' layout), under the model's own parameter and buffer
names; a tied parameter once (the name `save_pretrained` keeps); for a transformers model its `config.json` and
`generation_config.json` from the checkpoint's record (`raytrain.model_record`), so `AutoModel*.from_pretrained`
loads the directory with no missing or unexpected keys. Tensors are read and written one at a time, and a tensor
the ranks split by rows (FSDP, a colwise split) one chunk at a time: the memory is about the largest tensor (or
chunk) twice whatever the model's size (`export_peak_fraction` in benchmarks/memory.py). Nothing in a checkpoint
is unpickled as code (`raytrain.checkpoint_files`).
"""

from __future__ import annotations

import io
import json
import math
import os
import posixpath
import re
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from raytrain.checkpoint_files import (
    LIVE_CHECKPOINT_PREFIX,
    METADATA_FILE,
    RAY_SNAPSHOT_FILE,
    STATE_FILE,
    checkpoint_paths,
    parse_metadata,
    verify,
)
from raytrain.errors import ConfigError
from raytrain.storage import filesystem_of

MODEL_KEY = "model."  # DCP stores the model's state under "model.<name>"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
WRITTEN = re.compile(
    r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|config\.json|generation_config\.json)$"
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
DEFAULT_MAX_SHARD = "5GB"


# ---------------------------------------------------------------- choosing the checkpoint


@dataclass(frozen=True)
class Chosen:
    """The checkpoint an export or a load reads: its step, its directory on `fs`, and the damaged ones skipped."""

    step: int
    path: str
    fs: Any
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (directory, why) of newer damaged ones


def _committed(run_dir: str, fs: Any) -> list[str]:
    """The restart path's committed checkpoint directories (Ray Train's record), else every checkpoint_*
    directory, and every live checkpoint."""
    import pyarrow.fs as pafs

    try:
        with fs.open_input_stream(posixpath.join(run_dir, RAY_SNAPSHOT_FILE)) as f:
            record = json.loads(f.read())
        paths = [posixpath.join(run_dir, e["checkpoint_dir_name"]) for e in record.get("checkpoint_results", [])]
    except (OSError, ValueError, KeyError, TypeError):
        paths = checkpoint_paths(run_dir, fs)
    entries = fs.get_file_info(pafs.FileSelector(run_dir, allow_not_found=True))
    live = [
        e.path
        for e in entries
        if e.type == pafs.FileType.Directory
        and e.base_name.startswith(LIVE_CHECKPOINT_PREFIX)
        and e.base_name[len(LIVE_CHECKPOINT_PREFIX) :].isdigit()
    ]
    return paths + sorted(live)


def _step_of(path: str, fs: Any) -> int | None:
    try:
        with fs.open_input_stream(posixpath.join(path, STATE_FILE)) as f:
            return int(json.loads(f.read()).get("step", 0))
    except (OSError, ValueError):
        return None


def choose_checkpoint(run_dir: str, step: int | None = None) -> Chosen:
    """The checkpoint of `run_dir` to export or load: the one at `step`, or the newest intact one (module
    docstring). `ConfigError` naming the run directory when it holds no committed checkpoint, naming the steps
    there are when `step` is not one, and naming why when the chosen one is damaged."""
    import pyarrow.fs as pafs

    fs, path = filesystem_of(run_dir, "run directory")
    if fs.get_file_info(path).type != pafs.FileType.Directory:
        raise ConfigError(f"run directory {run_dir!r} does not exist")
    found = sorted(
        ((s, p) for p in _committed(path, fs) if (s := _step_of(p, fs)) is not None),
        key=lambda item: -item[0],
    )
    if not found:
        raise ConfigError(
            f"run directory {run_dir!r} holds no committed checkpoint (a run writes one every "
            "CheckpointConfig.every_steps steps and at its end; is this the directory <storage_path>/<run_name>?)"
        )
    if step is not None:
        at = [p for s, p in found if s == step]
        if not at:
            steps = sorted({s for s, _ in found})
            raise ConfigError(f"run directory {run_dir!r} has no checkpoint at step {step}; its steps: {steps}")
        why = verify(at[0], fs)
        if why is not None:
            raise ConfigError(f"the checkpoint at step {step} ({at[0]}) is damaged: {why}")
        return Chosen(step, at[0], fs)
    skipped: list[tuple[str, str]] = []
    for s, p in found:
        why = verify(p, fs)
        if why is None:
            return Chosen(s, p, fs, skipped)
        skipped.append((p, why))
    raise ConfigError(
        f"every checkpoint in {run_dir!r} is damaged: "
        + "; ".join(f"{posixpath.basename(p)}: {why}" for p, why in skipped)
    )


# ---------------------------------------------------------------- reading one tensor at a time


class CheckpointTensors:
    """The model tensors of one checkpoint directory (on the pyarrow filesystem `fs`), read one at a time: each
    tensor's chunks (the shards its ranks wrote) are read as byte ranges and assembled."""

    def __init__(self, path: str, fs: Any) -> None:
        with fs.open_input_stream(posixpath.join(path, METADATA_FILE)) as f:
            metadata = parse_metadata(bytes(f.read()), posixpath.join(path, METADATA_FILE))
        with fs.open_input_stream(posixpath.join(path, STATE_FILE)) as f:
            self.state: dict[str, Any] = json.loads(f.read())
        self.path, self.fs = path, fs
        self._storage = metadata.storage_data
        self._tensors = {
            key[len(MODEL_KEY) :]: value
            for key, value in metadata.state_dict_metadata.items()
            if key.startswith(MODEL_KEY) and hasattr(value, "chunks")
        }

    @property
    def names(self) -> list[str]:
        """The model's tensor names the checkpoint holds (a tie under each name the model had)."""
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        """The full shape of tensor `name`."""
        return tuple(self._tensors[name].size)

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype of tensor `name`."""
        return self._tensors[name].properties.dtype

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor `name` on the CPU, in its stored dtype."""
        pieces = list(self.pieces(name))
        if len(pieces) == 1:
            return pieces[0].reshape(self.shape(name))
        return torch.cat([p.reshape(-1) for p in pieces]).reshape(self.shape(name))

    def pieces(self, name: str) -> Iterator[torch.Tensor]:
        """Tensor `name` as consecutive pieces of its row-major values (read one at a time, each yielded before the
        next is read): its chunks in order when the ranks split it along its first dimension only (FSDP, a
        colwise tensor-parallel split) or it is whole, else the tensor assembled from its chunks."""
        meta = self._tensors[name]
        chunks = sorted(meta.chunks, key=lambda c: tuple(c.offsets))
        by_rows = all(
            tuple(c.offsets[1:]) == (0,) * (len(meta.size) - 1) and tuple(c.sizes[1:]) == tuple(meta.size[1:])
            for c in chunks
        )
        if by_rows:
            for chunk in chunks:
                yield self._chunk(name, chunk)
            return
        out = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for chunk in chunks:
            index = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))
            out[index] = self._chunk(name, chunk)
        yield out

    def _chunk(self, name: str, chunk: Any) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self._storage[MetadataIndex(MODEL_KEY + name, torch.Size(chunk.offsets))]
        if getattr(info, "transform_descriptors", None):
            raise ConfigError(f"{self.path}: tensor {name!r} is stored with transforms raytrain does not read")
        with self.fs.open_input_file(posixpath.join(self.path, info.relative_path)) as f:
            window = typing.cast(typing.IO[bytes], _Window(f, info.offset, info.length))
            part = torch.load(window, map_location="cpu", weights_only=True)
        if tuple(part.shape) != tuple(chunk.sizes):
            raise ConfigError(f"{self.path}: a chunk of {name!r} has shape {list(part.shape)}, not {list(chunk.sizes)}")
        return part


class _Window(io.RawIOBase):
    """The bytes [offset, offset + length) of a seekable file as a file of their own (one chunk of a DCP file is a
    whole `torch.save` archive): `torch.load` reads it without a copy of the chunk in memory first."""

    def __init__(self, file: Any, offset: int, length: int) -> None:
        super().__init__()
        self._file, self._start, self._length, self._at = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._length}[whence]
        self._at = min(max(base + offset, 0), self._length)
        return self._at

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        count = min(len(view), self._length - self._at)
        if count <= 0:
            return 0
        self._file.seek(self._start + self._at)
        done = self._file.readinto(view[:count])
        self._at += done
        return done


# ---------------------------------------------------------------- writing safetensors


def parse_size(text: str | int) -> int:
    """Bytes of a size such as 5GB, 500MB, 64KB or a plain number of bytes; `ConfigError` naming it otherwise."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(text), flags=re.IGNORECASE)
    if not match:
        raise ConfigError(f"max_shard_size must be a size such as 5GB, 500MB or a number of bytes, got {text!r}")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    value = int(number * scale.get(unit, 2**40))
    if value <= 0:
        raise ConfigError(f"max_shard_size must be positive, got {text!r}")
    return value


@dataclass(frozen=True)
class _Planned:
    name: str  # the name it is written under
    stored: str  # the name the checkpoint holds it under
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _shards(planned: list[_Planned], limit: int) -> list[list[_Planned]]:
    """Consecutive groups of at most `limit` bytes (a tensor larger than that alone in its file)."""
    shards: list[list[_Planned]] = [[]]
    size = 0
    for tensor in planned:
        if shards[-1] and size + tensor.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def _write_file(path: str, tensors: list[_Planned], read: Callable[[_Planned], Iterator[torch.Tensor]]) -> None:
    """One safetensors file: the 8-byte header length, the JSON header (padded to 8 bytes), then each tensor's
    bytes in order, read and written piece by piece (`CheckpointTensors.pieces`)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in tensors:
        header[tensor.name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for tensor in tensors:
            for piece in read(tensor):
                if piece.numel():
                    f.write(piece.contiguous().view(-1).view(torch.uint8).numpy().data)
                del piece


# ---------------------------------------------------------------- the export


@dataclass(frozen=True)
class ExportResult:
    """What `export` wrote: the checkpoint's step and directory, the files, the tensors and their bytes."""

    step: int
    checkpoint: str
    out_dir: str
    files: list[str]
    tensors: int
    nbytes: int


def _plan(reader: CheckpointTensors, dtype: torch.dtype | None) -> tuple[list[_Planned], list[str]]:
    """The tensors to write (a tie once, under the name the record keeps) and the notes for the log."""
    record = reader.state.get("model") or {}
    notes = []
    if not record:
        notes.append(
            "this checkpoint records no model (written before raytrain recorded one): a tied parameter is written "
            "under each of its names, and no config.json"
        )
    held = set(reader.names)
    leave_out = set(record.get("leave_out", []))
    stored_as: dict[str, str] = {}  # the name written -> the name the checkpoint holds it under
    for group in record.get("ties", []):
        kept = next((name for name in group if name not in leave_out), group[0])
        holder = next((name for name in group if name in held), None)
        if holder is not None:
            stored_as[kept] = holder
    written = [name for name in reader.names if name not in leave_out]
    for kept in stored_as:
        if kept not in written:
            written.append(kept)
    planned = []
    for name in written:
        stored = stored_as.get(name, name)
        stored_dtype = reader.dtype(stored)
        target = dtype if dtype is not None and stored_dtype.is_floating_point else stored_dtype
        planned.append(_Planned(name, stored, reader.shape(stored), target))
    return planned, notes


def export(
    run_dir: str,
    out_dir: str,
    *,
    step: int | None = None,
    dtype: str | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD,
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
) -> ExportResult:
    """Write the model of `run_dir`'s checkpoint (the newest intact one, or the one at `step`) to the local
    directory `out_dir` as safetensors (module docstring). `dtype` ("bf16", "fp16", "fp32"; None: as stored)
    converts the floating-point tensors. `out_dir` must be empty or absent unless `overwrite`, which replaces the
    files an export writes and leaves others (a tokenizer's). `log` receives one line per decision (a damaged
    checkpoint skipped, the files written). `ConfigError` names a bad argument or checkpoint."""
    say = log or (lambda line: None)
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)} (or None: as stored), got {dtype!r}")
    limit = parse_size(max_shard_size)
    existing = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"output {out_dir!r} is a file, not a directory")
    if existing and not overwrite:
        shown = ", ".join(existing[:4]) + (", ..." if len(existing) > 4 else "")
        raise ConfigError(
            f"output directory {out_dir!r} is not empty ({shown}): choose another, or pass --overwrite "
            "(overwrite=True) to replace the model files in it"
        )
    chosen = choose_checkpoint(run_dir, step)
    for path, why in chosen.skipped:
        say(f"WARNING: checkpoint {posixpath.basename(path)} is damaged ({why}); exporting an older one")
    reader = CheckpointTensors(chosen.path, chosen.fs)
    planned, notes = _plan(reader, DTYPES.get(dtype or ""))
    for note in notes:
        say(note)
    os.makedirs(out_dir, exist_ok=True)
    for name in existing:
        if WRITTEN.match(name):
            os.remove(os.path.join(out_dir, name))

    def read(tensor: _Planned) -> Iterator[torch.Tensor]:
        return (piece.to(tensor.dtype) for piece in reader.pieces(tensor.stored))

    shards = _shards(planned, limit)
    files = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for file, shard in zip(files, shards, strict=True):
        _write_file(os.path.join(out_dir, file), shard, read)
    total = sum(t.nbytes for t in planned)
    if len(files) > 1:
        weight_map = {t.name: file for file, shard in zip(files, shards, strict=True) for t in shard}
        with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        files.append(INDEX_FILE)
    files += _write_transformers_files(reader.state.get("model") or {}, out_dir, dtype)
    say(
        f"exported step {chosen.step} ({posixpath.basename(chosen.path)}): {len(planned)} tensors, "
        f"{total / 2**20:.4g} MiB in {len(files)} files to {out_dir}"
    )
    return ExportResult(chosen.step, chosen.path, out_dir, files, len(planned), total)


def _write_transformers_files(record: dict[str, Any], out_dir: str, dtype: str | None) -> list[str]:
    """config.json (and generation_config.json) of a transformers model's record; the names written."""
    saved = record.get("transformers")
    if not saved:
        return []
    config = dict(saved["config"])
    if dtype is not None:
        names = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
        config["dtype" if "dtype" in config or "torch_dtype" not in config else "torch_dtype"] = names[dtype]
    written = ["config.json"]
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    if saved.get("generation_config"):
        with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
            json.dump(saved["generation_config"], f, indent=2, sort_keys=True)
        written.append("generation_config.json")
    return written


# ---------------------------------------------------------------- loading into the user's model


def load_model(run_dir: str, model_fn: Callable[[], nn.Module], *, step: int | None = None) -> nn.Module:
    """`model_fn()` with the weights of `run_dir`'s checkpoint (the newest intact one, or the one at `step`), on
    the CPU, in eval mode: for evaluation and inference in one process. Every parameter and persistent buffer must
    be in the checkpoint with its shape (one name of a tie is enough) and every tensor of the checkpoint must be
    the model's: `ConfigError` names the first that is not."""
    from raytrain.model_init import refuse_lazy
    from raytrain.pretrained import expected_tensors

    chosen = choose_checkpoint(run_dir, step)
    reader = CheckpointTensors(chosen.path, chosen.fs)
    model = model_fn()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model_fn must return a torch.nn.Module, got {type(model).__name__}")
    refuse_lazy(model)
    held = set(reader.names)
    where = f"checkpoint at step {chosen.step} ({chosen.path})"
    used: set[str] = set()
    with torch.no_grad():
        for names, tensor in expected_tensors(model):
            found = [name for name in names if name in held]
            if not found:
                raise ConfigError(
                    f"the {where} has no tensor {names[0]!r} of model_fn's model: is model_fn the one the run trained?"
                )
            if reader.shape(found[0]) != tuple(tensor.shape):
                raise ConfigError(
                    f"tensor {found[0]!r} has shape {list(reader.shape(found[0]))} in the {where}, "
                    f"{list(tensor.shape)} in model_fn's model"
                )
            tensor.copy_(reader.read(found[0]).to(tensor.dtype))
            used.update(names)
    surplus = sorted(held - used)
    if surplus:
        raise ConfigError(
            f"the {where} holds {len(surplus)} tensor(s) model_fn's model does not have, e.g. {surplus[0]!r}: is "
            "model_fn the one the run trained?"
        )
    return model.eval()


def iter_tensors(run_dir: str, step: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) of every model tensor of `run_dir`'s checkpoint, one at a time (tests, tools)."""
    chosen = choose_checkpoint(run_dir, step)
    reader = CheckpointTensors(chosen.path, chosen.fs)
    for name in reader.names:
        yield name, reader.read(name)
