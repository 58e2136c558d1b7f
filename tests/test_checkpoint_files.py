"""Checkpoint integrity and safe reading (no Ray): a manifest proves a checkpoint whole; DCP files are read
without unpickling arbitrary objects."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from raytrain.checkpoint import (
    CONSUMED_FILE,
    CONSUMED_IDS_FILE,
    SafeReader,
    TrainState,
    load_checkpoint,
    load_consumed,
    load_extras,
    save_checkpoint,
)
from raytrain.checkpoint_files import checkpoint_dirs, verify
from raytrain.data.id_ranges import IdRanges


def _checkpoint(tmp_path: Path, step: int = 3) -> tuple[Path, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    consumed = IdRanges.from_ids(np.array([3, 4, 5, 9]))
    directory = Path(save_checkpoint(model, optimizer, TrainState(step=step), 0, consumed))
    target = tmp_path / f"checkpoint_{step}"
    shutil.move(str(directory), target)
    return target, model


def test_a_whole_checkpoint_verifies_and_loads_through_the_safe_reader(tmp_path: Path) -> None:
    directory, model = _checkpoint(tmp_path)
    assert verify(str(directory)) is None
    manifest = json.loads((directory / "manifest.json").read_text())["files"]
    assert {".metadata", "__0_0.distcp", "raytrain_state.json", "consumed_ranges.npy"} <= set(manifest)
    fresh = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    state, consumed = load_checkpoint(str(directory), fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3))
    assert state.step == 3
    assert consumed.ranges.tolist() == [[3, 6], [9, 10]]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True))


def test_a_truncated_or_missing_shard_is_named(tmp_path: Path) -> None:
    directory, _ = _checkpoint(tmp_path)
    shard = directory / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    assert verify(str(directory)) == f"__0_0.distcp has {size // 2} of its {size} bytes"
    shard.unlink()
    assert verify(str(directory)) == "__0_0.distcp is missing"
    (directory / "manifest.json").unlink()
    assert verify(str(directory)) == "no manifest.json (the save did not finish)"


def test_checkpoints_of_raytrain_0_1_without_a_manifest_are_accepted(tmp_path: Path) -> None:
    directory, _ = _checkpoint(tmp_path)
    (directory / "manifest.json").unlink()
    state = json.loads((directory / "raytrain_state.json").read_text())
    del state["format_version"]
    (directory / "raytrain_state.json").write_text(json.dumps(state))
    assert verify(str(directory)) is None
    assert checkpoint_dirs(str(tmp_path)) == [(3, str(directory))]


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def test_crafted_metadata_is_refused_not_executed(tmp_path: Path) -> None:
    directory, _ = _checkpoint(tmp_path)
    marker = tmp_path / "code-ran"
    (directory / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"][".metadata"] = (directory / ".metadata").stat().st_size
    (directory / "manifest.json").write_text(json.dumps(manifest))
    reason = verify(str(directory))
    assert reason is not None and "which raytrain does not load" in reason and "system" in reason
    with pytest.raises(pickle.UnpicklingError, match="which raytrain does not load"):
        SafeReader(str(directory)).read_metadata()
    assert not marker.exists()
    # The negative control: DCP's own reader unpickles the file as it is, and so runs the payload.
    with pytest.raises(AttributeError):  # the payload's return value is not metadata: DCP fails only after it ran
        dcp.FileSystemReader(str(directory)).read_metadata()
    assert marker.exists()


def test_consumed_ids_of_a_checkpoint_written_before_ranges_still_load(tmp_path: Path) -> None:
    directory, _ = _checkpoint(tmp_path)
    (directory / CONSUMED_FILE).unlink()
    np.save(directory / CONSUMED_IDS_FILE, np.array([3, 4, 5, 9], dtype=np.int64))
    assert load_consumed(str(directory)).ranges.tolist() == [[3, 6], [9, 10]]


def test_a_checkpoint_with_the_optimizer_state_in_the_nested_form_loads(tmp_path: Path) -> None:
    """The nested form (groups as a list: what torch writes by default, and raytrain for every layout but a
    pipeline) is recognised and loads into a fresh model and optimizer: same weights, each group's options, the
    AdamW state. The pipeline's flattened form is loaded by tests/test_parallel_equivalence.py."""
    import json
    from dataclasses import asdict

    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from raytrain.checkpoint import TrainState, load_checkpoint
    from raytrain.toy import adamw_groups, mlp

    torch.manual_seed(0)
    model = mlp()
    optimizer = adamw_groups(model, 0.01)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    old = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}  # nested
    dcp.save(old, checkpoint_id=str(tmp_path), no_dist=True)
    (tmp_path / "raytrain_state.json").write_text(json.dumps(asdict(TrainState(step=3))))
    np.save(tmp_path / "consumed_ranges.npy", np.zeros((0, 2), dtype=np.int64))
    torch.manual_seed(1)
    fresh = mlp()
    fresh_optimizer = adamw_groups(fresh, 0.01)
    state, _ = load_checkpoint(str(tmp_path), fresh, fresh_optimizer)
    assert state.step == 3
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))
    assert [g["lr"] for g in fresh_optimizer.param_groups] == [g["lr"] for g in optimizer.param_groups]
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(optimizer.state[p]["exp_avg"], fresh_optimizer.state[q]["exp_avg"])


class _Named:
    """User state keyed by names given at construction (an EMA keyed by a wrapper's names, say)."""

    def __init__(self, names: list[str]) -> None:
        self.tensors = {name: torch.full((2,), float(i)) for i, name in enumerate(names)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.tensors = dict(state)


def test_user_state_keyed_by_names_that_changed_is_refused_naming_both(tmp_path: Path) -> None:
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = _Named(["module.weight", "module.bias"])  # as keyed through DDP's wrapper at W > 1
    directory = save_checkpoint(model, optimizer, TrainState(step=1), 0, IdRanges(), extras={"ema": saved})
    same = _Named(["module.weight", "module.bias"])
    same.tensors = {k: torch.zeros(2) for k in same.tensors}
    assert load_extras(directory, {"ema": same}) == []
    assert torch.equal(same.tensors["module.bias"], torch.full((2,), 1.0))
    with pytest.raises(ValueError, match=r"holds \['module.bias', 'module.weight'\]\.\.\., not \['bias', 'weight'\]"):
        load_extras(directory, {"ema": _Named(["weight", "bias"])})  # the same state keyed at W = 1
