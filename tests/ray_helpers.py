"""Helpers shared by the Ray tests: one way to build a small `ElasticTrainer` and to read a run's files."""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from raytrain.config import BatchConfig, CheckpointConfig, ClusterConfig, LoopConfig, LRConfig
from raytrain.data.parquet import ParquetSource
from raytrain.ports import free_port
from raytrain.toy import mlp_factory, regression_dataset, sgd, squared_error, write_regression_parquet
from raytrain.trainer import ElasticTrainer

ROWS = 90  # 90 rows at global batch 20: 5 steps per epoch, the last one partial (10 samples)


_DATA: dict[int, Path] = {}


def parquet_data(rows: int) -> Path:
    """The regression toy data as 3 Parquet files of 8-row row groups, written once per test process."""
    if rows not in _DATA:
        _DATA[rows] = Path(tempfile.mkdtemp(prefix=f"raytrain-test-data-{rows}-"))
        write_regression_parquet(_DATA[rows], rows, files=3, row_group=8)
    return _DATA[rows]


def make_trainer(
    tmp: Path,
    run: str,
    *,
    workers: int,
    strategy: str = "ddp",
    steps: int | None = None,
    epochs: int = 2,
    every: int = 100,
    audit: bool = False,
    rows: int = ROWS,
    global_batch: int = 20,
    micro_batch: int = 4,
    deterministic: bool = True,
    model_fn: Any = None,
    optimizer_fn: Any = sgd,
    lr: LRConfig | None = None,
    max_grad_norm: float | None = None,
    drop_last: bool = False,
    loss_fn: Any = squared_error,
    max_failures: int = 0,
    id_column: str | None = "id",
    data: str = "parquet",
    storage: str | None = None,
    keep: int = 2,
    partitions: int = 32,
    **kwargs: Any,
) -> ElasticTrainer:
    """A trainer on the regression toy data with `workers` fixed workers and no retries (a failure fails).

    `data`: "parquet" (Parquet files under `tmp`, read in place: the default path) or "ray" (a Ray dataset,
    materialized in deterministic mode); streaming mode (`deterministic=False`) always takes a Ray dataset.
    `storage`: a URI for the checkpoints (the run's files then go under `tmp`); default: `tmp` holds both.
    `partitions`: the Parquet source's canonical partitions."""
    if data == "parquet" and deterministic:
        train: Any = ParquetSource(parquet_data(rows), shuffle_window=2, partitions=partitions)
    else:
        train = regression_dataset(rows)
    return ElasticTrainer(
        model_fn=model_fn or mlp_factory(8, 16),
        loss_fn=loss_fn,
        optimizer_fn=optimizer_fn,
        datasets={"train": train},
        batch=BatchConfig(global_batch=global_batch, micro_batch=micro_batch, drop_last=drop_last),
        lr=lr or LRConfig(base_lr=0.2, warmup_steps=2),
        loop=LoopConfig(
            epochs=epochs,
            max_steps=steps,
            strategy=strategy,
            audit_samples=audit,
            id_column=id_column,
            deterministic=deterministic,
            shuffle_buffer=16,
            max_grad_norm=max_grad_norm,
        ),
        checkpoint=CheckpointConfig(
            storage_path=storage or str(tmp), log_dir=str(tmp), run_name=run, every_steps=every, keep=keep
        ),
        cluster=ClusterConfig(min_workers=workers, max_workers=workers, max_failures=max_failures),
        required_columns=("x", "y"),
        **kwargs,
    )


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a JSON-lines file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def ids_by_epoch(samples_path: str | Path) -> dict[int, list[int]]:
    """The audited sample ids of every epoch, in training order."""
    by_epoch: dict[int, list[int]] = {}
    for record in read_jsonl(samples_path):
        by_epoch.setdefault(record["epoch"], []).extend(record["ids"])
    return by_epoch


def wait_for(what: str, condition: Any, timeout_s: float, interval_s: float = 1.0) -> Any:
    """Poll `condition()` until it returns something true; fail naming `what` after `timeout_s`."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"waited {timeout_s:.0f} s for {what}")


@contextlib.contextmanager
def ray_head(
    *, dashboard: bool = False, num_cpus: int = 4, env: dict[str, str] | None = None
) -> Iterator[dict[str, Any]]:
    """A Ray head of its own (`ray start --head --block` in a subprocess, dashboard on 127.0.0.1 only), stopped
    by ending that subprocess's process group, the head's processes only (never `ray stop`, which would stop every
    Ray instance here).
    Yields {"address": "127.0.0.1:<gcs port>", "dashboard": "http://127.0.0.1:<port>" or None, "env": ...}."""
    import os
    import signal
    import subprocess
    import urllib.error
    import urllib.request

    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", **(env or {})}
    env.pop("RAY_ADDRESS", None)
    gcs_port, dashboard_port = free_port(), free_port()
    command = ["ray", "start", "--head", "--block", f"--port={gcs_port}", f"--num-cpus={num_cpus}"]
    command += ["--disable-usage-stats", f"--include-dashboard={'true' if dashboard else 'false'}"]
    if dashboard:
        command += ["--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}"]
    # Every Ray instance's dashboard agent listens on 52365 unless told otherwise; with the session's local
    # instance already holding it, this head's agent would have no HTTP server and never accept a job.
    command += [f"--dashboard-agent-listen-port={free_port()}"]
    head = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    url = f"http://127.0.0.1:{dashboard_port}" if dashboard else None
    try:
        if url:

            def dashboard_up() -> bool:
                try:
                    with urllib.request.urlopen(f"{url}/api/version", timeout=2) as response:
                        return response.status == 200
                except urllib.error.HTTPError:  # it answers (e.g. 401 with token authentication): it is up
                    return True
                except OSError:
                    return False

            wait_for(f"the dashboard at {url}", dashboard_up, 90)
        else:

            def gcs_up() -> bool:
                try:
                    socket_probe(gcs_port)
                    return True
                except OSError:
                    return False

            wait_for(f"the GCS at 127.0.0.1:{gcs_port}", gcs_up, 90)
        yield {"address": f"127.0.0.1:{gcs_port}", "dashboard": url, "env": env}
    finally:
        # SIGTERM first (the head's processes flush their logs), then SIGKILL to what is left: on SIGTERM alone the
        # GCS and raylet take their graceful-shutdown timeouts, ~30-40 s here, for a cluster nothing else uses
        os.killpg(head.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(timeout=3)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=60)


def sigint_as_in_a_terminal() -> None:
    """`preexec_fn` for a child that a test will Ctrl-C. A command started in the background by a shell without job
    control (`cmd &` in a script, as a CI runner may run .ci/run) inherits SIGINT *ignored*, and Python then never
    raises KeyboardInterrupt: the child would run to its end. Ctrl-C in a terminal reaches a process whose SIGINT
    is at its default; give the child that."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def char_project_checkout(root: Path) -> Path:
    """`root` made into what a user's checkout holds: the two-file project `examples/char_project` (`train.py`
    imports its neighbour `charmodel.py`) under `root/char_project` and its text under `root/data`; returns
    `root`."""
    import shutil

    examples = Path(__file__).resolve().parent.parent / "examples"
    ignore = shutil.ignore_patterns("data", "raytrain_runs")
    shutil.copytree(examples / "char_project", root / "char_project", ignore=ignore)
    shutil.copytree(examples / "data", root / "data")
    return root


def socket_probe(port: int) -> None:
    """Raise OSError unless something accepts a TCP connection on 127.0.0.1:`port`."""
    import socket

    socket.create_connection(("127.0.0.1", port), timeout=2).close()


# ---------------------------------------------------------------- `raytrain demo --json` runs (elastic and faults)

GLOBAL_BATCH = 24
EPOCH_STEPS = 10
RUN_TIMEOUT_S = 600


def demo(tmp: Path, name: str, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """`raytrain demo --json` in a subprocess with its own fake-node cluster; its summary plus its stderr. Checks
    that stdout is one JSON object and that every stderr line is raytrain's or a one-line Ray error."""
    import os
    import subprocess
    import sys

    command = [sys.executable, "-m", "raytrain.cli", "demo", "--storage", str(tmp), "--run-name", name, "--json"]
    command += ["--global-batch", str(GLOBAL_BATCH), "--micro-batch", "4", "--epoch-steps", str(EPOCH_STEPS)]
    command += ["--audit-samples", *args]
    environment = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **(env or {})}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=environment)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"waited {RUN_TIMEOUT_S} s for `raytrain demo {' '.join(args)}` to finish") from err
    assert done.returncode == 0, f"demo {args} failed:\n{done.stderr[-4000:]}"
    stdout = done.stdout.strip().splitlines()
    assert len(stdout) == 1, f"--json prints one JSON object on stdout, got {len(stdout)} lines"
    noise = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith(("[raytrain", "[ray]"))]
    assert not noise, "lines that are neither raytrain's nor a Ray error summary:\n" + "\n".join(noise[:20])
    for echo in ("Traceback", "/__w/pytorch", "Connection closed by peer", "Raylet is terminated"):
        assert echo not in done.stderr, f"a normal run printed {echo!r}:\n{done.stderr[-3000:]}"
    return {**json.loads(stdout[0]), "stderr": done.stderr}


def losses(summary: dict[str, Any]) -> list[float]:
    """The loss of every step of a demo run."""
    return [record["loss"] for record in read_jsonl(summary["metrics"])]


def check_invariants(summary: dict[str, Any], steps: int) -> None:
    """Every step present once with the global batch exact, and a clean audit of every completed epoch."""
    lines = read_jsonl(summary["metrics"])
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    assert {m["global_batch_size"] for m in lines} == {GLOBAL_BATCH}
    assert all(sum(m["per_rank_samples"]) == GLOBAL_BATCH for m in lines)
    completed = steps // EPOCH_STEPS
    assert len(summary["audit"]) == completed
    for epoch, counts in summary["audit"].items():
        assert counts == {"duplicates": 0, "missing": 0}, f"epoch {epoch}: {counts}"


def assert_same_curve(summary: dict[str, Any], reference: list[float]) -> None:
    """The run's loss equals the fixed-size reference step by step (deterministic mode)."""
    import pytest

    curve = losses(summary)
    for step, (a, b) in enumerate(zip(curve, reference, strict=False), start=1):
        assert a == pytest.approx(b, rel=1e-4), f"step {step}: {a} vs fixed-size {b}"
