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
