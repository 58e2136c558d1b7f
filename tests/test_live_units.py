"""Live mode's pure parts and its file writer, without Ray: the share of a step, the data position of a step, the
config rules, the demo's flags, and `LiveLog` (metrics once per step, the resize line, live checkpoints)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from raytrain.checkpoint_files import live_checkpoints
from raytrain.cli.demo import DemoOptions
from raytrain.config import (
    BatchConfig,
    CheckpointConfig,
    ClusterConfig,
    LoopConfig,
    LRConfig,
    ParallelConfig,
    TrainSpec,
)
from raytrain.data.materialized import epoch_order, step_position, step_positions
from raytrain.errors import ConfigError
from raytrain.live.log import LiveLog
from raytrain.live.replica import live_share


@pytest.mark.parametrize("participants", [1, 2, 3, 5, 7])
def test_the_participants_split_the_step_contiguously_and_exactly(participants: int) -> None:
    shares = [live_share(4, 96, 16, participants, rank) for rank in range(participants)]
    assert sum(s.count for s in shares) == 96
    assert [s.offset for s in shares] == list(np.cumsum([0] + [s.count for s in shares[:-1]]))
    for share in shares:
        assert sum(share.micro_batches) == share.count and max(share.micro_batches) <= 16
    with pytest.raises(ValueError, match=r"rank must be in \[0, participants=2\), got 2"):
        live_share(0, 96, 16, 2, 2)


def test_an_epochs_last_step_with_fewer_samples_than_participants_is_split_as_the_restart_path_splits_it() -> None:
    """N = 1001, B = 100, 3 replicas: the epoch's last step holds 1 sample; one replica trains it, the others an
    empty micro-batch (this raised a ConfigError taken for a bug in the user's code)."""
    shares = [live_share(10, 1001 % 100, 16, 3, rank) for rank in range(3)]
    assert [s.count for s in shares] == [1, 0, 0] and [s.offset for s in shares] == [0, 1, 1]
    assert [s.micro_batches for s in shares] == [(1,), (0,), (0,)]


@pytest.mark.parametrize("drop_last", [True, False])
def test_a_steps_data_position_is_the_restart_paths(drop_last: bool) -> None:
    """The live worker's position of step s (from the step number alone) is where the restart path's loop puts
    step s (it advances (epoch, sample_in_epoch) by each step's samples and starts a new epoch when no step is
    left): epochs of the same number of steps, the last one short without drop_last."""
    rows, batch = 50, 12  # 4 full steps and a partial one of 2 samples per epoch
    per_epoch = 4 if drop_last else 5
    epoch, sample = 0, 0
    for step in range(3 * per_epoch):
        assert step_position(step, rows, batch, drop_last) == (epoch, sample)
        taken = len(step_positions(epoch_order(rows, 0, epoch), sample, batch))
        sample += taken
        if sample + (batch if drop_last else 1) > rows:
            epoch, sample = epoch + 1, 0


def _spec(**changes: object) -> TrainSpec:
    parts: dict[str, object] = {
        "batch": BatchConfig(global_batch=24, micro_batch=4),
        "lr": LRConfig(base_lr=0.1),
        "loop": LoopConfig(),
        "checkpoint": CheckpointConfig(storage_path="/tmp/x", run_name="r"),
        "cluster": ClusterConfig(min_workers=1, max_workers=2, recovery="live"),
    }
    parts.update(changes)
    return TrainSpec(**parts)  # type: ignore[arg-type]


def test_live_mode_takes_data_parallel_deterministic_runs_in_whole_replica_groups_only() -> None:
    _spec()  # ddp (the default), fp32, deterministic: accepted
    _spec(loop=LoopConfig(strategy="auto"))
    _spec(parallel=ParallelConfig(precision="bf16"))
    sharded = ClusterConfig(min_workers=2, max_workers=6, recovery="live")
    _spec(loop=LoopConfig(strategy="zero3"), parallel=ParallelConfig(dp_shard=2), cluster=sharded)
    _spec(loop=LoopConfig(strategy="zero2"), parallel=ParallelConfig(dp_shard=2, precision="bf16"), cluster=sharded)
    _spec(parallel=ParallelConfig(tp=2), cluster=sharded)  # groups of 2 workers splitting the model (tp)
    grouped = ClusterConfig(min_workers=4, max_workers=8, recovery="live")
    _spec(loop=LoopConfig(strategy="zero3"), parallel=ParallelConfig(dp_shard=2, tp=2), cluster=grouped)
    with pytest.raises(ConfigError, match=r"parallel.dp_shard=2 sizes live recovery's replica groups: it needs"):
        _spec(parallel=ParallelConfig(dp_shard=2), cluster=ClusterConfig(min_workers=2, max_workers=2))
    with pytest.raises(ConfigError, match=r"dp_shard must be an integer >= 1, got 0"):
        ParallelConfig(dp_shard=0)
    with pytest.raises(ConfigError, match=r"recovery must be one of restart, live, got 'lively'"):
        ClusterConfig(recovery="lively")
    cases = {
        "loop.strategy must be 'ddp' or 'auto'": {"loop": LoopConfig(strategy="zero2")},
        "loop.deterministic must be True": {"loop": LoopConfig(deterministic=False, id_column="id")},
        "parallel.precision must be 'fp32' or 'bf16', got 'fp16'": {"parallel": ParallelConfig(precision="fp16")},
        "loop.strategy must be 'zero2' or 'zero3' with parallel.dp_shard=2 (the group shards the model), got 'ddp'": {
            "parallel": ParallelConfig(dp_shard=2),
            "cluster": ClusterConfig(min_workers=2, max_workers=4, recovery="live"),
        },
        "cluster.max_workers=5 must be a multiple of parallel.dp_shard=2": {
            "loop": LoopConfig(strategy="zero3"),
            "parallel": ParallelConfig(dp_shard=2),
            "cluster": ClusterConfig(min_workers=2, max_workers=5, recovery="live"),
        },
        "parallel.pp must be 1 (a replica group is dp_shard x tp workers of one node": {
            "parallel": ParallelConfig(pp=2),
            "cluster": ClusterConfig(min_workers=2, max_workers=2, recovery="live"),
        },
        "cluster.min_workers=2 must be a multiple of parallel.dp_shard x tp = 2 x 2 = 4": {
            "loop": LoopConfig(strategy="zero3"),
            "parallel": ParallelConfig(dp_shard=2, tp=2),
            "cluster": ClusterConfig(min_workers=2, max_workers=8, recovery="live"),
        },
        "cluster.use_gpu must be False": {
            "cluster": ClusterConfig(min_workers=1, max_workers=2, use_gpu=True, recovery="live")
        },
    }
    for message, changes in cases.items():
        with pytest.raises(ConfigError, match=r'ClusterConfig\(recovery="live"\) runs replica groups of') as err:
            _spec(**changes)
        assert message in str(err.value) and 'or use recovery="restart"' in str(err.value)


def test_demo_refuses_live_with_what_live_mode_does_not_run() -> None:
    DemoOptions(recovery="live", events="kill@5")
    DemoOptions(recovery="live", strategy="zero3", dp_shard=2, slots_per_node=2, min_workers=2, max_workers=6)
    with pytest.raises(ConfigError, match=r"--strategy 'zero1' \(live mode runs ddp with --dp-shard 1\)"):
        DemoOptions(recovery="live", strategy="zero1")
    with pytest.raises(ConfigError, match=r"--strategy 'ddp' \(live mode runs zero2 or zero3 with --dp-shard 2\)"):
        DemoOptions(recovery="live", dp_shard=2, min_workers=2, max_workers=4)
    with pytest.raises(ConfigError, match=r"--workers min 1 \(a multiple of --dp-shard 2: whole groups\)"):
        DemoOptions(recovery="live", strategy="zero3", dp_shard=2, min_workers=1, max_workers=4)
    with pytest.raises(ConfigError, match=r"--dp-shard 2 sizes live mode's replica groups: add --recovery live"):
        DemoOptions(dp_shard=2, strategy="zero3", min_workers=2, max_workers=4)
    DemoOptions(recovery="live", tp=2, slots_per_node=2, min_workers=2, max_workers=4)  # groups of 2 tp workers
    with pytest.raises(ConfigError, match=r"--pp 2 \(live mode runs 1\)"):
        DemoOptions(recovery="live", pp=2, min_workers=2, max_workers=2)
    with pytest.raises(ConfigError, match=r"--slots-per-node 2 \(at least --dp-shard x --tp = 4: a replica group"):
        DemoOptions(recovery="live", tp=2, dp_shard=2, strategy="zero3", slots_per_node=2, min_workers=4, max_workers=4)


def _metrics(step: int, world: int, loss: float = 1.0) -> dict[str, object]:
    per_rank = [24 // world] * world
    return {
        "step": step,
        "epoch": 0,
        "world_size": world,
        "accumulation_steps": 24 // world // 4,
        "per_rank_samples": per_rank,
        "global_batch_size": 24,
        "lr": 0.1,
        "loss": loss,
        "step_time_s": 0.01,
        "time": 0.0,
    }


def test_live_log_writes_each_step_once_and_names_each_change_of_participants(tmp_path: Path) -> None:
    log = LiveLog(str(tmp_path), audit=True, log_every=100, keep=2, config={})
    plan = {"world_size": 3, "accumulation_steps": 2, "per_rank_samples": [8, 8, 8], "global_batch": 24}
    log.begin(1, 0, {"world_size": 3, "plan": plan, "lr": 0.1, "strategy": "ddp"}, total_steps=10)
    log.step(1, _metrics(1, 3), list(range(24)))
    log.step(1, _metrics(1, 3, loss=9.0), list(range(24)))  # a second record of step 1 (after a heal): ignored
    log.step(0, _metrics(2, 3, loss=7.0), list(range(24)))  # from a group stopped by a fallback: ignored
    log.step(1, _metrics(3, 2), list(range(48, 72)))  # arrives before step 2 (another replica sent it): waits
    log.step(1, _metrics(2, 2), list(range(24, 48)))
    log.step(1, _metrics(5, 2), list(range(24)))  # step 4 never arrives: never written, named at close
    log.close()
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3] and [m["loss"] for m in metrics] == [1.0, 1.0, 1.0]
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["ids"][0] for s in samples] == [0, 24, 48]
    text = (tmp_path / "raytrain.log").read_text()
    assert "live: step 2: world 3 -> 2: accumulation 2 -> 3, samples/rank [8,8,8] -> [12,12], global batch 24 " in text
    assert "(no restart)" in text
    assert "WARNING: steps [5] were recorded but step 4 never was; not written" in text


def test_live_log_names_a_change_of_data_ranks_with_tensor_parallel_groups(tmp_path: Path) -> None:
    """Groups of tp workers: a step's world counts workers (data ranks x tp), its plan data ranks; the resize line
    is written when the data ranks change, naming dp and tp, and never for the workers' count alone."""
    log = LiveLog(str(tmp_path), audit=False, log_every=100, keep=2, config={})
    plan = {"world_size": 2, "accumulation_steps": 3, "per_rank_samples": [12, 12], "global_batch": 24}
    layout = {"dp": 2, "dp_replicate": 2, "dp_shard": 1, "tp": 2, "pp": 1}
    log.begin(1, 0, {"world_size": 4, "plan": plan, "lr": 0.1, "strategy": "ddp", "layout": layout}, total_steps=10)
    step = {**_metrics(1, 2), "world_size": 4, "accumulation_steps": 3, "per_rank_samples": [12, 12]}
    log.step(1, step, None)  # 2 data ranks of 2 tp workers: the plan it began with
    log.step(1, {**_metrics(2, 1), "world_size": 2, "accumulation_steps": 6, "per_rank_samples": [24]}, None)
    log.close()
    text = (tmp_path / "raytrain.log").read_text()
    assert "live: step 1" not in text
    assert "live: step 2: dp 2 -> 1, tp 2, pp 1: accumulation 3 -> 6, samples/replica [12,12] -> [24]" in text


def _tiny() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return model, torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}])


def _write_live(log: LiveLog, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """What a live group's rank 0 sends (`LiveReplica.full_state`, packed) for `step` (24 samples a step)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from raytrain.live.log import pack_state

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True)
    sd_model, sd_optim = get_state_dict(model, optimizer, options=options)
    train_state = {"step": step, "epoch": 0, "sample_in_epoch": step * 24, "global_batch": 24, "plan": {}}
    log.checkpoint(0, pack_state({"model": sd_model, "optim": sd_optim}), train_state)


def test_live_checkpoints_are_the_restart_paths_format_whole_or_absent_and_the_newest_are_kept(
    tmp_path: Path,
) -> None:
    from raytrain.checkpoint import load_checkpoint
    from raytrain.checkpoint_files import verify

    model, optimizer = _tiny()
    log = LiveLog(str(tmp_path), audit=False, log_every=100, keep=2, config={"k": 1})
    for step in (5, 10, 15):
        model(torch.ones(2, 3)).sum().backward()
        optimizer.step()
        _write_live(log, step, model, optimizer)
    (tmp_path / "live-checkpoint-00000020.partial").mkdir()  # a write cut short: never listed
    assert [step for step, _ in live_checkpoints(str(tmp_path))] == [10, 15]
    newest = live_checkpoints(str(tmp_path))[-1][1]
    assert verify(newest) is None  # a manifest of whole files, as the restart path writes
    other, other_optimizer = _tiny()
    state, _ = load_checkpoint(newest, other, other_optimizer)  # the restart path's loader
    assert (state.step, state.epoch, state.sample_in_epoch, state.config) == (15, 0, 360, {"k": 1})
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(optimizer.state[a]["exp_avg_sq"], other_optimizer.state[b]["exp_avg_sq"])
    assert [g["weight_decay"] for g in other_optimizer.param_groups] == [0.1, 0.0]


def test_either_recovery_mode_resumes_from_the_others_newer_checkpoint(tmp_path: Path) -> None:
    import argparse
    import json

    import pyarrow.fs as pafs

    from raytrain.checkpoint_files import RAY_SNAPSHOT_FILE, STATE_FILE, newest_checkpoint
    from raytrain.cli.main import _resume_hint
    from raytrain.storage import RunStorage
    from raytrain.trainer import cross_mode_resume, describe_interrupt

    storage = RunStorage(pafs.LocalFileSystem(), str(tmp_path), str(tmp_path))
    for mode in ("restart", "live"):
        assert cross_mode_resume(storage, str(tmp_path), mode) is None  # a new run: nothing to resume
    assert describe_interrupt(storage).endswith("yet; fit() again (the same run_name) starts from step 0")
    model, optimizer = _tiny()
    _write_live(LiveLog(str(tmp_path), audit=False, log_every=100, keep=2, config={}), 5, model, optimizer)
    live = str(tmp_path / "live-checkpoint-00000005")
    assert cross_mode_resume(storage, str(tmp_path), "restart") == live  # the workers load it
    # Ctrl-C names the checkpoint a resume restores: the live one (Ray Train's record has none)
    assert describe_interrupt(storage) == (
        f"the latest checkpoint is step 5, {live}; fit() again (the same run_name) resumes from it"
    )
    hint = _resume_hint(argparse.Namespace(command="fit", run_dir=None, storage_at=storage))
    assert hint.startswith(f"the last checkpoint is {tmp_path}/live-checkpoint-00000005 (step 5); resume with:"), hint
    assert cross_mode_resume(storage, str(tmp_path), "live") is None  # its own: the driver finds it
    # the restart path committed a later one (Ray Train's record names it): restart mode takes its own...
    import shutil

    from raytrain.checkpoint import TrainState, save_checkpoint
    from raytrain.data.id_ranges import IdRanges

    def restart_checkpoint(name: str, step: int) -> str:
        written = save_checkpoint(model, optimizer, TrainState(step=step), 0, IdRanges())
        shutil.copytree(written, tmp_path / name)
        record = {"latest_checkpoint_result": {"checkpoint_dir_name": name}}
        (tmp_path / RAY_SNAPSHOT_FILE).write_text(json.dumps(record))
        return str(tmp_path / name)

    seven = restart_checkpoint("checkpoint_2026-12-01_10-00-00.000000", 7)
    assert cross_mode_resume(storage, str(tmp_path), "restart") is None
    assert newest_checkpoint(str(tmp_path), live_too=True) == (7, seven)  # ...and so does live
    assert newest_checkpoint(str(tmp_path), live_too=False) == (7, seven)
    # the newest damaged (a shard cut short): passed over, named, never loaded as it is; the live one is next
    shard = next(p for p in Path(seven).iterdir() if p.suffix == ".distcp")
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:100])
    damaged: list[tuple[str, str]] = []
    assert newest_checkpoint(str(tmp_path), live_too=True, damaged=damaged) == (5, live)
    assert damaged == [(seven, f"{shard.name} has 100 of its {size} bytes")]
    assert cross_mode_resume(storage, str(tmp_path), "restart") == live  # the newest intact: the live one
    # the latest committed lost its train state (Ray's record names it; its step cannot be read): the intact ones
    # written before it, as Ray names them, are still candidates, here ahead of the live one
    fifty = restart_checkpoint("checkpoint_2026-12-01_09-00-00.000000", 50)
    lost = restart_checkpoint("checkpoint_2026-12-01_12-00-00.000000", 60)
    (Path(lost) / STATE_FILE).unlink()
    assert newest_checkpoint(str(tmp_path), live_too=True) == (50, fifty)
    assert cross_mode_resume(storage, str(tmp_path), "restart") is None  # its own: the worker finds it too
    shutil.rmtree(fifty)
    shutil.rmtree(lost)
    shutil.rmtree(seven)
    three = restart_checkpoint("checkpoint_2026-12-01_11-00-00.000000", 3)  # older than the live one: both take it
    assert newest_checkpoint(str(tmp_path), live_too=True) == (5, live) and Path(three).exists()
    assert cross_mode_resume(storage, str(tmp_path), "restart") == live


def test_resuming_a_live_checkpoint_with_settings_that_move_the_data_position_is_refused(tmp_path: Path) -> None:
    from raytrain.live.log import check_resumable_with, read_train_state

    model, optimizer = _tiny()
    config = _spec().to_dict()
    log = LiveLog(str(tmp_path), audit=False, log_every=100, keep=2, config=config, num_rows=240)
    _write_live(log, 5, model, optimizer)
    state = read_train_state(live_checkpoints(str(tmp_path))[-1][1])
    check_resumable_with(state, config, 240)  # the same settings: resumes
    other = _spec(batch=BatchConfig(global_batch=48, micro_batch=4), loop=LoopConfig(seed=3)).to_dict()
    with pytest.raises(ConfigError, match=r"batch.global_batch 24 -> 48, loop.seed 0 -> 3, training rows 240 -> 200"):
        check_resumable_with(state, other, 200)
    # a restart-path checkpoint (its plan holds no row count; its own field does) of a data set since grown, in
    # epoch 0 where the position check alone cannot tell
    restart = replace(state, plan={"world_size": 2, "global_batch": 24}, num_rows=240)
    assert state.num_rows == 240  # live checkpoints keep it in the field too
    with pytest.raises(ConfigError, match=r"other settings than this run: training rows 240 -> 300"):
        check_resumable_with(restart, config, 300)
    # a restart-path checkpoint whose run changed its global batch before it: not at step x B
    check_resumable_with(replace(state, step=10, sample_in_epoch=240), config, 240)  # the epoch's end: (1, 0)
    moved = replace(state, sample_in_epoch=100)
    with pytest.raises(ConfigError, match=r"step 5 is at epoch 0, sample 100, not where live mode puts step 5"):
        check_resumable_with(moved, config, 240)
    # a Parquet source's order: its partitions (or shuffle window, or row groups) changed
    order = {"row_groups": 15, "rows": 240, "partitions": 4, "shuffle_window": 2}
    parquet = str(tmp_path / "p")
    log = LiveLog(parquet, audit=False, log_every=100, keep=2, config=config, num_rows=240, data_order=order)
    _write_live(log, 5, model, optimizer)
    state = read_train_state(live_checkpoints(parquet)[-1][1])
    check_resumable_with(state, config, 240, order)
    with pytest.raises(ConfigError, match=r"data order .*'partitions': 4.* -> .*'partitions': 8"):
        check_resumable_with(state, config, 240, {**order, "partitions": 8})


def test_a_non_finite_gradient_is_never_applied_and_frozen_parameters_stay_untouched() -> None:
    """The restart path's step with live mode's replication on one replica (a real torchft Manager and
    lighthouse, P = 1): an Inf gradient with a finite loss steps nothing; a frozen parameter gets no gradient and
    no AdamW update."""
    from torch.distributed import TCPStore
    from torchft.coordination import LighthouseServer

    from raytrain.live.replica import LiveReplica
    from raytrain.step import train_step

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1), torch.nn.Flatten(0))
        model[0].weight.requires_grad_(False)
        frozen = model[0].weight.detach().clone()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
        store = TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        replica = LiveReplica(
            model,
            optimizer,
            lighthouse=lighthouse.address(),
            replica_id="u0",
            store_addr="127.0.0.1",
            store_port=store.port,
        )
        batch = {"x": torch.ones(4, 3), "y": torch.zeros(4)}

        def loss(m: torch.nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
            return (m(b["x"]) - b["y"]) ** 2

        replica.start_step()
        step = train_step(model, optimizer, loss, [batch], 1, 4, replication=replica.replication())
        assert step.committed and step.stepped and torch.equal(model[0].weight, frozen)
        assert model[0].weight.grad is None
        before = [p.detach().clone() for p in model.parameters()]

        class InfiniteBackward(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
                return x.clone()

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
                return grad * float("inf")

        def inf_gradient(m: torch.nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
            return (InfiniteBackward.apply(m(b["x"])) - b["y"]) ** 2  # a finite loss, an infinite gradient

        replica.start_step()
        step = train_step(model, optimizer, inf_gradient, [batch], 1, 4, replication=replica.replication())
        assert step.committed and np.isfinite(step.loss_sum) and not step.stepped
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        replica.shutdown()
    finally:
        lighthouse.shutdown()


def test_a_commit_vote_whose_groups_rank_0_is_gone_is_a_lost_replica_never_the_users_error() -> None:
    """A replica group of two ranks (real torchft Managers, one lighthouse): rank 0 serves the group's manager
    server; when it is gone after the step's quorum, rank 1's commit vote fails (torchft's client raises a
    TimeoutError here, a RuntimeError "transport error" when the connection breaks, as CI saw after a node
    removal) and must reach the driver as `LiveReplicaLost` (a lost group, replaced), not as the user's error,
    which fails the run."""
    from concurrent.futures import ThreadPoolExecutor
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torchft.coordination import LighthouseServer

    from raytrain.live.replica import LiveReplica, LiveReplicaLost

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
    store = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    ranks: list[LiveReplica] = []
    stopped = 0  # the ranks shut down in the test itself: the first `stopped` of them
    try:
        for rank in range(2):
            model = torch.nn.Linear(2, 1)
            ranks.append(
                LiveReplica(
                    model,
                    torch.optim.SGD(model.parameters(), lr=0.1),
                    lighthouse=lighthouse.address(),
                    replica_id="g0",
                    store_addr="127.0.0.1",
                    store_port=store.port,
                    rank=rank,
                    world_size=2,
                    timeout=timedelta(seconds=2),
                    quorum_timeout=timedelta(seconds=10),
                )
            )
        with ThreadPoolExecutor(2) as pool:  # the group's quorum waits for both of its ranks
            quorums = list(pool.map(lambda r: r.start_step(), ranks))
        assert [q.step for q in quorums] == [0, 0]
        ranks[0].shutdown()  # its manager server goes with it
        stopped = 1
        with pytest.raises(LiveReplicaLost, match="commit vote failed"):
            ranks[1].replication().commit()
    finally:  # every rank the test did not shut down itself, whatever failed (torchft's threads outlive a test)
        for replica in ranks[stopped:]:
            replica.shutdown()
        lighthouse.shutdown()


def _survivor(run_dir: str, armed: Any, go: Any) -> None:
    from raytrain import faults

    faults.arm(run_dir, 0, 2)  # armed while both replicas live: the fault is pending here too
    armed.set()
    go.wait(60)
    faults.at_step(30, 0, 1)  # the survivor redoes step 30 alone: rank 1 % 1 == 0 would match it
    faults.fault_point("forward")


def _killed(run_dir: str) -> None:
    from raytrain import faults

    faults.arm(run_dir, 1, 2)
    faults.at_step(30, 1, 2)
    faults.fault_point("forward")


def test_a_fault_fires_once_in_a_live_run_not_again_in_the_survivor_that_redoes_its_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Live replicas are armed once and live on: a survivor must see that another replica fired the fault."""
    import multiprocessing
    import signal

    monkeypatch.setenv("RAYTRAIN_FAULTS", "1:30:forward")
    context = multiprocessing.get_context("fork")
    armed, go = context.Event(), context.Event()
    survivor = context.Process(target=_survivor, args=(str(tmp_path), armed, go))
    survivor.start()
    assert armed.wait(60)
    killed = context.Process(target=_killed, args=(str(tmp_path),))
    killed.start()
    killed.join(60)
    go.set()
    survivor.join(60)
    assert killed.exitcode == -signal.SIGKILL
    assert survivor.exitcode == 0
    fired = [json.loads(line) for line in (tmp_path / "faults_fired.jsonl").read_text().splitlines()]
    assert fired == [{"fault": 0, "rank": 1, "step": 30, "phase": "forward"}]


def test_a_packed_checkpoint_state_unpacks_exactly_and_is_a_copy() -> None:
    """What a replica sends the log (`pack_state`): every dtype and shape back exactly, other values as they were,
    and a snapshot: the step after it cannot change it."""
    from raytrain.live.log import PackedTensor, pack_state, unpack_state

    weight = torch.randn(3, 4)
    before = weight.clone()
    state = {
        "model": {"w": weight, "t": weight.t(), "half": torch.randn(5).to(torch.bfloat16)},
        "optim": {"state": {0: {"step": torch.tensor(7.0), "ids": torch.arange(4)}}, "param_groups": [{"lr": 0.1}]},
        "manager": {"step": 7, "batches_committed": 14},
    }
    packed = pack_state(state)
    assert isinstance(packed["model"]["w"], PackedTensor) and packed["manager"] == state["manager"]
    weight.add_(1.0)  # the next optimizer step
    back = unpack_state(packed)
    assert torch.equal(back["model"]["w"], before) and torch.equal(back["model"]["t"], before.t())
    assert back["model"]["half"].dtype == torch.bfloat16 and torch.equal(back["model"]["half"], state["model"]["half"])
    assert back["optim"]["state"][0]["step"].shape == () and float(back["optim"]["state"][0]["step"]) == 7.0
    assert torch.equal(back["optim"]["state"][0]["ids"], torch.arange(4))
    assert back["optim"]["param_groups"] == [{"lr": 0.1}]


def test_a_node_added_is_timed_to_the_first_step_a_new_group_trained() -> None:
    """`live_summary`, pure: a kill's pause is the time to the next committed step; a node added is also timed to
    the first step at a larger world than before it (a new group placed, built and healed)."""
    from raytrain.cli.demo import AppliedEvent, live_summary
    from raytrain.live.driver import LiveResult

    worlds = {**dict.fromkeys(range(1, 11), 4), **dict.fromkeys(range(11, 16), 2), **dict.fromkeys(range(16, 21), 4)}
    metrics = [{"step": s, "time": 100.0 + s, "world_size": w} for s, w in worlds.items()]
    kill = AppliedEvent("kill", 10, 10, 110.5, "SIGKILL")
    add = AppliedEvent("add", 12, 12, 112.5, "added node")
    summary = live_summary(metrics, [kill, add], LiveResult([]))
    assert summary["pause_s"] == [0.5, 0.5]  # steps 11 and 13 came 0.5 s after each
    assert summary["grown_s"] == [None, 3.5]  # step 16, the first at world 4 again, 3.5 s after the node came


def test_a_replacement_trains_with_the_lr_of_the_group_it_joins() -> None:
    """A live group started from a checkpoint of a run since lengthened (40 -> 100 steps) and re-batched (16 ->
    32, `sqrt` rule): the replicas that load it and the replacements that heal from a peer (no checkpoint loaded)
    get one clock and one base batch from it (`group_schedule` with the driver's `lr_origin`), so at every step
    they apply one LR to the averaged gradients; a replacement on a fresh clock (what it was given before) trained
    at several times the survivors' LR."""
    from types import SimpleNamespace

    from raytrain.live.worker import LiveSettings, group_schedule
    from raytrain.lr_rules import ScheduleClock
    from raytrain.worker_loop import scheduled_lr

    lr = LRConfig(base_lr=0.1, rule="sqrt", warmup_steps=5, schedule="cosine", min_lr_ratio=0.0)
    spec = _spec(batch=BatchConfig(global_batch=32, micro_batch=4), lr=lr)
    origin = {"step": 30, "schedule": ScheduleClock(total=40, end=40, warmup=5).to_dict(), "base_batch": 16}
    settings = LiveSettings(lighthouse="h:1", replica_id="r1.1", lr_origin=origin)
    survivor = group_schedule(spec, 32, 100, origin)  # loaded the checkpoint
    replacement = group_schedule(spec, 32, 100, settings.lr_origin)  # healed from a peer
    assert survivor == replacement and survivor[1] == 16
    assert survivor[0] == ScheduleClock(total=40, end=40, warmup=5).resumed(30, ScheduleClock(100, 100, warmup=5))
    job = SimpleNamespace(lr_schedule_fn=None, spec=spec)

    def lr_at(schedule: tuple[ScheduleClock, int], step: int) -> float:
        return scheduled_lr(job, spec.lr.peak_lr(32, schedule[1]), schedule[0], step)  # type: ignore[arg-type]

    fresh = group_schedule(spec, 32, 100, None)
    for step in (31, 50, 90):
        assert lr_at(replacement, step) == lr_at(survivor, step)
    assert lr_at(fresh, 31) > 3 * lr_at(survivor, 31)  # the fresh clock: near the peak, the group near its end


def test_groups_that_drift_apart_are_named_by_the_fingerprint_they_compare() -> None:
    """What the loss's all-reduce carries besides it: each group's LR (every step) and parameter checksum (every
    FINGERPRINT_EVERY steps), summed with their squares over the groups; equal values pass (rounding included), an
    LR 4.7x another's (issue 68's replacement on a fresh clock) or a checksum one part in 1e4 off is named."""
    import torch

    from raytrain.live.replica import disagreement, parameter_checksum

    def sums(per_group: list[dict[str, float]]) -> tuple[list[str], list[float], list[float]]:
        names = list(per_group[0])
        return (
            names,
            [sum(g[n] for g in per_group) for n in names],
            [sum(g[n] ** 2 for g in per_group) for n in names],
        )

    same = {"lr": 0.1 / 3, "parameter checksum": 1234.5678901}
    assert disagreement(*sums([same] * 3), 3) is None
    assert disagreement(*sums([same]), 1) is None  # one group: nothing to compare
    apart = disagreement(*sums([same, same, {**same, "lr": 4.7 * same["lr"]}]), 3)
    assert apart is not None and apart.startswith("lr ") and "across 3 groups" in apart and "checksum" not in apart
    drifted = disagreement(*sums([same, {**same, "parameter checksum": same["parameter checksum"] * 1.0001}]), 2)
    assert drifted is not None and drifted.startswith("parameter checksum 1234.")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    expected = sum(float(p.detach().double().pow(2).sum()) for p in model.parameters())
    assert parameter_checksum(model) == pytest.approx(expected) and expected > 0
