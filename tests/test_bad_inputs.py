"""Bad input, everywhere: each of these configurations and data sets is one `ConfigError` before any worker
starts, naming the field (or column), the value and what is valid. Table-driven; the data cases use a real local
Ray instance (the data is read as a user's would be), the others need nothing."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from ray_helpers import make_trainer

from raytrain.config import (
    BatchConfig,
    CheckpointConfig,
    ClusterConfig,
    LoopConfig,
    LRConfig,
    ParallelConfig,
    TrainSpec,
)
from raytrain.errors import ConfigError
from raytrain.toy import adamw, mlp_factory, mlp_tp_plan, squared_error
from raytrain.trainer import ElasticTrainer


def _tp_spec(**fields: Any) -> TrainSpec:
    """A small TrainSpec with tp 2 on 2..4 workers, `fields` replaced."""
    settings: dict[str, Any] = {
        "batch": BatchConfig(global_batch=8, micro_batch=4),
        "lr": LRConfig(base_lr=0.1),
        "loop": LoopConfig(),
        "checkpoint": CheckpointConfig(),
        "cluster": ClusterConfig(min_workers=2, max_workers=4),
        "parallel": ParallelConfig(tp=2),
    }
    return TrainSpec(**{**settings, **fields})


CONFIG_CASES: list[tuple[str, Callable[[], Any], str]] = [
    (
        "global_batch not an int",
        lambda: BatchConfig(global_batch="64", micro_batch=8),
        "global_batch must be an integer >= 1, got '64'",
    ),
    (
        "global_batch 0",
        lambda: BatchConfig(global_batch=0, micro_batch=8),
        "global_batch must be an integer >= 1, got 0",
    ),
    (
        "micro_batch negative",
        lambda: BatchConfig(global_batch=8, micro_batch=-1),
        "micro_batch must be an integer >= 1, got -1",
    ),
    ("base_lr 0", lambda: LRConfig(base_lr=0), "base_lr must be a number > 0, got 0"),
    ("lr rule", lambda: LRConfig(base_lr=0.1, rule="cube"), "^rule must be one of linear, sqrt, none, got 'cube'"),
    (
        "schedule",
        lambda: LRConfig(base_lr=0.1, schedule="step"),
        "schedule must be one of constant, cosine, linear, got 'step'",
    ),
    (
        "min_lr_ratio",
        lambda: LRConfig(base_lr=0.1, min_lr_ratio=2),
        r"min_lr_ratio must be a number in \[0, 1\], got 2",
    ),
    (
        "strategy",
        lambda: LoopConfig(strategy="zero4"),
        "strategy must be one of auto, ddp, zero1, zero2, zero3, got 'zero4'",
    ),
    ("epochs 0", lambda: LoopConfig(epochs=0), "epochs must be an integer >= 1, got 0"),
    (
        "max_grad_norm negative",
        lambda: LoopConfig(max_grad_norm=-1.0),
        "max_grad_norm must be a finite number > 0 or None, got -1.0",
    ),
    ("on_nonfinite", lambda: LoopConfig(on_nonfinite="ignore"), "on_nonfinite must be one of stop, skip, got 'ignore'"),
    (
        "min > max workers",
        lambda: ClusterConfig(min_workers=3, max_workers=2),
        "min_workers must be <= max_workers, got min_workers=3 > max_workers=2",
    ),
    (
        "negative resource",
        lambda: ClusterConfig(resources_per_worker={"CPU": -1}),
        r"resources_per_worker\['CPU'\] must be a number >= 0, got -1",
    ),
    (
        "run_name with /",
        lambda: CheckpointConfig(run_name="a/b"),
        "run_name must be a non-empty name without '/', got 'a/b'",
    ),
    ("every_steps 0", lambda: CheckpointConfig(every_steps=0), "every_steps must be an integer >= 1, got 0"),
    ("precision", lambda: ParallelConfig(precision="fp8"), "precision must be one of fp32, bf16, fp16, got 'fp8'"),
    (
        "more workers than samples",
        lambda: TrainSpec(
            batch=BatchConfig(global_batch=2, micro_batch=1),
            lr=LRConfig(base_lr=0.1),
            loop=LoopConfig(),
            checkpoint=CheckpointConfig(),
            cluster=ClusterConfig(min_workers=1, max_workers=3),
        ),
        r"max_workers must be <= global_batch \(2\), got 3",
    ),
    (
        "fp16 with zero3",
        lambda: TrainSpec(
            batch=BatchConfig(global_batch=8, micro_batch=4),
            lr=LRConfig(base_lr=0.1),
            loop=LoopConfig(strategy="zero3"),
            checkpoint=CheckpointConfig(),
            cluster=ClusterConfig(),
            parallel=ParallelConfig(precision="fp16"),
        ),
        "precision 'fp16' needs strategy ddp or zero1",
    ),
    ("tp zero", lambda: ParallelConfig(tp=0), "tp must be an integer >= 1 or 'auto', got 0"),
    (
        "chunks without interleaving",
        lambda: ParallelConfig(pp=2, pp_chunks=2),
        "pp_chunks=2 needs pp_schedule 'interleaved_1f1b' \\(the gpipe schedule runs one chunk per stage\\)",
    ),
    (
        "a schedule without a pipeline",
        lambda: ParallelConfig(pp_schedule="1f1b"),
        r"pp_schedule='1f1b' orders the micro-batches of a pipeline: it needs pp > 1, got pp = 1",
    ),
    (
        "interleaving one chunk",
        lambda: ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", pp_chunks=1),
        "pp_chunks must be an integer >= 2, got 1",
    ),
    (
        "tp with an odd min_workers",
        lambda: _tp_spec(cluster=ClusterConfig(min_workers=3, max_workers=4)),
        r"min_workers must be a multiple of tp \* pp \(2 \* 1 = 2\).*got 3",
    ),
    (
        "tp with zero1",
        lambda: _tp_spec(loop=LoopConfig(strategy="zero1")),
        "strategy 'zero1' cannot be combined with tp or pp > 1",
    ),
    (
        "tp with fp16",
        lambda: _tp_spec(parallel=ParallelConfig(tp=2, precision="fp16")),
        "precision 'fp16' is not supported with tp or pp > 1",
    ),
]


@pytest.mark.parametrize(("name", "build", "message"), CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_configuration(name: str, build: Callable[[], Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build()


class NeedsTrust(torch.optim.SGD):
    def __init__(self, params: Any, lr: float, trust: float) -> None:
        super().__init__(params, lr=lr)


def _table(**columns: Any) -> Any:
    import ray.data

    return ray.data.from_arrow(pa.table(columns))


def _good_columns(rows: int = 40) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "id": pa.array(np.arange(rows)),
        "x": pa.array(list(rng.normal(size=(rows, 8)).astype(np.float32))),
        "y": pa.array(rng.normal(size=rows).astype(np.float32)),
    }


def _mean_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return squared_error(model, batch).mean()


DATA_CASES: list[tuple[str, Callable[[], dict[str, Any]], dict[str, Any], str]] = [
    (
        "missing column",
        lambda: {k: v for k, v in _good_columns().items() if k != "y"},
        {},
        r"training dataset has no column\(s\) \['y'\]",
    ),
    ("non-numeric column", lambda: {**_good_columns(), "y": pa.array(["a"] * 40)}, {}, "column 'y' is not numeric"),
    (
        "ragged lists",
        lambda: {**_good_columns(), "x": pa.array([[1.0] * (1 + i % 3) for i in range(40)])},
        {},
        "column 'x' holds lists of different lengths",
    ),
    (
        "duplicate ids",
        lambda: {**_good_columns(), "id": pa.array([i // 2 for i in range(40)])},
        {},
        "id_column 'id' must hold a unique id per row",
    ),
    ("empty data set", lambda: {k: v[:0] for k, v in _good_columns().items()}, {}, "training dataset is empty"),
    ("loss returns a mean", _good_columns, {"loss_fn": _mean_loss}, "must return one loss per sample"),
    (
        "unshardable optimizer",
        _good_columns,
        {"strategy": "zero1", "optimizer_fn": functools.partial(NeedsTrust, trust=1.0)},
        "cannot shard optimizer",
    ),
    (
        "streaming with float ids",
        lambda: {**_good_columns(), "id": pa.array(np.arange(40) + 0.5)},
        {"deterministic": False},
        "id_column 'id' must hold integers, got dtype float64",
    ),
    (
        "batch larger than the data with drop_last",
        _good_columns,
        {"global_batch": 80, "drop_last": True},
        r"global_batch \(80\) is larger than the training set \(40 rows\)",
    ),
]


@pytest.mark.ray
@pytest.mark.parametrize(("name", "columns", "options", "message"), DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_bad_data_or_functions(
    ray_local: None,
    tmp_path: Path,
    name: str,
    columns: Callable[[], dict[str, Any]],
    options: dict[str, Any],
    message: str,
) -> None:
    trainer = make_trainer(tmp_path, "bad", workers=2, **options)
    trainer.datasets["train"] = _table(**columns())
    with pytest.raises(ConfigError, match=message):
        trainer.fit()
    assert not (tmp_path / "bad" / "events.jsonl").exists()  # no worker ever started


@pytest.mark.ray
def test_streaming_without_an_id_column_and_unknown_toml_keys(tmp_path: Path, ray_local: None) -> None:
    """(`ray_local`: the trainer's data set is a Ray dataset; without a connection Ray Data would join whatever
    instance the machine's /tmp/ray names, a dead one included.)"""
    with pytest.raises(ConfigError, match="id_column must name a column with a unique integer id per sample"):
        make_trainer(tmp_path, "s", workers=1, deterministic=False, id_column=None)
    from raytrain.cli.fit_config import parse_fit_config

    path = tmp_path / "job.toml"
    path.write_text(
        '[entry]\nmodel = "a:b"\nloss = "a:b"\noptimizer = "a:b"\ndatasets = "a:b"\n[batch]\nglobal_bach = 8\n'
    )
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['global_bach'\] in \[batch\]"):
        parse_fit_config(str(path))


def _tp_trainer(tmp_path: Path, **options: Any) -> ElasticTrainer:
    settings: dict[str, Any] = {
        "model_fn": mlp_factory(8, 32),
        "loss_fn": squared_error,
        "optimizer_fn": adamw,
        "datasets": {"train": str(tmp_path)},
        "batch": BatchConfig(global_batch=8, micro_batch=4),
        "lr": LRConfig(base_lr=0.1),
        "cluster": ClusterConfig(min_workers=2, max_workers=4),
        "parallel": ParallelConfig(tp=2),
        "checkpoint": CheckpointConfig(storage_path=str(tmp_path)),
    }
    return ElasticTrainer(**{**settings, **options})


def test_tensor_parallel_is_checked_on_the_driver(tmp_path: Path) -> None:
    """Streaming mode, a model without a plan and a plan that does not fit the model fail before any worker."""
    with pytest.raises(ConfigError, match="tp 2 and pp 1 need deterministic=True"):
        _tp_trainer(tmp_path, loop=LoopConfig(deterministic=False, id_column="id"), datasets={"train": object()})
    with pytest.raises(ConfigError, match="tp > 1 needs a tensor-parallel plan for Sequential"):
        _tp_trainer(tmp_path).check_user_functions()
    with pytest.raises(ConfigError, match=r"output features \(32\) are not a multiple of tp = 3"):
        bad = _tp_trainer(
            tmp_path,
            tp_plan_fn=mlp_tp_plan,
            parallel=ParallelConfig(tp=3),
            cluster=ClusterConfig(min_workers=3, max_workers=3),
        )
        bad.check_user_functions()
    _tp_trainer(tmp_path, tp_plan_fn=mlp_tp_plan).check_user_functions()  # the toy MLP's plan fits tp 2
    unsplittable = functools.partial(torch.nn.Transformer, 16, 2, 1, 1, 32)  # two block lists, no pipeline_split()
    with pytest.raises(ConfigError, match=r"pipeline parallel \(pp > 1\) cannot split Transformer: .*pipeline_split"):
        _tp_trainer(tmp_path, model_fn=unsplittable, parallel=ParallelConfig(pp=2)).check_user_functions()
    with pytest.raises(ConfigError, match=r"max_workers must be a multiple of tp \* pp \(2 \* 2 = 4\)"):
        _tp_trainer(tmp_path, parallel=ParallelConfig(tp=2, pp=2), cluster=ClusterConfig(min_workers=4, max_workers=6))
    _tp_trainer(tmp_path, parallel=ParallelConfig(pp=2)).check_user_functions()  # the MLP is an nn.Sequential
    interleaved = ParallelConfig(pp=2, pp_schedule="interleaved_1f1b")  # 2 chunks per stage: 4 virtual stages
    with pytest.raises(ConfigError, match=r"4 pipeline stages \(pp x pp_chunks\) need at least 4 pipeline units"):
        _tp_trainer(tmp_path, parallel=interleaved).check_user_functions()


def token_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross entropy per sample, for a model returning logits (a tensor, or transformers' output)."""
    out = model(batch["tokens"])
    logits = out if isinstance(out, torch.Tensor) else out.logits
    losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), batch["tokens"][:, 1:].flatten(), reduction="none"
    )
    return losses.view(len(batch["tokens"]), -1).mean(dim=1)


@pytest.mark.parametrize("model", ["DropoutDecoder", "llama"])
def test_a_sequence_tp_does_not_divide_is_refused_on_the_driver(
    tmp_path: Path, model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Sequence parallel cuts the hidden states entering the blocks into tp slices: a length tp does not divide
    fails before any worker, naming the length and a length that works (it failed in every worker's first step
    before); one it divides is logged with its share per rank. Our decoder calls its blocks with the hidden states
    as first argument, transformers' Llama its decoder layers."""
    from user_models import DropoutDecoder, llama

    model_fn = DropoutDecoder if model == "DropoutDecoder" else llama
    trainer = _tp_trainer(
        tmp_path,
        model_fn=model_fn,
        loss_fn=token_loss,
        parallel=ParallelConfig(tp=2, sequence_parallel=True),
        required_columns=("tokens",),
    )
    tokens = np.arange(14).reshape(2, 7) % 16
    blocks = "blocks" if model == "DropoutDecoder" else "model.layers"
    with pytest.raises(
        ConfigError, match=rf"entering {blocks}, shape \(2, 7, 32\)\) into tp = 2 slices: its length 7 "
    ):
        trainer.check_loss_fn({"tokens": tokens})
    capsys.readouterr()
    trainer.check_loss_fn({"tokens": np.arange(16).reshape(2, 8) % 16})
    assert f"sequence parallel: 8 positions at {blocks}, 4 per tp rank" in capsys.readouterr().out
