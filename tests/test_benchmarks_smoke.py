"""Every benchmark runs with `--quick` as a user runs it (`python benchmarks/<name>.py --quick`), exits 0 and ends
with one JSON line holding its headline figures. Speed is never asserted: the figures depend on the machine.

Each runs in a subprocess; the Ray ones start their own local Ray instance (a Ray instance of this pytest session,
if any, is left alone) and take about a minute each on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 400


def run_benchmark(script: str, *args: str) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # always a fresh local instance, never someone's cluster
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env["PYTHONUNBUFFERED"] = "1"
    completed = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *(args or ("--quick",))],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    output = f"{completed.stdout[-4000:]}\n{completed.stderr[-4000:]}"
    assert completed.returncode == 0, f"{script} exited {completed.returncode}:\n{output}"
    lines = completed.stdout.strip().splitlines()
    assert lines, f"{script} printed nothing:\n{output}"
    headline = json.loads(lines[-1])
    assert isinstance(headline, dict), lines[-1]
    assert len(lines) > 1, f"{script} printed no table before its JSON line"
    return headline


def test_parallel_quick() -> None:
    """Real allocations per rank under tp 2, pp 2 and tp 2 x pp 2 against dp 4, and the same loss curve; the three
    pipeline schedules give the same losses."""
    headline = run_benchmark("parallel.py")
    assert headline["losses_equal"] is True
    assert headline["schedule_losses_equal"] is True  # GPipe, 1F1B and interleaved 1F1B: the same steps
    # sequence parallel at tp 4 (Llama): the same loss, less activation memory per rank (measured 0.71 here)
    assert headline["sp_losses_equal"] is True and headline["activation_peak_ratio_sp"] < 0.9, headline
    for name in ("tp2", "pp2"):  # the model state splits: about half per rank (embeddings and norms stay whole)
        assert 0.4 < headline[f"state_ratio_{name}"] < 0.65, headline
    assert headline["state_ratio_tp2pp2"] < 0.4, headline


def test_memory_quick() -> None:
    """Real allocations (LiveBytes) against the planner at W = 2, both accumulation modes; meta init's peak."""
    headline = run_benchmark("memory.py")
    assert headline["worst_planner_error"] <= 0.10, headline
    # Out of sample (torch's nn.TransformerEncoder): measured 0.062-0.076 in fp32 and 0.079 in bf16 (zero3, k = 4;
    # zero2 in bf16 was 0.098-0.129 before the planner counted the fp32 cast of a unit's gradient)
    assert headline["worst_planner_error_out_of_sample"] <= 0.10, headline
    assert headline["worst_planner_error_bf16"] <= 0.10, headline
    assert headline["planner_counts"] == "model state; activations excluded"
    assert headline["loss_matches_w1"] is True and headline["auto_fits"] is True
    # Built on meta and sharded: about half the parameters per rank at W = 2, not the whole model first.
    assert headline["init_peak_fraction"] < 0.8 < headline["init_peak_fraction_full_build"], headline
    # The export holds about one chunk at a time: 0.19-0.25 of a 76 MB, 16-tensor model here (a tensor is 0.125
    # of it, the process itself grows by 5-9 MB); an 8 MB model read 0.69-0.94, all of it that fixed growth
    assert headline["export_tensors"] >= 16 and 0 < headline["export_peak_fraction"] < 0.4, headline


def test_gpu_quick_skips_or_runs() -> None:
    headline = run_benchmark("gpu.py")
    if headline.get("skipped"):
        assert headline == {"skipped": True, "reason": "no CUDA"}
    else:
        assert {"tokens_per_s_ddp", "tokens_per_s_zero3", "mfu_ddp", "mfu_zero3"} <= headline.keys()
        assert headline["peak_tflops"] is not None, f"no datasheet peak for {headline['device']}: add it"


def test_gpu_code_path_runs_on_cpu() -> None:
    """The GPU benchmark's training code (tiny GPT, gloo, W = 2) runs where no GPU is: `--cpu-check`."""
    headline = run_benchmark("gpu.py", "--cpu-check")
    assert headline["skipped"] is False and headline["world_size"] == 2
    assert headline["all_reduces_per_step_ddp"] >= 1  # one sync (all its buckets) per optimizer step
    assert headline["reduce_scatters_per_step_zero3"] >= 1
    assert headline["tokens_per_s_ddp"] > 0 and headline["tokens_per_s_zero3"] > 0
    assert headline["tokens_per_s_hand_fsdp2"] > 0  # the loop written without raytrain ran the same work
    assert headline["raytrain_over_hand_zero3"] > 0


def test_gpu_check_skips_or_passes() -> None:
    """The one-GPU check of the whole loop (nccl, W = 1) passes where CUDA is, and says it skipped elsewhere."""
    headline = run_benchmark("gpu_check.py")
    if headline.get("skipped"):
        assert headline == {"skipped": True, "reason": "no CUDA"}
    else:
        assert headline["backend"] == "nccl" and headline["all_ok"] is True, headline


@pytest.mark.ray
@pytest.mark.benchmark
def test_gpu_check_code_path_runs_on_cpu() -> None:
    headline = run_benchmark("gpu_check.py", "--cpu-check", "--steps", "6")
    assert headline["backend"] == "gloo" and headline["all_ok"] is True, headline


@pytest.mark.ray
@pytest.mark.benchmark
def test_overhead_quick() -> None:
    headline = run_benchmark("overhead.py")
    rates = {"raytrain_steps_per_s", "matched_steps_per_s", "naive_steps_per_s", "naive_no_sync_steps_per_s"}
    assert {"overhead_ratio", *rates} <= headline.keys()
    assert headline["overhead_ratio"] > 0 and all(headline[rate] > 0 for rate in rates)
    assert headline["matched_checkpoint_s"] == headline["matched_checkpoint_s"]  # not NaN: a checkpoint was timed
    # raytrain's per-step work measured without Ray: every piece's figure is there (a missing variant is a KeyError
    # in the script) and the matched step took real time
    costs = {"step_cost_us", "step_cost_norm_us", "step_cost_seeds_us", "step_cost_data_us"}
    assert costs <= headline.keys() and headline["matched_step_us"] > 100, headline


@pytest.mark.ray
@pytest.mark.benchmark
def test_input_pipeline_quick() -> None:
    headline = run_benchmark("input_pipeline.py")
    assert "data_wait_fraction" in headline
    assert 0 <= headline["data_wait_fraction"] < 1
    assert headline["data_wait_fraction_max_rank"] >= headline["data_wait_fraction"]
    # Real memory on every rank and a real checkpoint's position files, not bookkeeping
    assert headline["worker_peak_rss_bytes_parquet"] > 0 and headline["worker_rss_growth_bytes_parquet"] is not None
    assert headline["position_checkpoint_bytes"] > 0
    # Where the CPU goes: the data threads' share of a step, the cores a rank kept busy and its training thread's
    assert 0 < headline["data_cpu_fraction_parquet_w2"] < 2, headline
    assert 0 < headline["train_cpu_cores_per_rank_parquet_w2"] <= headline["cpu_cores_per_rank_parquet_w2"], headline
    # Real bytes read at W = 4 (the quick data set is small: each rank's footer reads weigh more than at full size)
    assert 0.9 < headline["read_amplification"] < headline["read_amplification_one_partition"]


@pytest.mark.ray
@pytest.mark.benchmark
def test_checkpoint_cost_quick() -> None:
    headline = run_benchmark("checkpoint_cost.py")
    # raytrain's own stall field was filled (a checkpoint was copied and reported) and a real checkpoint measured
    assert headline["checkpoint_stall_s"] > 0 and headline["checkpoint_stall_s_sync"] > 0
    assert headline["checkpoint_bytes"] > 8_500_000 * 4 * 2  # parameters and momentum, float32
    assert headline["checkpoint_step_s"] > 0


@pytest.mark.ray
@pytest.mark.benchmark
@pytest.mark.parametrize("events", ["kill", "node"])
def test_goodput_quick(events: str) -> None:
    """Bare Ray Train, raytrain restart, raytrain live and live with sharded groups, each hit once by the same
    event (a fault point's SIGKILL, or the loss of a worker node, replaced at once), all reach the last step; the
    goodputs are fractions of the wall time."""
    headline = run_benchmark("goodput.py", "--quick", "--events", events)
    prefix = "goodput_node_" if events == "node" else "goodput_"
    for variant in ("bare", "restart", "live", "live_hsdp"):
        assert 0 < headline[f"{prefix}{variant}"] <= 1.05, headline  # a median step: a fast interval may beat it
        assert 0 < headline[f"{prefix}fault_free_{variant}"] <= 1.05, headline
        assert headline[f"{prefix}step_s_{variant}"] > 0
    if events == "kill":
        assert headline["settings"]["kills"] == "1:30:forward"
    else:  # the node went during step 30, after the checkpoint of step 20: the restart paths trained steps again
        assert headline["goodput_node_retrained_bare"] > 0 and headline["goodput_node_retrained_restart"] > 0


@pytest.mark.ray
@pytest.mark.benchmark
def test_recovery_quick() -> None:
    """A worker SIGKILLed on raytrain's restart path: the new group of the same size steps, and gets past the
    killed step no sooner than its first step."""
    headline = run_benchmark("recovery.py")
    assert headline["sigkill_back_s"] >= headline["sigkill_s"] > 0, headline
    assert headline["world_sizes"] == [3, 3] and headline["sigkill_steps_lost"] >= 0, headline


@pytest.mark.benchmark
def test_driver_index_quick() -> None:
    headline = run_benchmark("driver_index.py")
    assert headline["driver_index_row_groups"] == 10_000
    assert headline["driver_index_s"] > 0 and headline["driver_index_rss_bytes"] > 0
    assert headline["index_pickle_bytes"] > 10_000 * 3 * 8  # file, row group, rows and bytes per row group


def test_run_all_writes_a_results_file_and_the_tables_come_from_it(tmp_path: Path) -> None:
    """The harness end to end on `communication.py --quick`: the results file holds the machine, the versions, the
    runs and min / median / max per figure; the table is rendered from it and names it; a goal's verdict comes
    from the worst repetition."""
    out = tmp_path / "2026-12-01-abc-quick.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "run_all.py"),
            "--quick",
            "--only",
            "communication",
            "--out",
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert {"machine", "commit", "date", "settings", "benchmarks"} <= results.keys()
    assert results["machine"]["torch"] and results["machine"]["ray"]
    headline = results["benchmarks"]["communication"]["runs"][0]
    # Counts, not timings: raytrain syncs once per optimizer step, the naive loop once per micro-step.
    assert headline["syncs_per_step_raytrain"] == pytest.approx(1.0)
    assert headline["syncs_per_step_naive"] == pytest.approx(headline["k"])
    assert headline["zero3_syncs_per_step_raytrain"] == pytest.approx(1.0, abs=0.01)
    # grad_accumulation="sharded" reduce-scatters in every micro-step: k syncs, the price of holding the shard only
    assert headline["zero3_syncs_per_step_raytrain_sharded"] == pytest.approx(headline["k"], abs=0.05)
    figures = results["benchmarks"]["communication"]["figures"]
    assert figures["syncs_per_step_raytrain"] == {"min": 1.0, "median": 1.0, "max": 1.0, "n": 1}
    sys.path.insert(0, str(REPO / "benchmarks"))
    from tables import render

    table = render(results, out.name)
    assert f"benchmarks/results/{out.name}" in table
    assert "| gradient syncs per optimizer step, DDP, k = 8 (`syncs_per_step_raytrain`) | 1 | <= 1: met |" in table
    worse = json.loads(out.read_text())
    worse["benchmarks"]["communication"]["figures"]["syncs_per_step_raytrain"]["max"] = 2.0  # one bad repetition
    assert "<= 1: **missed**" in render(worse, out.name)
    # A later `run_all.py --only overhead` whose communication entry failed: each benchmark's rows come from the
    # newest file in which it ran, and the header names both files.
    from tables import newest_per_benchmark

    later = json.loads(out.read_text())
    later["date"] = "2999-01-01T00:00:00+00:00"
    later["benchmarks"]["communication"].update(runs=[], figures={}, failed=["Traceback ..."])  # it failed
    later["benchmarks"]["overhead"] = {"runs": [{"overhead_ratio": 0.5}], "failed": [], "figures": {}}
    later["benchmarks"]["overhead"]["figures"]["overhead_ratio"] = {"min": 0.5, "median": 0.5, "max": 0.5, "n": 1}
    second = tmp_path / "2999-01-01-def.json"
    second.write_text(json.dumps(later))
    merged, head = newest_per_benchmark([out, second])
    assert merged["benchmarks"]["communication"] == results["benchmarks"]["communication"]
    assert f"communication from `benchmarks/results/{out.name}`" in head
    assert f"overhead from `benchmarks/results/{second.name}`" in head
    assert "(`overhead_ratio`) | 0.5 | >= 0.97: **missed**" in render(merged, "", head)
    # A still newer run of 3 repetitions stopped (`--deadline-s`) after one repetition of overhead: not yet its
    # figure, the complete older one stays
    partial = {**later, "date": "3000-01-01T00:00:00+00:00", "reps": 3}
    partial["benchmarks"] = {"overhead": {**later["benchmarks"]["overhead"], "runs": [{"overhead_ratio": 0.9}]}}
    third = tmp_path / "3000-01-01-ghi.json"
    third.write_text(json.dumps(partial))
    merged, head = newest_per_benchmark([out, second, third])
    assert f"overhead from `benchmarks/results/{second.name}`" in head and third.name not in head
    # The failed communication repetition run again by `--resume`: its figures count, the header says it failed once
    rerun = {**later, "date": "3001-01-01T00:00:00+00:00"}
    rerun["benchmarks"] = {"communication": {**results["benchmarks"]["communication"], "failed": ["Traceback ..."]}}
    fourth = tmp_path / "3001-01-01-jkl.json"
    fourth.write_text(json.dumps(rerun))
    merged, head = newest_per_benchmark([out, second, third, fourth])
    assert f"communication from `benchmarks/results/{fourth.name}`" in head
    assert "failed and run again: communication 1 (tracebacks in the file)" in head


def test_run_all_resumes_only_the_same_code_and_stops_before_a_deadline(tmp_path: Path) -> None:
    """`run_all.py --resume FILE` continues a results file, running only the repetitions it lacks, and only when
    the code it measured is this tree's; `--deadline-s` starts no repetition its benchmark's longest earlier one
    says would end too late. No benchmark runs here: each case is decided before one would start."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from run_all import code_hash

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}

    def run_all(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, str(REPO / "benchmarks" / "run_all.py"), *args]
        return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)

    def results_file(code: str, reps: int, wall_s: list[float]) -> Path:
        run = {"syncs_per_step_raytrain": 1.0}
        entry = {"runs": [run] * len(wall_s), "figures": {}, "wall_s": wall_s, "failed": []}
        results = {
            "date": "2026-12-04T00:00:00+00:00",
            "commit": "abc",
            "code": code,
            "machine": {},
            "quick": False,
            "reps": reps,
            "settings": {},
            "benchmarks": {"communication": entry},
            "parts": [{"commit": "abc", "date": "2026-12-04T00:00:00+00:00", "wall_s": sum(wall_s)}],
            "complete": False,
        }
        path = tmp_path / f"{code}-{reps}.json"
        path.write_text(json.dumps(results))
        return path

    # every repetition there: nothing runs, the file is complete, the sitting is its second part
    done_file = results_file(code_hash(), 2, [50.0, 52.0])
    done = run_all("--reps", "2", "--only", "communication", "--resume", str(done_file))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    done_results = json.loads(done_file.read_text())
    assert done_results["complete"] and len(done_results["parts"]) == 2
    assert done_results["benchmarks"]["communication"]["wall_s"] == [50.0, 52.0]
    # one repetition missing, but it took up to 52 s before: a 10 s deadline stops before it, to be resumed
    short_file = results_file(code_hash(), 3, [50.0, 52.0])
    short = run_all("--only", "communication", "--resume", str(short_file), "--deadline-s", "10")
    assert short.returncode == 0, short.stdout[-3000:] + short.stderr[-3000:]
    assert "communication 3/3 (up to 52 s) would end past --deadline-s" in short.stdout
    assert f"continue with --resume {short_file}" in short.stdout
    short_results = json.loads(short_file.read_text())
    assert not short_results["complete"] and short_results["benchmarks"]["communication"]["wall_s"] == [50.0, 52.0]
    # a repetition that failed is lacking too: the resumed run would run it again (here stopped by the deadline)
    failed_file = results_file(code_hash(), 2, [50.0, 52.0])
    failed = json.loads(failed_file.read_text())
    failed["benchmarks"]["communication"].update(runs=[{"syncs_per_step_raytrain": 1.0}], failed=["Traceback ..."])
    failed_file.write_text(json.dumps(failed))
    retry = run_all("--reps", "2", "--only", "communication", "--resume", str(failed_file), "--deadline-s", "10")
    assert "communication 2/2 (up to 52 s) would end past --deadline-s" in retry.stdout, retry.stdout[-3000:]
    assert not json.loads(failed_file.read_text())["complete"]
    # other code measured: refused, naming both hashes
    other = run_all("--only", "communication", "--resume", str(results_file("0123456789ab", 3, [50.0])))
    assert other.returncode == 2
    assert "it measured code '0123456789ab'" in other.stderr and f"this tree is {code_hash()!r}" in other.stderr


def test_a_live_kills_pause_is_measured_past_a_step_the_killed_group_had_already_joined() -> None:
    """recovery.py's `kill_timeline` (pure): a step committed at the old size just after the kill (the killed
    group had contributed to it) does not end the pause; the pause is the longest interval until the first step at
    the smaller size, the heal the time back to the pre-kill size after that drop."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from recovery import kill_timeline

    def m(time: float, world: int) -> dict[str, Any]:
        return {"step": int(time * 10), "time": time, "world_size": world}

    # kill at 10.0; step at 10.01 still at 3; the survivors stall 0.8 s, train at 2, the replacement joins at 13.0
    metrics = [m(9.8, 3), m(9.9, 3), m(10.01, 3), m(10.81, 2), m(11.0, 2), m(12.0, 2), m(13.0, 3), m(13.1, 3)]
    timeline = kill_timeline(metrics, 10.0)
    assert timeline["pause_s"] == pytest.approx(0.8)
    assert timeline["to_full_s"] == pytest.approx(3.0)
    assert timeline["longest_interval_s"] == pytest.approx(1.0)  # 12.0 -> 13.0, at the smaller size
    assert kill_timeline(metrics[:4], 10.0)["to_full_s"] is None  # never back to full size


def test_a_node_adds_growth_is_not_read_from_a_heal_still_under_way() -> None:
    """recovery.py's `add_growth` (pure): the demo's `grown_s` (the add -> the first step at a larger world than
    at the add) is kept where the world at the add was the largest so far, and is None (a miss) where a kill's
    replacement was still healing then: the next larger world could be the heal's, not the added node's group."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from recovery import add_growth

    def m(step: int, world: int) -> dict[str, Any]:
        return {"step": step, "time": step / 10, "world_size": world}

    add = {"kind": "add", "applied_step": 150, "time": 15.0, "grown_s": 0.05}
    healing = [m(80, 3), m(95, 2), m(150, 2), m(151, 3)]  # killed at 90, not back to 3 by the add at 150
    assert add_growth(healing, add) is None
    healed = [m(80, 3), m(95, 2), m(120, 3), m(150, 3), m(170, 4)]
    assert add_growth(healed, {**add, "grown_s": 2.0}) == 2.0


def test_a_goal_whose_a_a_control_strays_past_its_margin_is_marked_within_noise() -> None:
    """tables.py's verdict (pure): `overhead_ratio` >= 0.97 judged with its A/A control; a control within 0.03 of
    1 leaves the verdict alone, one that strayed further names its range, met or missed."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from tables import render

    def results(figure: tuple[float, float], control: tuple[float, float]) -> dict[str, Any]:
        figures = {
            "overhead_ratio": {"min": figure[0], "median": figure[0], "max": figure[1], "n": 3},
            "control_ratio": {"min": control[0], "median": control[0], "max": control[1], "n": 3},
        }
        return {"benchmarks": {"overhead": {"figures": figures}}}

    quiet = render(results((0.99, 1.0), (0.98, 1.02)), "", "head")
    assert "(`overhead_ratio`) | 0.99 (0.99-1) | >= 0.97: met |" in quiet
    noisy = render(results((0.83, 1.28), (0.93, 1.39)), "", "head")
    assert ">= 0.97: **missed** (within noise: A/A `control_ratio` 0.93-1.39) |" in noisy
    assert ">= 0.97: met (within noise" in render(results((0.99, 1.0), (0.9, 1.1)), "", "head")


def test_a_failed_benchmark_run_keeps_the_end_of_its_standard_error(tmp_path: Path) -> None:
    """A repetition that fails keeps why: its traceback is on standard error (a goodput_node repetition failed with
    only its progress lines kept, the cause lost)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from run_all import run_once

    script = tmp_path / "fails.py"
    script.write_text("print('[bench] step 49: remove')\nraise RuntimeError('Connection reset by peer')\n")
    headline, tail, _ = run_once([str(script)], False, 60)
    assert headline is None
    assert "[bench] step 49: remove" in tail and "RuntimeError: Connection reset by peer" in tail, tail
    assert "exit status 1" in tail
