"""The local autoscaling cluster's pure parts: cluster.yaml's node types scaled down, the autoscaling config the
head runs, bad files refused by name, and the --autoscale summary computed from a run's records (no Ray)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from raytrain.cli.demo import DemoOptions, autoscale_summary
from raytrain.cli.local_autoscaler import (
    HEAD_TYPE,
    autoscaling_config,
    load_cluster_yaml,
    local_node_types,
    packaged_cluster_yaml,
)
from raytrain.errors import ConfigError

REPO_CLUSTER_YAML = Path(__file__).resolve().parents[1] / "cluster.yaml"


def test_the_packaged_cluster_yaml_is_the_repository_file() -> None:
    assert Path(packaged_cluster_yaml()).read_text() == REPO_CLUSTER_YAML.read_text()


def test_cluster_yaml_node_types_scaled_to_local_nodes() -> None:
    config = yaml.safe_load(REPO_CLUSTER_YAML.read_text())
    local = local_node_types(config, cpus_per_node=1)
    # The CPU types are kept with their worker_slot, limits and priority; the GPU types are left out (no GPU here).
    assert set(local.worker_types) == {"cpu-spot", "cpu-ondemand"}
    for name, spec in local.worker_types.items():
        original = config["available_node_types"][name]
        assert spec["resources"]["worker_slot"] == original["resources"]["worker_slot"]
        assert spec["resources"]["CPU"] == 1
        assert (spec["min_workers"], spec["max_workers"]) == (original["min_workers"], original["max_workers"])
        assert spec["priority"] == original["priority"]
    assert sorted(local.notes) == [
        "node type 'gpu-ondemand' left out: it has GPUs and this machine has none",
        "node type 'gpu-spot' left out: it has GPUs and this machine has none",
    ]
    assert "worker_slot" not in local.head_resources  # no training worker may land on the head
    with_gpus = local_node_types(config, gpus_available=True)
    assert with_gpus.worker_types["gpu-spot"]["resources"]["GPU"] == 1


def test_autoscaling_config_keeps_the_files_cluster_settings() -> None:
    config = yaml.safe_load(REPO_CLUSTER_YAML.read_text())
    local = local_node_types(config)
    generated = autoscaling_config(
        config, local, gcs_address="127.0.0.1:1234", control_dir="/tmp/x", idle_timeout_minutes=0.25
    )
    assert generated["max_workers"] == config["max_workers"]
    assert generated["upscaling_speed"] == config["upscaling_speed"]
    assert generated["idle_timeout_minutes"] == 0.25
    assert generated["provider"]["module"] == "raytrain.cli.local_autoscaler.ReclaimableFakeProvider"
    assert generated["provider"]["gcs_address"] == "127.0.0.1:1234"  # never the default port 6379
    assert generated["head_node_type"] == HEAD_TYPE
    assert generated["available_node_types"][HEAD_TYPE]["max_workers"] == 0


def test_ray_accepts_the_generated_config() -> None:
    from ray.autoscaler._private.util import validate_config

    config = yaml.safe_load(REPO_CLUSTER_YAML.read_text())
    generated = autoscaling_config(
        config, local_node_types(config), gcs_address="127.0.0.1:1", control_dir="/tmp/x", idle_timeout_minutes=1
    )
    validate_config(generated)  # Ray's schema (ray-schema.json): raises on an invalid field


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[1, 2]", "must be a mapping"),
        ("head_node_type: head\navailable_node_types: {}\n", "available_node_types with the head_node_type"),
        (
            "head_node_type: h\navailable_node_types:\n  h: {resources: {CPU: 1}}\n"
            "  g: {resources: {CPU: 1, GPU: 1}, max_workers: 2}\n",
            "no worker node type this machine can run",
        ),
        ("a: [unclosed\n", "cannot be read as YAML"),
    ],
)
def test_a_bad_cluster_yaml_is_refused_by_name(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message) as err:
        load_cluster_yaml(str(path))
    assert str(path) in str(err.value)


def test_demo_options_refuse_events_that_do_not_fit_the_cluster() -> None:
    with pytest.raises(ConfigError, match="with --autoscale the autoscaler adds nodes"):
        DemoOptions(autoscale=True, events="remove@5")
    with pytest.raises(ConfigError, match="reclaim needs --autoscale"):
        DemoOptions(events="reclaim@5")
    with pytest.raises(ConfigError, match="cannot be read"):
        DemoOptions(autoscale=True, events="reclaim@5", cluster_yaml="/nonexistent/cluster.yaml")
    with pytest.raises(ConfigError, match="idle_timeout must be > 0 seconds, got 0"):
        DemoOptions(autoscale=True, events="reclaim@5", idle_timeout_s=0)
    DemoOptions(autoscale=True, events="reclaim@5,kill@9,drain@12")


def _metric(t: float, world: int) -> dict[str, Any]:
    return {"time": t, "world_size": world}


def test_autoscale_summary_times_growth_and_replacement_from_the_worker_groups() -> None:
    starts = [{"time": 5.0, "world_size": 1}, {"time": 12.0, "world_size": 3}, {"time": 40.0, "world_size": 3}]
    metrics = [_metric(6, 1), _metric(13, 3), _metric(14, 3), _metric(31, 3), _metric(41, 3)]
    history = [
        {"time": 1.0, "node": "n1", "type": "cpu-spot", "change": "up"},
        {"time": 2.0, "node": "n2", "type": "cpu-spot", "change": "up"},
        {"time": 33.0, "node": "n4", "type": "cpu-ondemand", "change": "up"},
    ]
    reclaimed = [{"time": 30.0, "node": "n2", "type": "cpu-spot"}]
    summary = autoscale_summary(metrics, starts, history, reclaimed, 0.0, 3, 9.5)
    assert summary["grow_s"] == 13.0  # the first step at 3 workers
    # Not the old group's step at t=31 (world 3 still, before it noticed): the first step of a group started after.
    assert summary["replace_s"] == [11.0]
    assert summary["launched_by_type"] == {"cpu-spot": 2, "cpu-ondemand": 1}
    assert summary["scale_down_s"] == 9.5
    never = autoscale_summary(metrics[:2], starts[:2], history, reclaimed, 0.0, 3, None)
    assert never["replace_s"] == [None] and never["scale_down_s"] is None


def test_autoscale_refuses_an_existing_cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from raytrain.cli.demo import run_demo

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with pytest.raises(ConfigError, match="--autoscale starts a cluster of its own"):
        run_demo(DemoOptions(autoscale=True, events="reclaim@5", storage=str(tmp_path)))
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_node_counts_follow_the_autoscalers_history() -> None:
    from raytrain.cli.demo import node_counts

    history = [
        {"time": 12.0, "change": "down"},
        {"time": 10.0, "change": "up"},
        {"time": 11.0, "change": "up"},
        {"time": 13.0, "change": "up"},
    ]
    assert node_counts(history, 10.0) == ([0.0, 1.0, 2.0, 3.0], [1, 2, 1, 2])


def test_the_ray_autoscaler_internals_the_local_cluster_relies_on() -> None:
    # A Ray upgrade that renames one of these fails here by name, in a second, instead of inside the head's
    # autoscaler process (where the provider runs and its errors only reach Ray's monitor log).
    import inspect

    from ray._private.node import Node
    from ray.autoscaler._private.fake_multi_node import node_provider
    from ray.autoscaler._private.providers import _NODE_PROVIDERS

    provider = node_provider.FakeMultiNodeProvider
    create = inspect.signature(provider._create_node_with_resources_and_labels).parameters
    assert list(create) == ["self", "node_config", "tags", "count", "resources", "labels"]
    for name in ("non_terminated_nodes", "terminate_node", "create_node_with_resources_and_labels"):
        assert callable(getattr(provider, name)), name
    assert "RAY_FAKE_CLUSTER" in inspect.getsource(provider.__init__)  # the head must run with it set
    assert "self._nodes" in inspect.getsource(provider.__init__) and "self.lock" in inspect.getsource(provider.__init__)
    assert node_provider.FAKE_HEAD_NODE_ID.startswith("ffff")  # `ray_hooks.short_node_id` relies on the f's
    assert list(inspect.signature(Node.kill_all_processes).parameters)[1:3] == ["check_alive", "allow_graceful"]
    assert "external" in _NODE_PROVIDERS  # the provider is loaded as provider.type "external", by module path
