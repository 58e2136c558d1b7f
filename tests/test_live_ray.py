"""Live recovery under Ray (`raytrain demo --recovery live`, `ClusterConfig(recovery="live")`), end to end: real Ray (a
fake-node cluster per run), real torchft replica groups and lighthouse, real SIGKILLs.

A kill and a node lost: the replicas that were not killed run from the first step to the last in the process they
started in; every step trains exactly the global batch; the audit is clean; the loss equals, step by step, the
fixed-size run of the *restart* path (`fixed_size_losses`): live replicas read the same step source (the demo's
Parquet files), so the mode of recovery does not change the training. Sharded replica groups (HSDP: `--dp-shard 2`,
zero3 in each group of two workers on one node) through a kill, a drain and a node added: the same curve, no
restart, the groups not touched keep their processes, the drained group leaves at a step boundary. A kill of the
only replica (from inside it, by `raytrain.faults`): live mode cannot go on, falls back to a restart from its newest
checkpoint (one line says why), and the curve is still the fixed-size one. One checkpoint format: a live run (HSDP)
resumed in restart mode at another world size, then in live mode again with groups of two tensor-parallel workers
(one group killed and replaced by a group that heals its tp shards from a peer), then as one group of dp_shard 2 x
tp 2 (zero3 over a 2-D mesh), trains every step once on the fixed-size curve.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ray_helpers import assert_same_curve, check_invariants, demo, read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS = 40
LIVE = ("--recovery", "live", "--steps", str(STEPS), "--checkpoint-every", "5")
PACED = ("--sample-time", "0.01")  # simulated compute: the events land mid-run (it changes no loss)


def test_a_kill_and_a_node_lost_survivors_never_restart_and_the_batch_stays_exact(
    tmp_path: Path, fixed_size_losses: list[float]
) -> None:
    # a SIGKILL, then a node removed without notice (its replica dies with it; no room for a replacement after)
    summary = demo(
        tmp_path, "kills", *LIVE, *PACED, "--nodes", "3", "--workers", "1:3", "--events", "kill@10,remove@25"
    )
    check_invariants(summary, STEPS)
    assert_same_curve(summary, fixed_size_losses)
    live = summary["live"]
    assert summary["restarts"] == 0 and live["restarts"] == 0
    assert len(live["lost"]) == 2 and len(summary["events"]) == 2
    lost = {item["replica"] for item in live["lost"]}
    originals = {"r0", "r1", "r2"}
    survivors = [r for r in live["finished"] if r["replica"] in originals - lost]
    assert len(survivors) == 3 - len(lost & originals) >= 1, live  # every original not killed ran to the end...
    launched = {
        r["replica"]: r["pids"][0]
        for r in read_jsonl(str(Path(summary["run_dir"]) / "live.jsonl"))
        if r["kind"] in ("started", "joined")
    }
    for replica in survivors:  # ...in the process it was started in
        assert replica["pid"] == launched[replica["replica"]], (replica, launched)
    # (No survivor need have trained from step 1: an original that starts late heals from a peer and joins, and
    # kills take the highest index. That at each kill another replica was training is `restarts == 0` above.)
    assert all(r["replica"] not in lost for r in live["finished"])  # a killed replica never comes back as itself
    assert min(summary["world_sizes"]) < 3  # the kills were felt...
    for event in summary["events"]:  # ...and a step was committed after each, without a restart
        assert event["recovered_time"] is not None and event["restored_step"] is None
    assert live["steps_retrained"] <= 2  # at most the step each kill interrupted
    log = (Path(summary["run_dir"]) / "raytrain.log").read_text()
    assert log.count("lost after step") == 2 and "go on with the same global batch, no restart" in log
    assert "wait for a replacement" not in log  # min_workers=1: the survivors train on alone (docs/recovery.md)


def test_sharded_replica_groups_go_on_through_a_node_loss_a_drain_and_an_added_node(
    tmp_path: Path, fixed_size_losses: list[float]
) -> None:
    # Groups of two workers (zero3 inside each): the node of one is removed without notice, its two ranks die one
    # after the other (the first death may break the other's FSDP all-gather before it dies: a lost group, never
    # the user's error), its replacement goes to the spare fourth node; a drained node's group hands over to a
    # successor on the node added next.
    steps = 80  # the drained group leaves before the run ends: once its successor trains, or 3 s before the deadline
    summary = demo(
        tmp_path, "hsdp", "--recovery", "live", "--steps", str(steps), "--checkpoint-every", "10", *PACED,
        "--strategy", "zero3", "--dp-shard", "2", "--nodes", "4", "--slots-per-node", "2", "--workers", "6",
        "--events", "remove@10,drain@25,add@30",
    )  # fmt: skip
    check_invariants(summary, steps)
    assert_same_curve(summary, fixed_size_losses)
    live = summary["live"]
    assert summary["restarts"] == 0 and live["restarts"] == 0, summary["stderr"][-3000:]
    assert [r["replica"] for r in live["lost"]] == ["r2"]  # the removal takes the highest group's node
    assert len(live["left"]) == 1, summary["stderr"][-3000:]
    (left,) = live["left"]  # the drained node's group left at a step boundary...
    assert len(left["pids"]) == 2
    assert live["steps_retrained"] <= 1  # ...so only the step the lost node was in was trained again
    started = {
        r["replica"]: r["pids"]
        for r in read_jsonl(str(Path(summary["run_dir"]) / "live.jsonl"))
        if r["kind"] == "started"
    }
    finished: dict[str, list[int]] = {}
    for r in live["finished"]:
        finished.setdefault(r["replica"], []).append(r["pid"])
    assert len(finished) == 3 and all(len(pids) == 2 for pids in finished.values())
    untouched = {"r0", "r1"} - {left["replica"]}
    assert untouched and all(sorted(finished[name]) == sorted(started[name]) for name in untouched)  # same processes
    layout = read_jsonl(str(Path(summary["run_dir"]) / "events.jsonl"))[0]["layout"]
    assert layout == {"dp": 6, "dp_replicate": 3, "dp_shard": 2, "tp": 1, "pp": 1}
    log = (Path(summary["run_dir"]) / "raytrain.log").read_text()
    assert "is being drained" in log and "ahead of its node's drain" in log and "FSDP units" in log
    # a fixed --workers 6 is min_workers=6: the two groups left wait for the replacement, and the loss line says so
    assert "2 wait for a replacement, no restart: min_workers=6 asks for 3 replica group(s) per step" in log, log
    from raytrain.model_export import export  # a live checkpoint exports like any other (one format)

    exported = export(summary["run_dir"], str(tmp_path / "exported"))
    assert exported.step == steps and "live-checkpoint-" in exported.checkpoint


def test_losing_every_replica_falls_back_to_a_restart_from_the_newest_checkpoint(
    tmp_path: Path, fixed_size_losses: list[float]
) -> None:
    # the kill comes from inside the replica (`raytrain.faults`, as in the restart path's fault tests), mid-step:
    # between a micro-batch's forward and its backward
    summary = demo(
        tmp_path, "fallback", *LIVE, *PACED, "--nodes", "1", "--workers", "1", "--events", "none",
        "--faults", "0:12:backward",
    )  # fmt: skip
    (fired,) = read_jsonl(str(Path(summary["run_dir"]) / "faults_fired.jsonl"))
    assert fired == {"fault": 0, "rank": 0, "step": 12, "phase": "backward"}
    check_invariants(summary, STEPS)
    assert_same_curve(summary, fixed_size_losses)
    live = summary["live"]
    assert live["restarts"] == 1 and summary["restarts"] == 1
    (fallback,) = live["fallbacks"]
    assert fallback["restored_step"] % 5 == 0 and fallback["restored_step"] <= fallback["at_step"]
    assert "every replica is lost: falling back to the restart path from checkpoint step" in summary["stderr"]
    assert live["steps_retrained"] == fallback["at_step"] - fallback["restored_step"]


def test_either_recovery_mode_resumes_the_others_checkpoint_at_another_world_size_and_layout(
    tmp_path: Path, fixed_size_losses: list[float]
) -> None:
    common = ("--events", "none", "--checkpoint-every", "5", "--sample-time", "0")
    live_hsdp = ("--recovery", "live", "--strategy", "zero3", "--dp-shard", "2", "--slots-per-node", "2")
    # live, groups of two workers splitting each layer (tp 2), one group killed: the other goes on, a new group
    # heals from it (each worker its tp shard) and joins; paced so that it joins before the end
    live_tp = ("--recovery", "live", "--tp", "2", "--slots-per-node", "2", "--sample-time", "0.02")
    runs = [  # (steps, arguments): each resumes where the one before stopped
        (10, (*live_hsdp, "--nodes", "2", "--workers", "4")),
        (20, ("--nodes", "3", "--workers", "3")),  # restart mode, ddp
        (60, (*live_tp, "--nodes", "2", "--workers", "2:4", "--events", "kill@25")),
    ]
    for steps, args in runs:
        summary = demo(tmp_path, "cross", *common, "--steps", str(steps), *args)
    check_invariants(summary, 60)
    assert_same_curve(summary, fixed_size_losses)
    starts = read_jsonl(str(Path(summary["run_dir"]) / "events.jsonl"))
    assert [(e["step"], e["world_size"], e.get("recovery", "restart")) for e in starts] == [
        (0, 4, "live"),
        (10, 3, "restart"),
        (20, 4, "live"),
    ]  # each resumed from the step the other mode's checkpoint holds, none started over
    assert starts[-1]["layout"] == {"dp": 2, "dp_replicate": 2, "dp_shard": 1, "tp": 2, "pp": 1}
    assert 'written by recovery="restart"' in summary["stderr"]
    live = summary["live"]  # the tp group killed: the other went on alone, a new group joined, no restart
    assert live["restarts"] == 0 and len(live["lost"]) == 1, summary["stderr"][-3000:]
    assert summary["world_sizes"][-3:] == [4, 2, 4], summary["world_sizes"]
    joined = [r for r in read_jsonl(str(Path(summary["run_dir"]) / "live.jsonl")) if r["kind"] == "joined"]
    assert joined and len(joined[-1]["pids"]) == 2
    assert "tensor parallel over 2 ranks" in summary["stderr"]
    # and one group of dp_shard 2 x tp 2 (zero3 over the dp axis of a 2-D mesh): it loads the tp groups' checkpoint
    # into that layout and gathers its own over both axes
    grid = ("--recovery", "live", "--strategy", "zero3", "--dp-shard", "2", "--tp", "2", "--slots-per-node", "4")
    last = demo(tmp_path, "cross", *common, "--steps", "70", *grid, "--nodes", "1", "--workers", "4")
    check_invariants(last, 70)
    assert_same_curve(last, fixed_size_losses)
    grid_start = read_jsonl(str(Path(last["run_dir"]) / "events.jsonl"))[-1]
    assert (grid_start["step"], grid_start["layout"]) == (
        60,
        {"dp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 1},
    )
    assert "FSDP units" in last["stderr"] and "tensor parallel over 2 ranks" in last["stderr"]


def test_waiting_for_starting_groups_past_the_deadline_returns_what_is_ready(ray_local: None) -> None:
    """The driver's start loops check a deadline, then wait for the time left: the deadline can pass in between
    (a recovery benchmark's live run ended with Ray's "The 'timeout' argument must be nonnegative. Received
    -3.9e-07"). Past the deadline the wait returns what is ready at once, and never raises."""
    import time

    import ray

    from raytrain.live.driver import wait_one_until

    @ray.remote(num_cpus=0)
    def building() -> None:
        time.sleep(60)

    pending, ready = building.remote(), ray.put("built")
    passed = time.monotonic() - 1e-6
    try:
        assert wait_one_until([pending], passed) == []
        assert wait_one_until([pending, ready], passed) == [ready]
        # as the driver loops: Ray counts the timeout in whole milliseconds and can return just before the
        # deadline, so the loop's check passes and the time left it computes next is below zero
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            assert wait_one_until([pending], deadline) == []
    finally:
        ray.cancel(pending, force=True)


def test_a_finished_live_run_leaves_no_actor_or_placement_group_behind(ray_local: None, tmp_path: Path) -> None:
    """In the caller's own Ray instance (a script that runs several trainings, as the goodput benchmark does): after
    a live fit with sharded groups (placement groups) every CPU is free again and every placement group removed;
    the next training can start at once."""
    import ray
    from ray.util import placement_group_table
    from ray_helpers import wait_for

    from raytrain.config import BatchConfig, CheckpointConfig, ClusterConfig, LoopConfig, LRConfig, ParallelConfig
    from raytrain.toy import adamw, block_mlp_factory, regression_dataset, squared_error
    from raytrain.trainer import ElasticTrainer

    total = ray.cluster_resources()["CPU"]
    trainer = ElasticTrainer(
        model_fn=block_mlp_factory(8, 16, 2),
        loss_fn=squared_error,
        optimizer_fn=adamw,
        datasets={"train": regression_dataset(24 * 6, 8)},
        batch=BatchConfig(global_batch=24, micro_batch=4),
        lr=LRConfig(base_lr=1e-3),
        loop=LoopConfig(max_steps=6, id_column="id", strategy="zero3"),
        checkpoint=CheckpointConfig(storage_path=str(tmp_path), run_name="leak", every_steps=3),
        cluster=ClusterConfig(min_workers=2, max_workers=4, recovery="live"),
        parallel=ParallelConfig(dp_shard=2),
        required_columns=("x", "y"),
    )
    result = trainer.fit()
    assert result.metrics["step"] == 6
    wait_for("every CPU free after the live run", lambda: ray.available_resources().get("CPU") == total, 30, 0.5)
    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())
