"""A bug in the user's code costs seconds, not ten restarts: checked on the driver where it can be, and never
retried twice at the same step where it cannot (real Ray, local instance)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray.cloudpickle
import torch
from ray_helpers import make_trainer, read_jsonl

from raytrain.console import DETAIL_PREFIX, LOG_FILE
from raytrain.errors import ConfigError, UserCodeError
from raytrain.preflight import build_model_for_check, check_loss_fn
from raytrain.toy import mlp_factory, regression_arrays, squared_error

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules by name

REPO = Path(__file__).resolve().parent.parent


def mean_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return squared_error(model, batch).mean()  # the classic mistake: a mean, not one loss per sample


def reads_a_missing_column(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (model(batch["x"]) - batch["label"]) ** 2


def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return mean_loss(model, batch)


def per_feature_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (model(batch["x"]).unsqueeze(1) - batch["x"][:, :3]) ** 2  # [n, 3]: per token, per feature, ...


def broadcast_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (model(batch["x"]) - batch["y"].unsqueeze(1)) ** 2  # predictions [n] against targets [n, 1]: [n, n]


@pytest.mark.parametrize(
    ("loss_fn", "message"),
    [
        (mean_loss, r"loss_fn mean_loss must return one loss per sample, a tensor of shape \[2\] .* got shape \(\)"),
        (reads_a_missing_column, r"loss_fn reads_a_missing_column raised KeyError: 'label' on a batch of 2 samples"),
        (loss_fn, r"^loss_fn must return one loss per sample"),  # a function named as its role: named once
        (per_feature_loss, r"got shape \(2, 3\) \(one row per sample .* losses.mean\(dim=1\)"),
        (broadcast_loss, r"got shape \(2, 2\) \(one row per sample .*; a \[2, 2\] tensor is also .* broadcast to"),
    ],
)
def test_the_loss_is_checked_on_real_samples_on_the_driver(loss_fn, message: str) -> None:  # type: ignore[no-untyped-def]
    sample = {name: column[:2] for name, column in regression_arrays(4).items()}
    model = build_model_for_check(mlp_factory(8, 16))
    assert all(p.is_meta for p in model.parameters())  # shapes only: no weights are allocated for the check
    with pytest.raises(ConfigError, match=message):
        check_loss_fn(loss_fn, model, sample, mlp_factory(8, 16))
    assert check_loss_fn(squared_error, model, sample, mlp_factory(8, 16)) == ""


@pytest.mark.ray
def test_a_bad_loss_fails_before_any_worker_starts(ray_local: None, tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, "bad", workers=2)
    trainer.loss_fn = mean_loss
    started = time.monotonic()
    with pytest.raises(ConfigError, match="must return one loss per sample"):
        trainer.fit()
    assert not (tmp_path / "bad" / "events.jsonl").exists()  # no worker ever started
    print(f"failed after {time.monotonic() - started:.1f} s")


@pytest.mark.ray
def test_a_bug_in_a_worker_is_not_retried_twice_and_shows_the_users_file_and_line(
    tmp_path: Path, ray_head_env: dict[str, str]
) -> None:
    """`raytrain fit` of a project whose loss fails in a worker at the step that reaches sample 42 (the driver's
    check on the first rows passes): the same exception at the same step in the second attempt ends the run
    (max_failures 10 would allow 11); the terminal shows the error, then the user's file, line and code, and no
    traceback of Ray's; exit 2; `<run>/raytrain.log` holds every attempt's traceback whole."""
    (tmp_path / "shapes.py").write_text("def fold(x):\n    return x.view(7, -1)\n")
    (tmp_path / "entry.py").write_text(
        "from raytrain.toy import mlp, regression_dataset, squared_error, sgd\n"
        "from shapes import fold\n"
        "def model():\n    return mlp(16, 32)\n"
        "def loss(model, batch):\n"
        "    if bool((batch['id'] == 42).any()):\n"
        "        fold(batch['x'])  # 7 does not divide 8 x 16\n"
        "    return squared_error(model, batch)\n"
        "def optimizer(params, lr):\n    return sgd(params, lr)\n"
        "def datasets():\n    return {'train': regression_dataset(64, features=16)}\n"
    )
    (tmp_path / "job.toml").write_text(
        '[entry]\nmodel = "entry.py:model"\nloss = "entry.py:loss"\noptimizer = "entry.py:optimizer"\n'
        'datasets = "entry.py:datasets"\n[batch]\nglobal_batch = 16\nmicro_batch = 8\n[lr]\nbase_lr = 0.1\n'
        f'[checkpoint]\nstorage_path = "{tmp_path / "runs"}"\n[loop]\nid_column = "id"\n[cluster]\nmax_failures = 10\n'
    )
    completed = subprocess.run(
        [sys.executable, "-m", "raytrain.cli", "fit", str(tmp_path / "job.toml"), "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, **ray_head_env},
    )
    terminal = completed.stderr.splitlines()
    assert completed.returncode == 2, completed.stderr[-3000:]
    (error,) = [i for i, line in enumerate(terminal) if line.startswith("raytrain: error:")]
    assert re.search(
        r"RuntimeError: shape '\[7, -1\]' is invalid for input of size 128 \(at step \d on rank \d\), the same in "
        "two attempts of the worker group: a bug in the training code",
        terminal[error],
    ), terminal[error]
    assert terminal[error + 1 :] == [
        f'  File "{tmp_path / "entry.py"}", line 7, in loss',
        "    fold(batch['x'])  # 7 does not divide 8 x 16",
        f'  File "{tmp_path / "shapes.py"}", line 2, in fold',
        "    return x.view(7, -1)",
    ]
    assert "Traceback" not in completed.stderr and "ray." not in completed.stderr, completed.stderr[-3000:]
    assert "File " not in completed.stdout, completed.stdout  # the log's tail shows no detail line: said once
    run_dir = tmp_path / "runs" / "run"
    assert len(read_jsonl(run_dir / "events.jsonl")) == 2  # two attempts of the worker group, not eleven
    log = (run_dir / LOG_FILE).read_text().splitlines()
    whole = [i for i, line in enumerate(log) if line.endswith("Traceback (most recent call last):")]
    assert len(whole) >= 2 and all(log[i].startswith(DETAIL_PREFIX) for i in whole), log  # the retry and the stop
    assert sum("return x.view(7, -1)" in line for line in log) >= 2 and any("worker_loop.py" in x for x in log)


def test_cli_reports_a_bad_loss_in_one_line_with_exit_2(tmp_path: Path, ray_head_env: dict[str, str]) -> None:
    (tmp_path / "entry.py").write_text(
        "from raytrain.toy import mlp, regression_dataset, squared_error, sgd\n"
        "def model():\n    return mlp(16, 32)\n"
        "def loss(model, batch):\n    return squared_error(model, batch).mean()\n"
        "def optimizer(params, lr):\n    return sgd(params, lr)\n"
        "def datasets():\n    return {'train': regression_dataset(64, features=16)}\n"
    )
    (tmp_path / "job.toml").write_text(
        '[entry]\nmodel = "entry.py:model"\nloss = "entry.py:loss"\noptimizer = "entry.py:optimizer"\n'
        'datasets = "entry.py:datasets"\n[batch]\nglobal_batch = 16\nmicro_batch = 8\n[lr]\nbase_lr = 0.1\n'
        f'[checkpoint]\nstorage_path = "{tmp_path / "runs"}"\n[loop]\nid_column = "id"\n'
    )
    completed = subprocess.run(
        [sys.executable, "-m", "raytrain.cli", "fit", str(tmp_path / "job.toml")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, **ray_head_env},
    )
    assert completed.returncode == 2, completed.stderr[-2000:]
    errors = [line for line in completed.stderr.splitlines() if line.startswith("raytrain: error:")]
    assert len(errors) == 1 and "loss_fn loss must return one loss per sample" in errors[0], completed.stderr[-2000:]
    assert "Traceback" not in completed.stderr
    assert not (tmp_path / "runs" / "run" / "events.jsonl").exists()


def nan_on_sample_42(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A numerical fault: the loss of sample 42 is NaN (the others are fine)."""
    losses = squared_error(model, batch)
    return torch.where(batch["id"] == 42, torch.full_like(losses, float("nan")), losses)


@pytest.mark.ray
def test_a_nan_stops_the_run_at_once_and_keeps_the_last_good_checkpoint(ray_local: None, tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, "nan", workers=2, loss_fn=nan_on_sample_42, max_failures=10, every=1, epochs=1)
    with pytest.raises(UserCodeError, match=r"NonFiniteError: step (\d+): the loss \(nan\)") as caught:
        trainer.fit()
    bad_step = int(str(caught.value).split("step ")[1].split(":")[0])
    starts = read_jsonl(tmp_path / "nan" / "events.jsonl")
    assert len(starts) == 1, "a NaN is not retried"
    steps = [m["step"] for m in read_jsonl(tmp_path / "nan" / "metrics.jsonl")]
    assert steps == list(range(1, bad_step))  # nothing of the bad step was recorded or committed
    from raytrain.checkpoint_files import checkpoint_dirs

    assert max(step for step, _ in checkpoint_dirs(str(tmp_path / "nan"))) == bad_step - 1


@pytest.mark.ray
def test_skip_drops_the_nan_steps_update_and_counts_it(ray_local: None, tmp_path: Path) -> None:
    from dataclasses import replace

    trainer = make_trainer(tmp_path, "skip", workers=2, loss_fn=nan_on_sample_42, epochs=1)
    trainer.spec = replace(trainer.spec, loop=replace(trainer.spec.loop, on_nonfinite="skip"))
    metrics = read_jsonl(trainer.fit().metrics_path)
    skipped = [m for m in metrics if m["loss"] != m["loss"]]  # NaN
    assert len(skipped) == 1 and metrics[-1]["skipped_steps"] == 1
    assert all(m["loss"] == m["loss"] for m in metrics if m["step"] > skipped[0]["step"])  # the model stayed finite
