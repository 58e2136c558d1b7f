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


def test_own_loop_resized_2_1_2_trains_the_frameworks_curve_with_every_sample_once(ray_local: None, tmp_path):
    storage = str(tmp_path / "runs")
    for workers, steps in ((2, 12), (1, 24), (2, 36)):
        result = own_loop.main(["--workers", str(workers), "--steps", str(steps), "--storage", storage])
        assert result.error is None and result.metrics["step"] == steps
    run_dir = tmp_path / "runs" / "own_loop"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 37))
    assert [m["world_size"] for m in metrics] == [2] * 12 + [1] * 12 + [2] * 12
    assert {m["global_batch_size"] for m in metrics if m["epoch"] == 0 and m["step"] < 19} == {32}
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
