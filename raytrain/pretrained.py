"""Pretrained weights: `ElasticTrainer(init_from=PATH)` starts the model from a safetensors file or a Hugging Face
model directory (`model.safetensors`, or `model.safetensors.index.json` and its shards), local or on object storage
(`s3://bucket/prefix?endpoint_override=...`, through pyarrow, credentials from the environment).

The driver reads only the files' headers (`open_pretrained`) and checks the names against the model
(`check_names`): every parameter and persistent buffer must be in the files (one name of a tied parameter is
enough: `save_pretrained` stores a tie once) and every tensor in the files must be the model's, with the model's
shape; a missing or unexpected name is a `ConfigError` naming it. `key_map(file_name) -> model_name | None`
renames the files' tensors (None leaves one out), for checkpoints written with other names.

Every rank then reads the bytes its shard needs and no more (`read_local`): for a tensor sharded on its first
dimension (FSDP's `Shard(0)`, tensor parallel's colwise split) the rows of its shard, one range read; for another
split (tensor parallel's rowwise `Shard(1)`) the rows it spans, sliced in memory; a replicated tensor whole. The
peak per rank during the load is its shard plus one tensor's slice, never the whole model. Values are copied bit
for bit and cast to the model's dtype where the file's differs. Safetensors is a plain format (an 8-byte header
length, a JSON header of name -> dtype, shape, byte range, then the data): nothing in the file is executed.
"""

from __future__ import annotations

import json
import math
import posixpath
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from raytrain.errors import ConfigError

KeyMap = Callable[[str], str | None]
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: its file, dtype, shape and the absolute byte offset of its data."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize


@dataclass
class Pretrained:
    """The index of a pretrained checkpoint: its tensors by the model's names (after `key_map`). Picklable: the
    driver builds it once and every worker reads through it. `bytes_read` counts this process's reads."""

    uri: str
    entries: dict[str, TensorEntry]
    bytes_read: int = 0
    _fs: Any = field(default=None, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        return {"uri": self.uri, "entries": self.entries, "bytes_read": 0, "_fs": None}

    @property
    def nbytes(self) -> int:
        """The tensors' bytes in the files."""
        return sum(entry.nbytes for entry in self.entries.values())

    def _filesystem(self) -> Any:
        if self._fs is None:
            self._fs = _filesystem(self.uri)[0]
        return self._fs

    def _read(self, entry: TensorEntry, first_row: int, rows: int) -> torch.Tensor:
        """Rows [first_row, first_row + rows) of the tensor (all of a 0-d tensor), as a CPU tensor."""
        shape = entry.shape
        row_bytes = math.prod(shape[1:]) * entry.torch_dtype.itemsize if shape else entry.torch_dtype.itemsize
        size = rows * row_bytes
        with self._filesystem().open_input_file(entry.file) as f:
            data = f.read_at(size, entry.offset + first_row * row_bytes) if size else b""
        self.bytes_read += size
        flat = (
            torch.frombuffer(bytearray(data), dtype=entry.torch_dtype)
            if size
            else torch.empty(0, dtype=entry.torch_dtype)
        )
        return flat.reshape((rows, *shape[1:]) if shape else ())

    def read_full(self, name: str) -> torch.Tensor:
        """The whole tensor `name`."""
        entry = self.entries[name]
        return self._read(entry, 0, entry.shape[0] if entry.shape else 1)

    def read_local(self, name: str, target: torch.Tensor) -> torch.Tensor:
        """This rank's part of tensor `name` for `target` (a DTensor shard, or a whole tensor), reading only the rows
        it spans; cast to `target`'s dtype."""
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        entry = self.entries[name]
        if not isinstance(target, DTensor) or not entry.shape:
            return self.read_full(name).to(target.dtype)
        if not all(type(p) is Shard or p.is_replicate() for p in target.placements):
            # a split of a split (FSDP over tensor parallel): read whole, let DTensor pick this rank's part
            full = self.read_full(name)
            return distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(entry.shape, target.device_mesh, target.placements)
        rows = self._read(entry, offset[0], shape[0])
        index = tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:], strict=True))
        return rows[(slice(None), *index)].to(target.dtype)


def _filesystem(uri: str) -> tuple[Any, str]:
    from raytrain.storage import filesystem_of

    return filesystem_of(uri, "init_from")


def _header(fs: Any, path: str) -> dict[str, Any]:
    with fs.open_input_file(path) as f:
        size = f.size()
        length = int(np.frombuffer(f.read_at(8, 0), dtype="<u8")[0]) if size >= 8 else -1
        if not 0 < length <= size - 8:
            raise ValueError(f"its header length ({length}) does not fit its {size} bytes")
        header = json.loads(f.read_at(length, 8))
    header.pop("__metadata__", None)
    base = 8 + length
    return {name: (info, base) for name, info in header.items()}


def open_pretrained(uri: str, key_map: KeyMap | None = None) -> Pretrained:
    """Index the safetensors file or Hugging Face model directory at `uri` (headers only). Raises `ConfigError`
    naming the path when nothing loadable is there, a file is not safetensors, a dtype is unknown, or `key_map`
    maps two tensors to one name."""
    fs, path = _filesystem(uri)
    import pyarrow.fs as pafs

    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        files = [path]
    elif info.type == pafs.FileType.Directory:
        index, single = posixpath.join(path, INDEX_FILE), posixpath.join(path, SINGLE_FILE)
        if fs.get_file_info(index).type == pafs.FileType.File:
            with fs.open_input_stream(index) as f:
                weight_map = json.loads(f.read())["weight_map"]
            files = [posixpath.join(path, name) for name in sorted(set(weight_map.values()))]
        elif fs.get_file_info(single).type == pafs.FileType.File:
            files = [single]
        else:
            found = sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector(path)))[:8]
            raise ConfigError(
                f"init_from {uri!r} holds neither {SINGLE_FILE} nor {INDEX_FILE} (found {found}); raytrain reads "
                "safetensors (save_pretrained's default; convert a pytorch_model.bin with safetensors' convert)"
            )
    else:
        raise ConfigError(f"init_from {uri!r} does not exist")
    entries: dict[str, TensorEntry] = {}
    for file in files:
        try:
            header = _header(fs, file)
        except (OSError, ValueError, UnicodeDecodeError) as err:
            raise ConfigError(f"init_from: {file} is not a safetensors file ({err})") from None
        for name, (meta, base) in header.items():
            if meta["dtype"] not in DTYPES:
                raise ConfigError(
                    f"init_from: tensor {name!r} in {file} has dtype {meta['dtype']}, not one of {sorted(DTYPES)}"
                )
            mapped = key_map(name) if key_map is not None else name
            if mapped is None:
                continue
            if mapped in entries:
                raise ConfigError(f"init_from: key_map maps two tensors of the files to {mapped!r}")
            entries[mapped] = TensorEntry(file, meta["dtype"], tuple(meta["shape"]), base + meta["data_offsets"][0])
    return Pretrained(uri, entries)


def expected_tensors(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """The model's tensors a checkpoint holds, each with all its names: every parameter and persistent buffer
    (a tied parameter once, under each of its names)."""
    state_names = set(model.state_dict(keep_vars=True))
    by_id: dict[int, tuple[list[str], torch.Tensor]] = {}
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in tensors:
        if name in state_names:
            by_id.setdefault(id(tensor), ([], tensor))[0].append(name)
    return list(by_id.values())


MISSING_CHOICES = ("init", "error")  # ElasticTrainer(init_missing=...): a model tensor the files lack
UNEXPECTED_CHOICES = ("error", "ignore")  # ElasticTrainer(init_unexpected=...): a file tensor the model lacks


def check_names(
    pretrained: Pretrained, model: nn.Module, *, missing: str = "init", unexpected: str = "error"
) -> list[str]:
    """Check the checkpoint against `model` (on the meta device is enough) and return the lines for the log.

    - A tensor of the model the files lack (a new head on a pretrained trunk): with `missing="init"` it keeps the
      model's own init (the build replays `model_fn`'s code for it, the same at every W), listed in one line; with
      "error" a `ConfigError` names it. One name of a tied parameter is enough (save_pretrained stores a tie once).
    - A tensor in the files the model lacks (the LM head of a model fine-tuned as a classifier): `ConfigError`
      naming it, or with `unexpected="ignore"` left out of `pretrained` (never read), in one line.
    - A shape that differs: always a `ConfigError` naming the tensor and both shapes.
    - Files of a base model for a model with a head (transformers' `base_model_prefix`: "h.0.attn..." for a
      model whose names are "transformer.h.0.attn..."), or the reverse: the prefix is added or removed, in one line.
    """
    if missing not in MISSING_CHOICES:
        raise ConfigError(f"init_missing must be one of {MISSING_CHOICES}, got {missing!r}")
    if unexpected not in UNEXPECTED_CHOICES:
        raise ConfigError(f"init_unexpected must be one of {UNEXPECTED_CHOICES}, got {unexpected!r}")
    expected = expected_tensors(model)
    lines = [_match_base_prefix(pretrained, model, {name for names, _ in expected for name in names})]
    used: set[str] = set()
    absent: list[str] = []
    for names, tensor in expected:
        found = [name for name in names if name in pretrained.entries]
        if not found:
            absent.append(names[0])
            continue
        entry = pretrained.entries[found[0]]
        if entry.shape != tuple(tensor.shape):
            raise ConfigError(
                f"init_from {pretrained.uri!r}: tensor {found[0]!r} has shape {list(entry.shape)} in the files, "
                f"{list(tensor.shape)} in the model"
            )
        used.update(found)
    if absent and (missing == "error" or not used):
        why = "init_missing='error'" if used else "not one of the model's tensors is in the files"
        raise ConfigError(
            f"init_from {pretrained.uri!r} has no tensor {absent[0]!r} of the model ({_count(absent)} missing; "
            f"{why}): pass init_key_map to map the files' names to the model's"
            + ("" if used else ", or check that init_from holds this model's weights")
        )
    surplus = sorted(set(pretrained.entries) - used)
    if surplus and unexpected == "error":
        raise ConfigError(
            f"init_from {pretrained.uri!r} holds {_count(surplus)} the model does not have, e.g. {surplus[0]!r}: "
            "pass init_unexpected='ignore' to leave them out (e.g. an LM head under a classifier), or init_key_map "
            "to map their names to the model's"
        )
    for name in surplus:
        del pretrained.entries[name]
    lines.append(
        f"weights from {pretrained.uri}: {len(pretrained.entries)} tensors, {pretrained.nbytes / 2**20:.4g} MiB"
    )
    if absent:
        verb = "keeps" if len(absent) == 1 else "keep"
        lines.append(f"init_from: {_count(absent)} not in the files {verb} the model's own init: {_names(absent)}")
    if surplus:
        lines.append(
            f"init_from: {_count(surplus)} of the files left out (init_unexpected='ignore'): {_names(surplus)}"
        )
    return [line for line in lines if line]


def _count(names: list[str]) -> str:
    return f"{len(names)} tensor" + ("" if len(names) == 1 else "s")


def _names(names: list[str], shown: int = 6) -> str:
    return ", ".join(names[:shown]) + (f", ... ({len(names) - shown} more)" if len(names) > shown else "")


def _match_base_prefix(pretrained: Pretrained, model: nn.Module, wanted: set[str]) -> str:
    """Rename `pretrained`'s entries when its files hold a transformers base model and `model` has a head over it
    (their names lack the model's `base_model_prefix`), or the reverse, and more names match that way; returns the
    line saying so ("" when nothing is renamed)."""
    prefix = getattr(model, "base_model_prefix", "")
    if not isinstance(prefix, str) or not prefix:
        return ""
    names = list(pretrained.entries)
    direct = sum(name in wanted for name in names)
    added = {name: f"{prefix}.{name}" for name in names}
    removed = {name: name.removeprefix(f"{prefix}.") for name in names}
    best = max((added, removed), key=lambda renames: sum(new in wanted for new in renames.values()))
    if sum(new in wanted for new in best.values()) <= direct or len(set(best.values())) < len(names):
        return ""
    pretrained.entries = {best[name]: entry for name, entry in pretrained.entries.items()}
    how = "lack" if best is added else "carry"
    return f"init_from: the files' names {how} the model's prefix {prefix!r} ({names[0]!r}): matched with it"


def stored_name(pretrained: Pretrained, name: str, aliases: Mapping[str, Sequence[str]] | None = None) -> str | None:
    """The name under which `pretrained` holds the model's tensor `name`: itself, else another name of the same
    tied parameter (`aliases`: {name: its other names in the whole model}; a pipeline stage may hold a tie under
    the name save_pretrained left out), else None."""
    if name in pretrained.entries:
        return name
    return next((other for other in (aliases or {}).get(name, ()) if other in pretrained.entries), None)


def load_into(
    model: nn.Module, pretrained: Pretrained, aliases: Mapping[str, Sequence[str]] | None = None
) -> list[str]:
    """Fill a materialized `model` (possibly sharded) with the tensors `pretrained` holds, this rank's part only
    (a tied parameter under any of its names: `stored_name`); returns the names left as they were (the tensors
    the files do not hold)."""
    from raytrain.model_tensors import fill

    def value(name: str, target: torch.Tensor) -> torch.Tensor | None:
        stored = stored_name(pretrained, name, aliases)
        return None if stored is None else pretrained.read_local(stored, target)

    return fill(model, value)
