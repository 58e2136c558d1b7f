"""Shared fixtures: one local Ray instance for all Ray tests of a session, tiny models and data."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


_LOCAL: dict[str, str] = {}  # the GCS address of the shared local instance this process started


@pytest.fixture
def ray_local() -> Iterator[None]:
    """A local Ray instance with 4 logical CPUs (room for 3 workers and Ray Data on a 2-core machine), shared by
    the Ray tests of a session, without a dashboard (`raytrain.trainer.mute_state_api` says why that needs care).
    Started again when a test left it (one that connects to a cluster of its own must `ray.shutdown()` first, see
    `no_ray_connection`); Ray's exit hook shuts it down with the session."""
    import ray

    from raytrain.trainer import apply_ray_env_defaults, mute_state_api

    if ray.is_initialized() and ray.get_runtime_context().gcs_address == _LOCAL.get("address"):
        yield
        return
    if ray.is_initialized():
        ray.shutdown()
    apply_ray_env_defaults()
    restore = mute_state_api()  # for the instance's processes only: what a test starts later decides its own
    try:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=True)
    finally:
        restore()
    _LOCAL["address"] = ray.get_runtime_context().gcs_address
    yield


@pytest.fixture
def no_ray_connection() -> Iterator[None]:
    """For a test that connects this process to a cluster of its own: leave the shared local instance first
    (one process holds one Ray connection), and leave the test's cluster afterwards."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="session")
def ray_head_env() -> Iterator[dict[str, str]]:
    """The environment of a CLI run on a running `ray start` head shared by the session (RAY_ADDRESS): a run that
    checks and stops before training (a dry run, a refused start) then connects in a second instead of starting
    a local instance of its own. The local start is tested by the runs that train."""
    from ray_helpers import ray_head

    with ray_head(num_cpus=8) as running:
        yield {"RAY_ADDRESS": running["address"], "RAY_AUTH_MODE": "disabled"}


@pytest.fixture(scope="session")
def fixed_size_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The reference the elastic and fault tests compare with: one worker on one fake node, no event, 100 steps
    (the loss curve is the same at every world size: the runs it is compared with train at 2 to 4)."""
    from ray_helpers import demo, losses

    tmp = tmp_path_factory.mktemp("fixed")
    summary = demo(
        tmp, "fixed", "--nodes", "1", "--workers", "1", "--events", "none", "--steps", "100", "--sample-time", "0"
    )
    assert summary["world_sizes"] == [1]
    return losses(summary)


# ---------------------------------------------------------------- per-tier times (`.ci/run` prints them)

TIERS = ("slow", "ray")  # a test's tier: the first of these markers it has, else "gloo" (multi-process) or "pure"
_TIMES: dict[str, list[float]] = {}


def _tier(report: pytest.TestReport) -> str:
    for marker in TIERS:
        if marker in report.keywords:
            return marker
    return "gloo" if "run_world" in report.keywords or report.nodeid.split("::")[0] in _GLOO_FILES else "pure"


_GLOO_FILES = {
    "tests/test_equivalence.py",
    "tests/test_parallel_equivalence.py",
    "tests/test_checkpoint_reshard.py",
    "tests/test_init_contract.py",
    "tests/test_pretrained.py",
    "tests/test_collectives.py",
}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add each test's time (setup, call and teardown) to its tier's total."""
    _TIMES.setdefault(_tier(report), []).append(report.duration)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """With RAYTRAIN_TIER_TIMES=PATH, write {tier: seconds summed over its tests} there (in the controlling process
    when tests run in parallel: it receives every worker's reports)."""
    import json

    path = os.environ.get("RAYTRAIN_TIER_TIMES")
    if path and not hasattr(session.config, "workerinput"):  # not an xdist worker
        with open(path, "w") as f:
            json.dump({tier: round(sum(times), 1) for tier, times in sorted(_TIMES.items())}, f)
