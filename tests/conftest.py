"""Shared fixtures: one local Ray instance for all Ray tests of a session, tiny models and data."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

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
    (the loss curve is the same at every world size: the runs it is compared with train at 2 to 4). It writes one
    checkpoint, at its last step: a checkpoint every 5 unpaced steps cost ~0.47 s each (20 in all), each waiting
    for Ray Train's controller to register the one before (docs/recovery.md), and no test resumes this run."""
    from ray_helpers import demo, losses

    tmp = tmp_path_factory.mktemp("fixed")
    summary = demo(
        tmp,
        "fixed",
        "--nodes",
        "1",
        "--workers",
        "1",
        "--events",
        "none",
        "--steps",
        "100",
        "--sample-time",
        "0",
        "--checkpoint-every",
        "100",
    )
    assert summary["world_sizes"] == [1]
    return losses(summary)


# ---------------------------------------------------------------- two test processes, one of them for Ray

# A test that starts or reaches a Ray instance: a `ray` or `slow` mark, or one of these fixtures.
RAY_FIXTURES = {"ray_local", "no_ray_connection", "ray_head_env", "fixed_size_losses"}
RAY_TESTS_FILE = "raytrain_ray_tests"  # the key, in an xdist worker's `workerinput`, of the file described below


def _needs_ray(item: pytest.Item) -> bool:
    marked = item.get_closest_marker("ray") or item.get_closest_marker("slow")
    return bool(marked or RAY_FIXTURES & set(getattr(item, "fixturenames", ())))


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: `-m 'not xdist_group'` runs the tests that need no Ray
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that starts or reaches a Ray instance `xdist_group("ray")`; in a pytest-xdist worker, also
    write their node ids to the file `RayTestsInOneProcess` reads in the controlling process."""
    ray_tests = []
    for item in items:
        if _needs_ray(item):
            item.add_marker(pytest.mark.xdist_group("ray"))
            ray_tests.append(item.nodeid)
    path = getattr(config, "workerinput", {}).get(RAY_TESTS_FILE)
    if path:  # each worker collects the same tests: whichever writes last writes the same list
        partial = f"{path}.{os.getpid()}"
        with open(partial, "w") as f:
            json.dump(ray_tests, f)
        os.replace(partial, path)


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, schedule with `RayTestsInOneProcess` (pyproject's addopts: `-n 2 --dist loadgroup`)."""
    if config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(RayTestsInOneProcess(), "raytrain-ray-tests-in-one-process")


class RayTestsInOneProcess:
    """One test process runs every test that needs Ray, one after another, while the other runs the rest
    (single-process and gloo tests). Two Ray instances side by side on two cores disturbed each other
    (docs/architecture.md, "The test suite"); a Ray test beside a CPU-bound test only shares the cores.

    pytest-xdist's own `--dist loadgroup` sends each `xdist_group` to one process by appending "@group" to the
    node ids, which pytest 9.2 no longer lets a plugin change (pytest-xdist issue 1386): every test went its own
    way. So the workers write the Ray tests' node ids to a file (`pytest_collection_modifyitems` above) and this
    scheduler reads it once every worker has collected."""

    def __init__(self) -> None:
        import tempfile

        self.path = os.path.join(tempfile.gettempdir(), f"raytrain-ray-tests-{os.getpid()}.json")

    def pytest_configure_node(self, node: Any) -> None:
        """Tell each worker where to write the Ray tests' node ids."""
        node.workerinput[RAY_TESTS_FILE] = self.path

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        """For `--dist loadgroup`: xdist's scope scheduler, with every Ray test in one scope."""
        if config.getvalue("dist") != "loadgroup":
            return None
        from xdist.scheduler import LoadScopeScheduling

        if not hasattr(LoadScopeScheduling, "_split_scope"):  # the one method overridden below
            raise pytest.UsageError(
                "this pytest-xdist's LoadScopeScheduling has no _split_scope: tests/conftest.py cannot keep the Ray "
                "tests in one process; run with -n 0"
            )
        path = self.path

        class Scheduling(LoadScopeScheduling):  # type: ignore[misc]
            ray_tests: set[str] | None = None

            def _split_scope(self, nodeid: str) -> str:
                if nodeid.rfind("@") > nodeid.rfind("]"):  # an xdist that appends the group again
                    return nodeid.rsplit("@", 1)[-1]
                if self.ray_tests is None:  # called once every worker has collected, so the file is there
                    with open(path) as f:
                        self.ray_tests = set(json.load(f))
                return "ray" if nodeid in self.ray_tests else nodeid

        return Scheduling(config, log)

    def pytest_unconfigure(self) -> None:
        if os.path.exists(self.path):
            os.remove(self.path)


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
    path = os.environ.get("RAYTRAIN_TIER_TIMES")
    if path and not hasattr(session.config, "workerinput"):  # not an xdist worker
        with open(path, "w") as f:
            json.dump({tier: round(sum(times), 1) for tier, times in sorted(_TIMES.items())}, f)
