"""`raytrain plan` through the real console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

RAYTRAIN = shutil.which("raytrain")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [RAYTRAIN] if RAYTRAIN else [sys.executable, "-m", "raytrain.cli"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=60)


def test_plan_json_gives_exact_global_batch_with_minimal_k() -> None:
    result = run_cli("plan", "--global-batch", "1024", "--micro-batch", "16", "--workers", "1:12", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert [row["world_size"] for row in out["batch"]] == list(range(1, 13))
    for row in out["batch"]:
        w, k = row["world_size"], row["accumulation_steps"]
        assert sum(row["per_rank_samples"]) == 1024 == row["global_batch"]
        assert len(row["per_rank_samples"]) == w
        assert row["max_micro_batch"] <= 16
        assert (k - 1) * 16 * w < 1024 <= k * 16 * w  # k is minimal
    assert "memory" not in out


def test_plan_with_tp_plans_per_replica_for_whole_replicas_only() -> None:
    result = run_cli("plan", "--global-batch", "96", "--micro-batch", "16", "--workers", "3:8", "--tp", "2", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["batch"]
    assert [(row["workers"], row["world_size"]) for row in rows] == [(4, 2), (6, 3), (8, 4)]  # W=3,5,7 never run
    assert all(sum(row["per_rank_samples"]) == 96 for row in rows)
    text = run_cli("plan", "--global-batch", "96", "--micro-batch", "16", "--workers", "4", "--tp", "2", "--pp", "2")
    assert "tp 2, pp 2: the plan is per data-parallel replica of 4 workers" in text.stdout
    refused = run_cli("plan", "--global-batch", "96", "--micro-batch", "16", "--workers", "3", "--tp", "2")
    assert refused.returncode == 2 and "holds no multiple of tp x pp = 2" in refused.stderr
    assert "dp replicas x tp shards" in run_cli("plan", "--help").stdout


def test_plan_memory_is_what_raytrain_allocates_with_one_recommendation() -> None:
    """7e9 parameters on 8 x 80 GB: raytrain keeps fp32 parameters, gradients (views of DDP's buckets) and AdamW's
    moments; DDP's first step holds the gradients twice before the moments exist, so zero1 peaks at 4 + 4 +
    max(4, 8 / 8) = 12 bytes/param, 84 GB (the ZeRO paper's mixed-precision accounting says 38.5 GB), and ddp at 16
    bytes/param, 112 GB; the one recommendation is what strategy auto runs."""
    args = ["plan", "--params", "7e9", "--gpus", "8", "--gpu-memory-gb", "80", "--largest-layer-params", "2e8"]
    out = json.loads(run_cli(*args, "--json").stdout)
    assert out["memory"]["zero1"] / 1e9 == pytest.approx(84, rel=1e-3)
    assert out["memory"]["ddp"] / 1e9 == pytest.approx(112, rel=1e-3)
    assert out["recommendation"] == "zero2"
    # sgd keeps no state, but ddp's first step holds 12 bytes/param, 84 GB: it does not fit 64 GB either
    assert out["recommendation_by_optimizer"] == {"adamw": "zero2", "sgd_momentum": "zero2", "sgd": "zero2"}
    text = run_cli(*args).stdout
    assert "recommendation: zero2 (zero2: peak 40.1 GB per worker fits 64 GB" in text
    assert "zero1" in text and "38.5" not in text
    cheaper = json.loads(run_cli(*args[:-2], "--gpu-memory-gb", "20", "--optimizer", "sgd", "--json").stdout)
    assert cheaper["memory"]["zero3"] < out["memory"]["zero3"]  # sgd keeps no state: the optimizer counts


def test_plan_table_output() -> None:
    result = run_cli(
        "plan", "--global-batch", "96", "--micro-batch", "32", "--workers", "2:3", "--params", "125M", "--gpus", "4"
    )
    assert result.returncode == 0, result.stderr
    assert "48 48" in result.stdout and "32 32 32" in result.stdout
    for name in ("ddp", "zero1", "zero2", "zero3"):
        assert name in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["plan", "--global-batch", "8", "--micro-batch", "4", "--workers", "1:9"],
            "world_size must be an integer in [1, global_batch=8], got 9",
        ),
        (["plan", "--global-batch", "0", "--micro-batch", "4"], "global_batch must be an integer >= 1, got 0"),
        (["plan", "--global-batch", "8", "--micro-batch", "4", "--workers", "3:2"], "workers must be"),
        (["plan", "--params", "1e9"], "--gpus is required"),
        (["plan"], "plan needs"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_when_no_data_parallel_strategy_fits_the_recommendation_is_the_layout_auto_runs() -> None:
    # Ψ = 1e9, largest layer 2.5e8, 8 devices of 4.5 GB: no dp strategy fits raytrain's 16 bytes/param; the one
    # recommendation is the tp/pp layout ParallelConfig(tp="auto", pp="auto") runs
    args = ["plan", "--params", "1e9", "--gpus", "8", "--gpu-memory-gb", "4.5", "--largest-layer-params", "2.5e8"]
    out = json.loads(run_cli(*args, "--json").stdout)
    assert out["recommendation"] == "tp=4,pp=1"
    text = run_cli(*args, "--gpus-per-node", "4", "--gpu-memory-gb", "3").stdout
    assert "recommendation: tp=4,pp=2 (no data-parallel strategy fits; layout auto -> tp 4, pp 2" in text
