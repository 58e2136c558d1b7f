"""Shared fixtures: one local Ray instance for all Ray tests of a session, tiny models and data."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session")
def ray_local() -> Iterator[None]:
    """A local Ray instance with 4 logical CPUs (room for 3 workers and Ray Data on a 2-core machine)."""
    import ray

    from raytrain.trainer import apply_ray_env_defaults

    if ray.is_initialized():
        ray.shutdown()
    apply_ray_env_defaults()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=True)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def fixed_size_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The reference the elastic and fault tests compare with: 3 workers on 3 fake nodes, no event, 100 steps."""
    from ray_helpers import demo, losses

    tmp = tmp_path_factory.mktemp("fixed")
    summary = demo(
        tmp, "fixed", "--nodes", "3", "--workers", "3", "--events", "none", "--steps", "100", "--sample-time", "0"
    )
    assert summary["world_sizes"] == [3]
    return losses(summary)
