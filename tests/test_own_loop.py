"""Bring your own loop (`raytrain.attach`): examples/own_loop.py's `train_func` under a plain Ray Train
`TorchTrainer`, elastic on a cluster whose nodes go and come (W = 2 -> 1 -> 2 in one fit), against raytrain's own
loop (`ElasticTrainer`) on the same model, data, batch, LR rule and optimizer at a fixed W = 2: the same loss
curve, every sample once per epoch, and the user's own state (an EMA) carried through the restarts. Then the same
loop on a Ray dataset and on Parquet files."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import torch
from ray_helpers import ids_by_epoch, read_jsonl, wait_for

from raytrain.config import BatchConfig, CheckpointConfig, ClusterConfig, LoopConfig, LRConfig
from raytrain.session import ray_callbacks
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


CONFIG = {"global_batch": 32, "micro_batch": 8, "lr": 3e-3, "epochs": 20, "every": 10}
STEPS = 160  # 600 rows, 19 steps an epoch (the last of 24 samples): 8 epochs and a part


@pytest.fixture(scope="module")
def framework_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The same training through `ElasticTrainer` (raytrain's own loop) at a fixed W = 2, on the example's data as
    a Ray dataset whose ids are the map-style indices (so both order the same samples the same way)."""
    tmp_path = tmp_path_factory.mktemp("framework")
    data = own_loop.RegressionData()
    rows = [{"id": i, "x": data.x[i], "y": data.y[i]} for i in range(len(data))]
    if not ray.is_initialized():
        from raytrain.trainer import connect_ray

        connect_ray(4, "the reference run")
    trainer = ElasticTrainer(
        model_fn=own_loop.Net,
        loss_fn=per_sample_squared_error,
        optimizer_fn=own_loop.adamw,
        datasets={"train": ray.data.from_items(rows)},
        batch=BatchConfig(global_batch=32, micro_batch=8),
        lr=LRConfig(base_lr=3e-3, rule="sqrt", warmup_steps=5),
        loop=LoopConfig(epochs=20, max_steps=STEPS, id_column="id"),
        checkpoint=CheckpointConfig(storage_path=str(tmp_path), log_dir=str(tmp_path), run_name="framework"),
        cluster=ClusterConfig(min_workers=2, max_workers=2, max_failures=0),
        required_columns=("x", "y"),
    )
    return [m["loss"] for m in read_jsonl(trainer.fit().metrics_path)]


def paced_until_grown(config: dict[str, Any]) -> None:
    """The example's `train_func`, slowed by `pause_s` per step (a bigger model's compute) in the first worker group
    and while the world is shrunk to 1, and at full speed once a group of 2 resumes from a checkpoint: the events
    need time to land, the steps after the grow do not."""
    from ray import train

    grown = train.get_checkpoint() is not None and train.get_context().get_world_size() == 2
    own_loop.train_func({**config, "pause_s": 0.0 if grown else config["pause_s"]})


def own_loop_trainer(data: Any, run: str, storage: str, steps: int, workers: Any = 2, **scaling: Any) -> Any:
    """A plain Ray Train `TorchTrainer` over the example's `train_func` (on `data`; None: its map-style set); with
    `pause_s`, over `paced_until_grown`."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    pause = scaling.pop("pause_s", 0.0)
    return TorchTrainer(
        paced_until_grown if pause else own_loop.train_func,
        train_loop_config={**CONFIG, "steps": steps, "data": data, "pause_s": pause},
        scaling_config=ScalingConfig(num_workers=workers, **scaling),
        run_config=RunConfig(
            name=run,
            storage_path=storage,
            failure_config=FailureConfig(max_failures=3),
            callbacks=ray_callbacks(os.path.join(storage, run)),  # as the example's driver does
        ),
    )


@pytest.mark.parametrize("kind", ["ray_dataset", "parquet"])
def test_own_loop_takes_a_ray_dataset_and_parquet_files(
    framework_losses: list[float], ray_local: None, kind: str, tmp_path: Path
):
    """The same rows as a Ray dataset (ids = the map-style indices: the framework's order, so its curve) and as
    Parquet files (read in place in raytrain's windowed order: every sample once)."""
    data = own_loop.RegressionData()
    if kind == "ray_dataset":
        source: Any = ray.data.from_items([{"id": i, "x": data.x[i], "y": data.y[i]} for i in range(len(data))])
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq
        from ray.data.extensions import ArrowTensorArray

        table = pa.table({"id": np.arange(len(data)), "x": ArrowTensorArray.from_numpy(data.x), "y": data.y})
        for part, begin in enumerate(range(0, len(data), 200)):
            pq.write_table(table.slice(begin, 200), tmp_path / f"part-{part}.parquet", row_group_size=50)
        source = str(tmp_path)
    result = own_loop_trainer(source, kind, str(tmp_path / "runs"), 19).fit()  # epoch 0: 18 steps of 32, one of 24
    assert result.error is None and result.metrics["step"] == 19
    metrics = read_jsonl(tmp_path / "runs" / kind / "metrics.jsonl")
    assert sorted(ids_by_epoch(tmp_path / "runs" / kind / "samples.jsonl")[0]) == list(range(600))
    if kind == "ray_dataset":
        np.testing.assert_allclose([m["loss"] for m in metrics], framework_losses[:19], rtol=0, atol=1e-4)
    else:  # the run exports and loads by its directory alone, as ElasticTrainer's runs do (the record is rank 0's)
        from raytrain.model_export import export, load_model

        exported = export(str(tmp_path / "runs" / kind), str(tmp_path / "exported"))
        assert exported.step == 19 and exported.files == ["model.safetensors"]
        loaded = load_model(str(tmp_path / "runs" / kind), own_loop.Net)
        assert sum(p.numel() for p in loaded.parameters()) == exported.nbytes // 4


@pytest.mark.slow
def test_own_loop_elastic_2_1_2_trains_the_frameworks_curve_with_every_sample_once(
    framework_losses: list[float], no_ray_connection: None, tmp_path: Path
):
    """A node of two is removed while the example's loop trains at W = 2 (Ray Train restarts it at 1 from the last
    checkpoint), then a node is added (Ray Train grows it back to 2): one `fit()` of a plain `TorchTrainer`."""

    from raytrain.cli.demo import WORKER_SLOT, FakeCluster

    cluster = FakeCluster(nodes=2, head_cpus=2, slots=1)
    run_dir = tmp_path / "elastic"
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        trainer = own_loop_trainer(
            None,
            "elastic",
            str(tmp_path),
            STEPS,
            workers=(1, 2),
            resources_per_worker={"CPU": 1, WORKER_SLOT: 1},
            elastic_resize_monitor_interval_s=1.0,
            pause_s=0.3,
        )
        results: list[Any] = []
        fit = threading.Thread(target=lambda: results.append(trainer.fit()), daemon=True)
        fit.start()

        def last_line_at(world: int, step: int) -> bool:
            lines = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
            return bool(lines) and lines[-1]["world_size"] == world and lines[-1]["step"] >= step

        def start_at(world: int) -> list[dict[str, Any]]:
            events = read_jsonl(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() else []
            return [e for e in events if e["world_size"] == world]

        wait_for("8 steps at W = 2", lambda: last_line_at(2, 8), timeout_s=240)
        cluster.remove_node()
        wait_for("a restart at W = 1", lambda: start_at(1), timeout_s=180)
        # past a checkpoint at W = 1 (every 10 steps): the grow restarts from the latest one, so its lines stay
        wait_for("a checkpoint at W = 1", lambda: last_line_at(1, start_at(1)[0]["step"] + 11), timeout_s=120)
        cluster.add_node()
        fit.join(timeout=400)
        assert not fit.is_alive(), "the elastic fit did not end in 400 s"
        assert results and results[0].error is None and results[0].metrics["step"] == STEPS

        # The EMA (the user's own state) went through both restarts: it ends where a run that never stopped ends it.
        straight = own_loop_trainer(None, "straight", str(tmp_path), STEPS, resources_per_worker={WORKER_SLOT: 1})
        straight_metrics = straight.fit().metrics
    finally:
        ray.shutdown()
        cluster.shutdown()

    worlds = [e["world_size"] for e in read_jsonl(run_dir / "events.jsonl")]
    assert worlds[0] == 2 and 1 in worlds and worlds[-1] == 2, worlds
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))  # retrained steps replace their lines
    assert {m["world_size"] for m in metrics} == {1, 2}
    assert all(m["global_batch_size"] == 32 for m in metrics if m["step"] % 19)  # an epoch's last step has 24
    agreed = [m for m in metrics if "data_wait_max_s" in m]  # the steps where the ranks agreed (about 1 a second)
    assert agreed and all(m["data_wait_max_s"] >= m["data_wait_s"] >= 0 for m in agreed)  # the slowest rank's
    np.testing.assert_allclose([m["loss"] for m in metrics], framework_losses, rtol=0, atol=1e-4)
    by_epoch = ids_by_epoch(run_dir / "samples.jsonl")
    for epoch in range(8):
        assert sorted(by_epoch[epoch]) == list(range(600)), f"epoch {epoch}: not every sample once"
    assert by_epoch[1] != by_epoch[0]  # reshuffled
    assert straight_metrics["ema_norm"] == pytest.approx(metrics[-1]["ema_norm"], abs=1e-6)


@pytest.mark.parametrize("driver", ["connect_ray", "ray.init"])
def test_the_example_shows_each_raytrain_line_once_under_either_driver(tmp_path: Path, driver: str) -> None:
    """examples/own_loop.py run as a script, as is (`connect_ray(..., quiet=False)`) and under a plain `ray.init()`
    of the user's (the example's `connect_ray` is then a no-op): what the workers print reaches the script's
    terminal, each raytrain line once (Ray Train patches print() in its workers so that, under a plain
    `ray.init()`, every print appeared twice), the resize line naming the peak LR the warmup climbs to."""
    import subprocess

    started = "import ray; ray.init(num_cpus=3, include_dashboard=False)\n" if driver == "ray.init" else ""
    code = (
        f"{started}import runpy, sys\n"
        f"sys.argv = ['own_loop.py', '--steps', '4', '--storage', {str(tmp_path)!r}]\n"
        f"runpy.run_path({str(REPO / 'examples' / 'own_loop.py')!r}, run_name='__main__')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYTRAIN_VERBOSE")}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    shown = [
        line.split("[raytrain] ", 1)[1] for line in (done.stdout + done.stderr).splitlines() if "[raytrain] " in line
    ]
    assert shown and len(shown) == len(set(shown)), shown
    assert any(line.startswith("world 2: accumulation 2") and "peak lr 3.0e-03" in line for line in shown), shown
    assert any(line.startswith("done: steps 4") for line in shown), shown
    assert "own_loop: step 4, loss " in done.stdout
