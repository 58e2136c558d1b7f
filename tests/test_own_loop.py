"""Bring your own loop (`raytrain.attach`): examples/own_loop.py, a plain Ray Train `train_func`, trained at
W = 2, then resumed at 1, then at 2 (each start reads the checkpoint at its new world size), against raytrain's
own loop (`ElasticTrainer`) on the same model, data, batch, LR rule and optimizer at a fixed W = 2: the same loss
curve, every sample once per epoch, and the user's own state (an EMA) carried through the checkpoints."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import torch
from ray_helpers import ids_by_epoch, read_jsonl

from raytrain.config import BatchConfig, CheckpointConfig, ClusterConfig, LoopConfig, LRConfig
from raytrain.trainer import ElasticTrainer

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parent.parent


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("own_loop", REPO / "examples" / "own_loop.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["own_loop"] = module
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)  # workers cannot import a file of examples/ by name
    return module


own_loop = _example()
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def per_sample_squared_error(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (model(batch["x"]) - batch["y"]) ** 2


def framework_losses(tmp_path: Path, steps: int) -> list[float]:
    """The same training through `ElasticTrainer` (raytrain's own loop) at W = 2, on the example's data as a Ray
    dataset whose ids are the map-style indices (so both order the same samples the same way)."""
    data = own_loop.RegressionData()
    rows = [{"id": i, "x": data.x[i], "y": data.y[i]} for i in range(len(data))]
    trainer = ElasticTrainer(
        model_fn=own_loop.Net,
        loss_fn=per_sample_squared_error,
        optimizer_fn=own_loop.adamw,
        datasets={"train": ray.data.from_items(rows)},
        batch=BatchConfig(global_batch=32, micro_batch=8),
        lr=LRConfig(base_lr=3e-3, rule="sqrt", warmup_steps=5),
        loop=LoopConfig(epochs=3, max_steps=steps, id_column="id"),
        checkpoint=CheckpointConfig(storage_path=str(tmp_path), log_dir=str(tmp_path), run_name="framework"),
        cluster=ClusterConfig(min_workers=2, max_workers=2, max_failures=0),
        required_columns=("x", "y"),
    )
    return [m["loss"] for m in read_jsonl(trainer.fit().metrics_path)]


@pytest.fixture(scope="module")
def resized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example trained at W = 2 to step 12, then resumed at W = 1 to step 24 and at W = 2 to step 36."""
    tmp_path = tmp_path_factory.mktemp("own_loop")
    storage = str(tmp_path / "runs")
    for workers, steps in ((2, 12), (1, 24), (2, 36)):
        result = own_loop.main(["--workers", str(workers), "--steps", str(steps), "--storage", storage])
        assert result.error is None and result.metrics["step"] == steps
    return tmp_path


def test_own_loop_resized_2_1_2_trains_the_frameworks_curve_with_every_sample_once(ray_local: None, resized: Path):
    tmp_path, storage = resized, str(resized / "runs")
    run_dir = tmp_path / "runs" / "own_loop"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 37))
    assert [m["world_size"] for m in metrics] == [2] * 12 + [1] * 12 + [2] * 12
    assert {m["global_batch_size"] for m in metrics if m["epoch"] == 0 and m["step"] < 19} == {32}
    assert all(m["data_wait_max_s"] >= m["data_wait_s"] >= 0 for m in metrics)  # the slowest rank's, agreed
    events = read_jsonl(run_dir / "events.jsonl")
    assert [(e["world_size"], e["step"], e["restored"]) for e in events] == [
        (2, 0, False),
        (1, 12, True),
        (2, 24, True),
    ]

    reference = framework_losses(tmp_path, 36)
    np.testing.assert_allclose([m["loss"] for m in metrics], reference, rtol=0, atol=1e-4)

    by_epoch = ids_by_epoch(run_dir / "samples.jsonl")
    assert sorted(by_epoch[0]) == list(range(600))  # 600 rows: epoch 0 is steps 1-19 (the last of 24 samples)
    assert len(by_epoch[1]) == len(set(by_epoch[1])) == 17 * 32  # steps 20-36
    assert by_epoch[1] != sorted(by_epoch[1]) and by_epoch[1][:32] != by_epoch[0][:32]  # reshuffled

    # The EMA (the user's own state) went through both resumes: it ends where a run that never stopped ends it.
    straight = own_loop.main(["--workers", "2", "--steps", "36", "--storage", storage, "--run-name", "straight"])
    assert straight.metrics["ema_norm"] == pytest.approx(metrics[-1]["ema_norm"], abs=1e-6)
    assert straight.metrics["loss"] == pytest.approx(metrics[-1]["loss"], abs=1e-6)


def train_on(data: Any, run: str, storage: str, steps: int) -> Any:
    """The example's `train_func` on other data, at W = 2."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    config = {"global_batch": 32, "micro_batch": 8, "lr": 3e-3, "epochs": 3, "steps": steps, "every": 10}
    return TorchTrainer(
        own_loop.train_func,
        train_loop_config={**config, "data": data},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=run, storage_path=storage),
    ).fit()


@pytest.mark.parametrize("kind", ["ray_dataset", "parquet"])
def test_own_loop_takes_a_ray_dataset_and_parquet_files(ray_local: None, resized: Path, kind: str, tmp_path):
    """The same rows as a Ray dataset (ids = the map-style indices: the same order, so the same curve as the
    map-style run's first steps) and as Parquet files (read in place in raytrain's windowed order: every sample
    once)."""
    data = own_loop.RegressionData()
    rows = [{"id": i, "x": data.x[i], "y": data.y[i]} for i in range(len(data))]
    if kind == "ray_dataset":
        source: Any = ray.data.from_items(rows)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq
        from ray.data.extensions import ArrowTensorArray

        table = pa.table({"id": np.arange(len(data)), "x": ArrowTensorArray.from_numpy(data.x), "y": data.y})
        for part, begin in enumerate(range(0, len(data), 200)):
            pq.write_table(table.slice(begin, 200), tmp_path / f"part-{part}.parquet", row_group_size=50)
        source = str(tmp_path)
    result = train_on(source, kind, str(tmp_path / "runs"), 19)  # epoch 0: 18 steps of 32 and one of 24
    assert result.error is None and result.metrics["step"] == 19
    metrics = read_jsonl(tmp_path / "runs" / kind / "metrics.jsonl")
    ids = ids_by_epoch(tmp_path / "runs" / kind / "samples.jsonl")[0]
    assert sorted(ids) == list(range(600))  # every sample once
    if kind == "ray_dataset":
        reference = read_jsonl(resized / "runs" / "own_loop" / "metrics.jsonl")[:12]
        np.testing.assert_allclose([m["loss"] for m in metrics[:12]], [m["loss"] for m in reference], atol=1e-6)
