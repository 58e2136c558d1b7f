"""The one writer of a live run's files: a Ray actor on the driver's node that takes the step records and the
checkpoints which the rank-0 participant of each step sends, and writes them to the run directory in the restart
path's formats (metrics.jsonl, samples.jsonl, events.jsonl, raytrain.log; `raytrain.rank0.Rank0Log`).

Rank 0 of a live step changes when replicas come and go, so no worker owns the files: every replica that
committed a step sends its record, the first record of each step is written, steps in order, and the
participant count is logged each time it changes. Live checkpoints are `live-checkpoint-<step>/` directories in
the restart path's format (`raytrain.checkpoint`: the model and the flattened optimizer state with DCP, the train
state in raytrain_state.json, a manifest), written by this one process from the whole state the replica group of
rank 0 gathered, so that either recovery mode resumes from either's checkpoints at any world size and layout (DCP
reshards on load). Each is written to a temporary name and renamed, so a crash mid-write leaves the previous one
intact.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from raytrain.checkpoint import TrainState
from raytrain.checkpoint_files import LIVE_CHECKPOINT_PREFIX as CHECKPOINT_PREFIX
from raytrain.checkpoint_files import STATE_FILE, live_checkpoints
from raytrain.rank0 import Rank0Log, resize_line

LIVE_EVENTS_FILE = "live.jsonl"  # membership of the live replicas: joined, lost, fallback (one JSON line each)


@dataclass(frozen=True)
class PackedTensor:
    """A tensor as a live checkpoint travels to the log: its bytes as a numpy array (which Ray ships out of band,
    one copy into the object store, where pickling a torch tensor copies it through pickle), its dtype and shape."""

    data: np.ndarray
    dtype: torch.dtype
    shape: tuple[int, ...]


def pack_state(value: Any) -> Any:
    """A state dict's copy for a fire-and-forget call to the log: every tensor copied (detached from training,
    so the next step cannot change the checkpoint) and packed as a `PackedTensor`; other values as they are.
    `unpack_state` inverts it exactly, for every dtype (bfloat16 included)."""
    if isinstance(value, torch.Tensor):
        copy = value.detach().cpu().clone(memory_format=torch.contiguous_format)  # one copy, contiguous
        return PackedTensor(copy.reshape(-1).view(torch.uint8).numpy(), copy.dtype, tuple(copy.shape))
    if isinstance(value, dict):
        return {k: pack_state(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(pack_state(v) for v in value)
    return value


def unpack_state(value: Any) -> Any:
    """`pack_state`'s inverse: the tensors back, each in memory of its own (writable, not the object store's)."""
    if isinstance(value, PackedTensor):
        return torch.from_numpy(value.data.copy()).view(value.dtype).reshape(value.shape)
    if isinstance(value, dict):
        return {k: unpack_state(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(unpack_state(v) for v in value)
    return value


def check_resumable_with(
    state: TrainState, config: dict[str, Any], num_rows: int, data_order: dict[str, int] | None = None
) -> None:
    """`ConfigError` when a checkpoint a live run resumes from (its own, or the restart path's) was written with
    another global batch, seed, drop_last, data size or Parquet order (`data_order`: partitions, shuffle window,
    row groups) than the run resuming from it, or at a data position other than the one its step has at this
    global batch: live mode finds a step's samples from the step number and these, so any of them changed would
    skip or repeat samples."""
    from raytrain.data.materialized import step_position
    from raytrain.errors import ConfigError

    stored = state.config
    pairs = {
        "batch.global_batch": (stored.get("batch", {}).get("global_batch"), config["batch"]["global_batch"]),
        "batch.drop_last": (stored.get("batch", {}).get("drop_last"), config["batch"]["drop_last"]),
        "loop.seed": (stored.get("loop", {}).get("seed"), config["loop"]["seed"]),
        "training rows": (state.num_rows or state.plan.get("num_rows"), num_rows),  # the plan's: live, before
        "data order": (state.data_order or None, data_order or None),
    }
    changed = [f"{name} {old!r} -> {new!r}" for name, (old, new) in pairs.items() if old is not None and old != new]
    if not changed:
        batch, drop_last = config["batch"]["global_batch"], config["batch"]["drop_last"]
        position = step_position(state.step, num_rows, batch, drop_last) if num_rows else None
        at = (state.epoch, state.sample_in_epoch)
        if state.sample_in_epoch + (batch if drop_last else 1) > num_rows:  # no step left: the next epoch's start
            at = (state.epoch + 1, 0)
        if position is not None and position != at:
            raise ConfigError(
                f"checkpoint step {state.step} is at epoch {state.epoch}, sample {state.sample_in_epoch}, not where "
                f"live mode puts step {state.step} at global batch {batch} (epoch {position[0]}, sample "
                f"{position[1]}): the run changed its global batch before it; resume it in restart mode"
            )
    if changed:
        raise ConfigError(
            f"checkpoint step {state.step} was written with other settings than this run: {', '.join(changed)};"
            " live mode resumes only with the same ones (the restart path can change the global batch), or start "
            "a new run_name"
        )


def read_train_state(directory: str) -> TrainState:
    """A checkpoint's train state (live or restart path: the same file), nothing else loaded."""
    with open(os.path.join(directory, STATE_FILE)) as f:
        return TrainState.from_json(json.load(f))


class LiveLog:
    """The run's rank-0 files (see the module docstring). Methods are called by the replicas (`step`,
    `checkpoint`) and the driver (`begin`, `note`, `membership`, `last_step`)."""

    def __init__(
        self,
        run_dir: str,
        *,
        audit: bool,
        log_every: int,
        keep: int,
        config: dict[str, Any],
        num_rows: int = 0,
        data_order: dict[str, int] | None = None,
    ) -> None:
        self.run_dir, self.keep, self.config, self.num_rows = run_dir, keep, config, num_rows
        self.data_order = data_order or {}
        self.log = Rank0Log(0, run_dir, audit=audit, log_every=log_every)
        self.last = 0
        self.times: list[float] = []  # when the latest committed steps were recorded (at most ten)
        self.group = 0
        self.pending: dict[int, tuple[dict[str, Any], list[int] | None]] = {}  # steps waiting for an earlier one
        self.plan: dict[str, Any] | None = None
        self.lr: float | None = None
        self.tp = 1

    def begin(self, group: int, restored_step: int, event: dict[str, Any], total_steps: int) -> None:
        """Group `group`'s (re)start of the live run: trim what came after `restored_step`, append `event` to
        events.jsonl. From now on records of earlier groups (sent by replicas before the fallback stopped them)
        are ignored."""
        self.group, self.pending = group, {}
        self.last, self.plan = restored_step, event["plan"]
        self.lr = event["lr"]
        self.tp = event.get("layout", {}).get("tp", 1)  # workers per data rank: a step's world is dp x tp
        self.log.total_steps = total_steps
        self.log.start(restored_step=restored_step, event=event)

    def note(self, message: str) -> None:
        """One line in the run's log (printed by the driver's log tail)."""
        self.log.print(message)

    def membership(self, record: dict[str, Any]) -> None:
        """One line of live.jsonl: a replica joined or was lost, or the run fell back to a restart."""
        with open(os.path.join(self.run_dir, LIVE_EVENTS_FILE), "a") as f:
            f.write(json.dumps({**record, "time": time.time()}) + "\n")

    def fence(self, group: int) -> None:
        """From now on only group `group`'s records count (the driver calls it before a group starts: records a
        stopped group's replicas sent before they died are dropped)."""
        self.group, self.pending = group, {}

    def step(self, group: int, metrics: dict[str, Any], ids: list[int] | None) -> None:
        """A committed step from a replica of group `group` (every replica that committed it sends it): the first
        record of each step is kept, and steps are written in order (a later step waits for the earlier ones)."""
        if group != self.group or metrics["step"] <= self.last:
            return
        self.pending.setdefault(metrics["step"], (metrics, ids))
        while self.last + 1 in self.pending:
            self._write(*self.pending.pop(self.last + 1))

    def _write(self, metrics: dict[str, Any], ids: list[int] | None) -> None:
        self.last = metrics["step"]
        self.times = [*self.times[-9:], metrics["time"]]
        plan = {  # the step's batch plan, over its data ranks
            "world_size": len(metrics["per_rank_samples"]),
            "accumulation_steps": metrics["accumulation_steps"],
            "per_rank_samples": metrics["per_rank_samples"],
            "global_batch": metrics["global_batch_size"],
        }
        if self.plan is not None and plan["world_size"] != self.plan["world_size"]:
            layout = {"dp": plan["world_size"], "tp": self.tp, "pp": 1}
            line = resize_line(self.plan, plan, metrics["lr"], self.lr, layout, lr_label="lr")  # the step's own
            self.log.print(f"live: step {metrics['step']}: {line} (no restart)")
        self.plan, self.lr = plan, metrics["lr"]
        self.log.step(metrics, ids)

    def checkpoint(self, group: int, state: dict[str, Any], train_state: dict[str, Any]) -> None:
        """Write group `group`'s live checkpoint: `state` (model and flattened optimizer state, as `pack_state`
        made it) with DCP, `train_state` (`raytrain.checkpoint.TrainState`'s fields but the config, data order
        and row count, which this log adds) and the manifest; keep the newest `keep`."""
        import torch.distributed.checkpoint as dcp

        from raytrain.checkpoint import CONSUMED_FILE, one_process_quietly
        from raytrain.checkpoint_files import file_sizes, write_manifest

        step = train_state["step"]
        final = os.path.join(self.run_dir, f"{CHECKPOINT_PREFIX}{step:08d}")
        if group != self.group or os.path.exists(final):
            return
        partial = final + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        tensors = unpack_state(state)
        with one_process_quietly():
            dcp.save({"model": tensors["model"], "optim": tensors["optim"]}, checkpoint_id=partial, no_dist=True)
        plan = {**train_state.pop("plan", {}), "num_rows": self.num_rows}
        record = TrainState(
            **train_state,
            plan=plan,
            config=self.config,
            data_order=self.data_order,
            num_rows=self.num_rows,
        )
        with open(os.path.join(partial, STATE_FILE), "w") as f:
            json.dump(asdict(record), f)
        np.save(os.path.join(partial, CONSUMED_FILE), np.zeros((0, 2), dtype=np.int64))  # the position paths
        write_manifest(partial, file_sizes(partial))
        os.rename(partial, final)
        for _, old in live_checkpoints(self.run_dir)[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def step_interval_s(self) -> float | None:
        """The median interval between the last ten committed steps (None before two): the run's pace."""
        gaps = sorted(b - a for a, b in zip(self.times, self.times[1:], strict=False))
        return gaps[len(gaps) // 2] if gaps else None

    def last_step(self) -> int:
        """The newest committed step written."""
        return self.last

    def close(self) -> None:
        """Close the files (end of the run); a step still waiting for an earlier one is named (never expected:
        every committed step is sent by every replica that committed it)."""
        if self.pending:
            self.log.print(
                f"WARNING: steps {sorted(self.pending)} were recorded but step {self.last + 1} never was; not written"
            )
        self.log.close()
