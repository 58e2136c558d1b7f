"""The driver half of raytrain: validate everything, prepare the data, and hand the loop to Ray Train.

    trainer = ElasticTrainer(model_fn=..., loss_fn=..., optimizer_fn=..., datasets={"train": ds},
                             batch=BatchConfig(global_batch=96, micro_batch=32), lr=LRConfig(base_lr=3e-3), ...)
    result = trainer.fit()

Ray Train V2 restarts the worker group on every resize or failure; the worker half
(`raytrain.worker_loop.train_loop_per_worker`) restores from the latest checkpoint each time.
"""

from __future__ import annotations

import math
import os
import posixpath
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from raytrain.config import (
    BatchConfig,
    CheckpointConfig,
    ClusterConfig,
    LoopConfig,
    LRConfig,
    ParallelConfig,
    TrainSpec,
)
from raytrain.console import RunLogTail, append_line, counted, init_ray, interrupt_line_left_to_caller, is_quiet, say
from raytrain.data.materialized import describe_run_length
from raytrain.data.parquet import ParquetIndex, ParquetSource, as_source, describe_reads
from raytrain.errors import ConfigError, UserCodeError
from raytrain.rank0 import EVENTS_FILE, METRICS_FILE, SAMPLES_FILE, read_jsonl
from raytrain.run_lock import run_lock
from raytrain.storage import RunStorage
from raytrain.trackers import check_trackers

if TYPE_CHECKING:
    from raytrain.worker_loop import WorkerJob

# Quiet, fast defaults for Ray Train's controller and workers; a value the user already set wins.
RAY_ENV_DEFAULTS = {
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",  # otherwise every print in a worker appears twice
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",  # report() blocks about this long; failures are seen this fast
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "15",  # a start on a stale view of the cluster fails in 15 s, not 60
    "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1",  # a drain notice reaches the workers within a second, not five
}


@dataclass(frozen=True)
class FitResult:
    """What `ElasticTrainer.fit` returns: the last reported metrics, the latest checkpoint and where files are."""

    metrics: dict[str, Any] | None
    checkpoint: Any  # ray.train.Checkpoint | None
    run_dir: str
    metrics_path: str
    samples_path: str | None
    events_path: str
    storage_uri: str = ""  # where the run's checkpoints are: a directory, or a URI such as s3://bucket/runs/name


def check_storage_writable(path: str, field: str = "storage_path") -> None:
    """Raise `ConfigError` naming `field` and `path` unless it is (or can be created as) a writable directory.

    Creates nothing: the nearest existing ancestor must be a writable directory.
    """
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        what = "is not a directory" if not os.path.isdir(probe) else "is not writable"
        raise ConfigError(f"{field} {path!r} is not usable: {probe!r} {what}")


def check_storage(spec: TrainSpec, filesystem: Any = None) -> tuple[str, RunStorage]:
    """Check, without starting any worker, that the run can write where it is told to; return the run's local
    directory (`CheckpointConfig.run_dir`) and its checkpoint storage. Raises `ConfigError` naming the field and
    path for a local directory that is a file or not writable, or for object storage that cannot be opened or
    written (`raytrain.storage`)."""
    from raytrain.storage import check_writable, run_storage

    run_dir = spec.checkpoint.run_dir()
    check_storage_writable(run_dir, "storage_path" if spec.checkpoint.is_local else "log_dir")
    storage = run_storage(spec.checkpoint, filesystem)
    if not storage.is_local:
        check_writable(storage)
    return run_dir, storage


def check_resumable(storage: RunStorage) -> None:
    """`ConfigError` before anything starts when the run's checkpoint directory (local or object storage) holds
    checkpoints and none is intact (every one has a file missing or cut short): resuming would be impossible,
    starting over would hide the data loss. A committed checkpoint whose directory is gone gets an empty stand-in
    (`replace_lost`, said once), so that Ray Train starts and the run resumes from the newest intact one."""
    from raytrain.checkpoint_files import checkpoint_dirs, replace_lost, verify

    for path in replace_lost(storage.path, storage.fs):
        say(f"WARNING: checkpoint {posixpath.basename(path)} is gone from {storage.uri}; resuming from an older one")
    found = checkpoint_dirs(storage.path, storage.fs)
    reasons = [(path, verify(path, storage.fs)) for _, path in found]
    if found and all(reason for _, reason in reasons):
        damaged = "; ".join(f"{posixpath.basename(path)}: {reason}" for path, reason in reasons)
        raise ConfigError(
            f"no intact checkpoint in {storage.uri} to resume from ({damaged}); move the run directory away to "
            "start over"
        )


def describe_interrupt(storage: RunStorage) -> str:
    """Where a Ctrl-C left the run: the checkpoint `fit()` with the same run_name resumes from (the newest of either
    recovery mode, `raytrain.checkpoint_files.newest_checkpoint`) and what that `fit()` does, in one line."""
    try:
        found = storage.newest_checkpoint()
    except OSError as err:
        return f"the latest checkpoint in {storage.uri} could not be read ({err})"
    if found is None:
        return f"no checkpoint was written in {storage.uri} yet; fit() again (the same run_name) starts from step 0"
    return f"the latest checkpoint is step {found[0]}, {found[1]}; fit() again (the same run_name) resumes from it"


def _say_interrupted(storage: RunStorage) -> None:
    """`fit()`'s one line on a Ctrl-C (either recovery mode), unless the CLI says its own, with the command that
    resumes."""
    if not interrupt_line_left_to_caller():
        say(f"interrupted: {describe_interrupt(storage)}")


def cross_mode_resume(storage: RunStorage, run_dir: str, recovery: str) -> str | None:
    """Where a run resumes when the other recovery mode wrote its newest checkpoint (one format,
    `raytrain.checkpoint`, so either mode resumes from either's at any world size): said once. In restart mode
    that is the newest live checkpoint when it is newer than Ray Train's latest committed one (returned: the
    workers load it, `WorkerJob.resume_from`); live mode's driver finds the restart path's itself
    (`raytrain.checkpoint_files.newest_checkpoint`). None when the run resumes from its own mode's, or starts."""
    from raytrain.checkpoint_files import LIVE_CHECKPOINT_PREFIX

    newest = storage.newest_checkpoint()  # the newest intact one
    if newest is None:
        return None
    live = posixpath.basename(newest[1]).startswith(LIVE_CHECKPOINT_PREFIX)
    if live == (recovery == "live"):
        return None
    was = "live" if live else "restart"
    say(
        f'resuming from checkpoint step {newest[0]}, written by recovery="{was}" ({posixpath.basename(newest[1])}): '
        "both modes write one format"
    )
    return newest[1] if live else None


def check_ray_address() -> None:
    """When RAY_ADDRESS names a cluster, check within seconds that it answers (`ray.init` would retry for
    minutes); `ConfigError` naming the address otherwise. No-op without RAY_ADDRESS."""
    address = os.environ.get("RAY_ADDRESS")
    if address:
        _check_reachable(address)
        _check_token(address)


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Raise `ConfigError` when a "host:port" Ray address does not accept a TCP connection within `timeout_s`.

    `ray.init` itself retries an unreachable address for minutes; this turns that into one clear line.
    """
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # "auto", "local" and other forms are left to Ray
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ConfigError(f"cannot reach the Ray cluster at RAY_ADDRESS={address!r}: {err}") from None


def _check_token(address: str) -> None:
    """With token authentication off on this side (RAY_AUTH_MODE unset or "disabled"), one call to the GCS at a
    "host:port" `address` says at once whether the cluster demands a token: `ConfigError` saying what to set if
    it does (`ray.init` retries for ~25 s, then fails with a traceback). In token mode `ray.init` checks for a
    token itself, at once; any other failure is left to `ray.init` to report."""
    if os.environ.get("RAY_AUTH_MODE", "disabled") != "disabled" or not address.rpartition(":")[2].isdigit():
        return
    if address.startswith("ray://"):
        return
    import ray.exceptions
    from ray._raylet import GcsClient  # type: ignore[attr-defined]

    saved = os.dup(2)  # Ray's C++ client logs the refusal to stderr too: the ConfigError says it in one line
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            GcsClient(address=address)
    except ray.exceptions.AuthenticationError as err:
        raise ConfigError(_refused_message(address, err)) from None
    except Exception:
        return
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _refused_message(address: str, err: BaseException) -> str:
    import re

    found = re.search(r"InvalidAuthToken: [^.]*|Token authentication is enabled but [^.]*", str(err))
    reason = found.group(0) if found else str(err).splitlines()[0]
    refused = f"the Ray cluster at RAY_ADDRESS={address!r} refused this process: it uses token authentication"
    where = "RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token)"
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode == "token":
        return f"{refused} and the token here is missing or not the cluster's; set {where} to the cluster's token " + (
            f"({reason})"
        )
    off = f"{refused} and this process does not (" + (f"RAY_AUTH_MODE is {mode!r}" if mode else "RAY_AUTH_MODE unset")
    if _has_token():  # the token is here: the mode is what is missing
        return f"{off}): set RAY_AUTH_MODE=token ({reason})"
    return f"{off}): set RAY_AUTH_MODE=token and {where} to the cluster's token ({reason})"


def _has_token() -> bool:
    """Whether a Ray authentication token is available to this process (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
    ~/.ray/auth_token), whatever RAY_AUTH_MODE says; False where this Ray cannot tell."""
    try:
        from ray._private.authentication.authentication_token_setup import AuthenticationTokenLoader

        return bool(AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True))
    except (ImportError, AttributeError, TypeError):
        return False


def _authentication_error(err: BaseException) -> BaseException | None:
    """The exception in `err` or its causes that says the cluster refused this process's token (Ray's
    `AuthenticationError`, or the `RuntimeError` that `ray.init` raises after its retries, quoting it), else
    None."""
    import ray.exceptions

    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, ray.exceptions.AuthenticationError) or "InvalidAuthToken" in str(seen):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def local_cpus(spec: TrainSpec) -> int:
    """The logical CPUs a local Ray instance needs for `spec`: every worker's CPUs at `max_workers`, and one more
    for Ray Data and the controller (on a small machine several workers then share a core, as they would share a
    node's)."""
    return math.ceil(spec.cluster.max_workers * spec.cluster.resources_per_worker.get("CPU", 1.0)) + 1


def local_cpus_reason(spec: TrainSpec, cores: int | None = None) -> str:
    """What `local_cpus(spec)` makes room for, as `connect_ray`'s one line says it: "2 workers and Ray Data"; with
    more workers than this machine's `cores` (default: `os.cpu_count()`), that they take turns on them."""
    workers = spec.cluster.max_workers
    cores = cores or os.cpu_count() or 1
    said = f"{counted(workers, 'worker')} and Ray Data"
    if workers > cores:
        said += (
            f"; {workers} workers take turns on {counted(cores, 'core')}: slower than {counted(cores, 'worker')} "
            "would be, the same training"
        )
    return said


def connect_ray(local_cpus: int = 1, reason: str = "", dashboard: bool = True, quiet: bool = True) -> None:
    """Connect to RAY_ADDRESS's cluster (as under `ray job submit`), or start a local instance with at least
    `local_cpus` logical CPUs (`reason` says why, in the one line that reports it); never join another process's
    cluster found in /tmp/ray. No-op when connected. `dashboard=False` (a dry run: Ray Data only, no training)
    starts a local instance without the dashboard and its state API, ~4 s sooner.

    Sets `RAY_ENV_DEFAULTS` first, so Ray Train's controller and workers get them. Quiet unless
    `RAYTRAIN_VERBOSE=1`: Ray's worker output stays in Ray's log files (`raytrain.console`), and `ElasticTrainer.fit`
    prints raytrain's lines from the run's log. `quiet=False` forwards the workers' output to this process as
    `ray.init()` does, for a `TorchTrainer` script of your own (`raytrain.attach`): its prints and raytrain's rank-0
    lines, prefixed by Ray with the worker's name; Ray's own loggers stay at WARNING. A local instance gets
    its dashboard on 127.0.0.1 only, at a port of its own that every Ray process of the instance is told
    (`own_state_api`), so several runs on one machine never mistake each other's clusters.
    """
    import ray

    apply_ray_env_defaults()
    if ray.is_initialized():
        return
    forward: dict[str, Any] = {} if quiet else {"log_to_driver": True}
    address = os.environ.get("RAY_ADDRESS")
    if address:
        check_ray_address()
        try:
            init_ray(address=address, **forward)
        except (ConnectionError, ray.exceptions.AuthenticationError) as err:
            refused = _authentication_error(err)
            if refused is None:
                raise
            raise ConfigError(_refused_message(address, refused)) from None
    else:
        explicit_token_mode()
        cpus = max(os.cpu_count() or 1, local_cpus)
        where = {"dashboard_host": "127.0.0.1", "dashboard_port": own_state_api()} if dashboard else {}
        init_ray(address="local", num_cpus=cpus, include_dashboard=dashboard, **where, **forward)
        say(
            f"started a local Ray instance with {cpus} logical CPUs on {os.cpu_count()} cores"
            + (f" ({reason})" if reason else "")
        )


def explicit_token_mode() -> None:
    """Before a local instance starts: when a Ray authentication token exists and RAY_AUTH_MODE is unset, Ray turns
    token authentication on for the new cluster and warns that it did, on every run; say "token" explicitly (the
    same behaviour, no warning). Without a token, Ray's warning that the cluster is unauthenticated stays."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    try:
        from ray._raylet import Config  # type: ignore[attr-defined]  # not in its stub; Ray uses it the same way
    except (ImportError, AttributeError):  # another Ray version: leave Ray's own behaviour
        return
    if _has_token():
        os.environ["RAY_AUTH_MODE"] = "token"
        Config.initialize("")  # this process's cached Ray config reads the mode again (as Ray does when it sets it)


def started_here() -> bool:
    """Whether this process started the Ray instance it is connected to (then no autoscaler adds nodes to it)."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    return bool(ray.is_initialized() and node is not None and getattr(node, "head", False))


def check_capacity(spec: TrainSpec) -> str | None:
    """Before any worker starts: can this cluster ever hold `min_workers` workers? Each worker is one bundle of
    `resources_per_worker` (and a GPU with `use_gpu`) on one node (`raytrain.capacity.workers_that_fit`, from the
    nodes' total resources). On an instance this process started (no autoscaler can add nodes) too few is a
    `ConfigError` naming what is asked and what the nodes have; on a cluster, the line saying what the run waits
    for is returned (None when there is room)."""
    import ray

    from raytrain.capacity import describe_nodes, describe_request, workers_that_fit

    cluster = spec.cluster
    bundle = {"CPU": 1.0, **cluster.resources_per_worker}
    if cluster.use_gpu:
        bundle.setdefault("GPU", 1.0)
    nodes = [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]
    room = workers_that_fit(nodes, bundle)
    if room >= cluster.min_workers:
        return None
    asked, have = describe_request(cluster.min_workers, bundle), describe_nodes(nodes, bundle)
    if started_here():
        # a resource no node has enough of for one worker (a GPU on a CPU machine): more CPUs would not help
        missing = [r for r, need in bundle.items() if r != "CPU" and not any(n.get(r, 0.0) >= need for n in nodes)]
        amounts = ", ".join(f"{r} {bundle[r]:g}" for r in missing)
        if missing == ["GPU"] and cluster.use_gpu and "GPU" not in cluster.resources_per_worker:
            fix = f"no node has {amounts} for one worker: set use_gpu=False (`use_gpu = false` in a job file)"
        elif missing:
            fix = (
                f"no node has {amounts} for one worker: start Ray with them (ray.init(num_gpus=..., "
                "resources=...)) or ask for less in resources_per_worker (and use_gpu)"
            )
        else:
            fix = (
                f"let fit start Ray (it declares {local_cpus(spec)} logical CPUs for this run), or call "
                f"connect_ray({local_cpus(spec)}) before building Ray datasets, or lower min_workers"
            )
        raise ConfigError(
            f"min_workers={cluster.min_workers} needs {asked}, and the local Ray instance holds {room} ({have}); {fix}"
        )
    return f"waiting for {asked}: the cluster holds {room} now ({have}); an autoscaler may add nodes"


def own_state_api(port: int | None = None) -> int:
    """Point Ray's state API, in this process and every Ray process it starts, at the dashboard of the local
    instance about to start (127.0.0.1:`port`, a free port by default); return the port.

    Why: Ray Train's PlacementGroupCleaner asks the state API whether the run's controller is alive, and without
    `RAY_API_SERVER_ADDRESS` the state API finds "the" cluster through Ray's current-cluster file, i.e. the most
    recently started instance on the machine. With a second raytrain run (or any Ray) started meanwhile, it asks
    the wrong cluster, hears "no such actor" and removes the live run's placement group: an unplanned restart.
    A value the user set is kept.
    """
    if port is None:
        from raytrain.ports import free_port

        port = free_port()
    current = os.environ.get("RAY_API_SERVER_ADDRESS")
    if current is None or current == _OWN_STATE_API.get("value"):  # not set, or set by raytrain for a former instance
        _OWN_STATE_API["value"] = os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
    return port


_OWN_STATE_API: dict[str, str] = {}  # the RAY_API_SERVER_ADDRESS raytrain set in this process, if any

STATE_API_NOWHERE = "http://127.0.0.1:1"  # nothing listens on port 1: a state API call is refused at once


def mute_state_api() -> Callable[[], None]:
    """Before starting a Ray instance without a dashboard that this process owns and that ends with it (the demo's
    fake-node cluster, the local autoscaler's, a benchmark's): point Ray's state API, in this process and every
    Ray process it starts, at an address where nothing listens. A value the user set is kept.

    Why: Ray Train's PlacementGroupCleaner asks the state API every second whether the run's controller is alive,
    to remove the run's placement group should the controller die. Unpointed, on an instance without a dashboard,
    each question waits out a 10 s timeout, and stopping the cleaner at the end of every `fit()` then waits 12 s
    for it (measured: 12.8-13.3 s from the last step to `fit()`'s return, 1.1-2.0 s when refused at once); with
    another instance's dashboard up, it may hear "no such actor" and remove this run's placement group. Refused,
    the cleaner logs that it could not ask and carries on; it never removes a placement group, which the instance
    does not outlive anyway.

    Returns the function that puts RAY_API_SERVER_ADDRESS back as it was: call it when the instance stops (a node
    started later must get the setting too), and it never reaches what this process runs afterwards (the `ray`
    CLI and job SDK talk to the address it names)."""
    before = os.environ.get("RAY_API_SERVER_ADDRESS")
    os.environ.setdefault("RAY_API_SERVER_ADDRESS", STATE_API_NOWHERE)

    def restore() -> None:
        if before is None:
            os.environ.pop("RAY_API_SERVER_ADDRESS", None)
        else:
            os.environ["RAY_API_SERVER_ADDRESS"] = before

    return restore


def worker_env() -> dict[str, str]:
    """The environment variables every training worker gets: Ray Train's settings (`RAY_ENV_DEFAULTS`) and, when
    set on the driver, raytrain's own (fault injection for tests, verbosity)."""
    env = {key: os.environ[key] for key in RAY_ENV_DEFAULTS}
    env.update({key: os.environ[key] for key in ("RAYTRAIN_FAULTS", "RAYTRAIN_VERBOSE") if key in os.environ})
    return env


def apply_ray_env_defaults() -> None:
    """Set `RAY_ENV_DEFAULTS` in this process (before Ray starts) unless already set."""
    for key, value in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


class ElasticTrainer:
    """Trains `model_fn()` with a fixed global batch on however many Ray Train workers the cluster allows.

    Args:
        model_fn: builds the model on a worker (called after the seed is set, so every rank gets equal weights).
        loss_fn: `loss_fn(model, batch) -> Tensor[n]`, one loss per sample of the batch (a dict of column
            tensors). raytrain sums and normalises them by the global batch.
        optimizer_fn: `optimizer_fn(params, lr=...) -> torch.optim.Optimizer`, or `optimizer_fn(model, lr=...)` when
            its first parameter is named `model` (for parameter groups by name). Groups keep their own options
            and LR ratios under every strategy, zero1 included (see `raytrain.optim`).
        datasets: {"train": ..., "val": ... (optional)}; each a `raytrain.ParquetSource` (or a path / `s3://`
            URI of Parquet files: read in place by every worker in an exact, W-invariant order with bounded
            memory; see `raytrain.data.parquet`) or a `ray.data.Dataset` (materialized once in the object
            store in deterministic mode, streamed with `deterministic=False`). The columns named in
            `required_columns` must exist. The validation set is materialized; its mean loss is reported as
            `val_loss` at every checkpoint.
        batch, lr, loop, checkpoint, cluster: the configuration (see `raytrain.config`).
        required_columns: columns `loss_fn` reads; checked on the driver before any worker starts.
        lr_schedule_fn: optional `lr_schedule_fn(step, total_steps) -> factor`: the LR of optimizer step `step`
            (0-based) is factor x the peak LR (x each group's ratio). Replaces `LRConfig`'s warmup and schedule;
            like them it must depend on the step and the run's length only, never on the world size.
        parallel: `ParallelConfig` (meta init, precision, gradient accumulation, activation checkpointing).
        units_fn: optional `units_fn(model) -> [submodules]`: the FSDP units (default: each repeated block).
        tp_plan_fn: optional `tp_plan_fn(model) -> {module-name pattern: "colwise" | "rowwise"}`: the tensor-parallel
            plan when `parallel.tp` > 1 (default: the model's own `tp_plan()`); see `raytrain.parallel.tensor`.
        trackers: experiment trackers used on rank 0, e.g. `[raytrain.trackers.TensorBoard()]` (see
            `raytrain.trackers` for the three methods a tracker of your own needs).
        storage_filesystem: the `pyarrow.fs.FileSystem` of a URI `checkpoint.storage_path` (as Ray's
            `RunConfig.storage_filesystem`), e.g. an `S3FileSystem` with an endpoint and credentials; None: the one
            pyarrow derives from the URI. Checkpoints are written, listed, verified and restored through it.
        init_from: pretrained weights to start from (fine-tuning): a safetensors file or a Hugging Face model
            directory, a local path every node sees or a URI (`s3://bucket/model?endpoint_override=...`). Names are
            matched exactly against the model's on the driver; each rank reads only its shard's bytes
            (`raytrain.pretrained`). A resumed run starts from its checkpoint instead.
        init_key_map: optional `init_key_map(name_in_files) -> model name | None` for weights saved under other
            names (None leaves a tensor of the files out).
        init_missing: a tensor of the model that `init_from` lacks (a new head on a pretrained model): "init" (the
            default) keeps the model's own init, the same at every W, listed in one line; "error" refuses it.
        init_unexpected: a tensor of `init_from` the model lacks (the LM head under a classifier): "error" (the
            default) refuses it naming it; "ignore" leaves it out, in one line.

    Everything is validated in the constructor and in `fit` before a worker starts; a `ConfigError` names
    the field, its value and the valid range.
    """

    def __init__(
        self,
        *,
        model_fn: Callable[[], nn.Module],
        loss_fn: Callable[..., Any],
        optimizer_fn: Callable[..., Any],
        datasets: dict[str, Any],
        batch: BatchConfig,
        lr: LRConfig,
        loop: LoopConfig | None = None,
        checkpoint: CheckpointConfig | None = None,
        cluster: ClusterConfig | None = None,
        parallel: ParallelConfig | None = None,
        required_columns: Sequence[str] = (),
        lr_schedule_fn: Callable[[int, int], float] | None = None,
        units_fn: Callable[[nn.Module], list[nn.Module]] | None = None,
        tp_plan_fn: Callable[[nn.Module], Any] | None = None,
        trackers: Sequence[Any] = (),
        storage_filesystem: Any = None,
        init_from: str | None = None,
        init_key_map: Callable[[str], str | None] | None = None,
        init_missing: str = "init",
        init_unexpected: str = "error",
    ) -> None:
        for name, fn in (("model_fn", model_fn), ("loss_fn", loss_fn), ("optimizer_fn", optimizer_fn)):
            if not callable(fn):
                raise ConfigError(f"{name} must be callable, got {fn!r}")
        hooks = (("lr_schedule_fn", lr_schedule_fn), ("units_fn", units_fn), ("tp_plan_fn", tp_plan_fn))
        for name, hook in (*hooks, ("init_key_map", init_key_map)):
            if hook is not None and not callable(hook):
                raise ConfigError(f"{name} must be callable or None, got {hook!r}")
        if "train" not in datasets:
            raise ConfigError(f"datasets must contain a 'train' dataset, got keys {sorted(datasets)}")
        datasets = {name: as_source(value) for name, value in datasets.items()}
        from raytrain.parallel.layout import resolved_spec

        self.spec, self.layout_reason = resolved_spec(
            model_fn,
            units_fn,
            batch=batch,
            lr=lr,
            loop=loop or LoopConfig(),
            checkpoint=checkpoint or CheckpointConfig(),
            cluster=cluster or ClusterConfig(),
            parallel=parallel or ParallelConfig(),
        )
        if not self.spec.loop.deterministic and isinstance(datasets["train"], ParquetSource):
            raise ConfigError(
                "deterministic=False streams a ray.data.Dataset; a ParquetSource (or a path) is always read in the "
                "exact, W-invariant order: keep deterministic=True, or pass ray.data.read_parquet(...) to stream"
            )
        if not self.spec.loop.deterministic and self.spec.parallel.replica > 1:
            raise ConfigError(
                f"tp {self.spec.parallel.tp} and pp {self.spec.parallel.pp} need deterministic=True: in streaming "
                "mode every worker reads its own shard, and the workers of one model-parallel replica must train on "
                "the same samples"
            )
        if not self.spec.loop.deterministic and not self.spec.loop.id_column:
            raise ConfigError(
                "id_column must name a column with a unique integer id per sample when deterministic=False: "
                "streaming mode keeps exactly-once by id"
            )
        needs_length = lr_schedule_fn is not None or self.spec.lr.schedule != "constant"
        loop = self.spec.loop
        if needs_length and not loop.deterministic and loop.max_steps is None and self.spec.lr.decay_steps is None:
            what = "lr_schedule_fn" if lr_schedule_fn is not None else f"schedule {self.spec.lr.schedule!r}"
            raise ConfigError(
                f"{what} needs the run's length: in streaming mode (deterministic=False) set loop.max_steps or "
                "lr.decay_steps"
            )
        self.model_fn, self.loss_fn, self.optimizer_fn = model_fn, loss_fn, optimizer_fn
        self.lr_schedule_fn = lr_schedule_fn
        self.live_run: Any = None  # the `raytrain.live.driver.LiveRun` of a live fit, while and after it runs
        self.units_fn = units_fn
        self.tp_plan_fn = tp_plan_fn
        check_trackers(list(trackers))
        self.trackers = tuple(trackers)
        if storage_filesystem is not None:
            import pyarrow.fs as pafs

            if not isinstance(storage_filesystem, pafs.FileSystem):
                raise ConfigError(
                    f"storage_filesystem must be a pyarrow.fs.FileSystem or None, got {storage_filesystem!r}"
                )
            if self.spec.checkpoint.is_local:
                raise ConfigError(
                    "storage_filesystem is for a URI storage_path (s3://bucket/prefix), got storage_path "
                    f"{self.spec.checkpoint.storage_path!r}"
                )
        self.storage_filesystem = storage_filesystem
        self.meta_init = False  # decided by check_user_functions
        self.conditional_modules: tuple[str, ...] = ()  # found by find_conditional_modules
        if init_from is not None and (not isinstance(init_from, str) or not init_from):
            raise ConfigError(f"init_from must be a path or URI (a string), got {init_from!r}")
        from raytrain.pretrained import MISSING_CHOICES, UNEXPECTED_CHOICES

        if init_missing not in MISSING_CHOICES:
            raise ConfigError(f"init_missing must be one of {MISSING_CHOICES}, got {init_missing!r}")
        if init_unexpected not in UNEXPECTED_CHOICES:
            raise ConfigError(f"init_unexpected must be one of {UNEXPECTED_CHOICES}, got {init_unexpected!r}")
        self.init_from, self.init_key_map = init_from, init_key_map
        self.init_missing, self.init_unexpected = init_missing, init_unexpected
        self.pretrained: Any = None  # `raytrain.pretrained.Pretrained`, read and checked by check_user_functions
        self.datasets = datasets
        self.required_columns = tuple(required_columns)
        if self.spec.cluster.recovery == "live":
            self._check_live()

    def _check_live(self) -> None:
        """What live mode does not run yet, refused at construction; torchft must import."""
        from raytrain.live import require_torchft

        require_torchft()
        missing = [
            what
            for what, given in (("validation (datasets['val'])", "val" in self.datasets), ("trackers", self.trackers))
            if given
        ]
        if missing:
            raise ConfigError(
                f'ClusterConfig(recovery="live") does not run {" or ".join(missing)} yet: leave them out, or use '
                'recovery="restart"'
            )

    def check_user_functions(self) -> None:
        """Build the model on the meta device and the optimizer over it (shardable for zero1), decide how the
        workers build the model (`ParallelConfig.init`) and say why; raise `ConfigError` naming the function that
        fails. Called by `fit` before any worker starts."""
        from raytrain.model_init import choose_init
        from raytrain.parallel.apply import fsdp_units
        from raytrain.preflight import build_model_for_check, check_optimizer_fn

        model = build_model_for_check(self.model_fn)
        spec = self.spec
        check_optimizer_fn(self.optimizer_fn, model, spec.lr.peak_lr(spec.batch.global_batch), spec.loop.strategy)
        if self.units_fn is not None:
            from raytrain.preflight import check_units_fn

            check_units_fn(self.units_fn, model)
        fsdp_units(model, self.units_fn)  # a tie split over FSDP units is refused here
        from raytrain.parallel.layout import check_model_parallel

        if self.layout_reason:
            say(self.layout_reason)
        for line in check_model_parallel(
            self.model_fn,
            *spec.parallel.degrees,
            self.tp_plan_fn,
            spec.parallel.pp_schedule,
            spec.parallel.chunks,
            spec.parallel.sequence_parallel,
        ):
            say(line)
        if spec.parallel.degrees[1] > 1:
            from raytrain.preflight import check_stage_ties

            lr = spec.lr.peak_lr(spec.batch.global_batch)
            for line in check_stage_ties(
                self.model_fn, self.optimizer_fn, spec.parallel.degrees[1], lr, spec.parallel.chunks
            ):
                say(line)
        if self.init_from is not None:
            from raytrain.pretrained import check_names, open_pretrained

            self.pretrained = open_pretrained(self.init_from, self.init_key_map)
            for line in check_names(self.pretrained, model, missing=self.init_missing, unexpected=self.init_unexpected):
                say(line)
        try:
            # pretrained weights replace the init: the sharded build then reads only each rank's shard
            prefer = self.pretrained is not None
            choice = choose_init(spec.parallel.init, self.model_fn, spec.loop.seed, prefer_sharded=prefer)
        except ConfigError:
            raise
        except ValueError as err:
            raise ConfigError(f"init 'meta' is not possible for this model: {err}; use init 'auto' or 'full'") from None
        self.meta_init = choice.sharded
        say(f"model init: {choice.reason}")

    def check_loss_fn(self, sample: dict[str, Any]) -> None:
        """Run `loss_fn` on `sample` (a few real training rows) with the model, before any worker starts:
        `ConfigError` when it raises (e.g. a column it reads does not exist) or returns anything but one loss per
        sample. Call after `check_user_functions`."""
        from raytrain.preflight import build_model_for_check, check_loss_fn

        def cpu_model() -> nn.Module:
            torch.manual_seed(self.spec.loop.seed)
            return self.model_fn()

        tp = self.spec.parallel.degrees[0]
        probe = None
        if self.spec.parallel.sequence_parallel and tp > 1:  # the length it cuts, seen in the same forward
            from raytrain.parallel.sequence import SequenceProbe

            probe = SequenceProbe(tp)
        note = check_loss_fn(
            self.loss_fn, build_model_for_check(self.model_fn), sample, cpu_model, probe.watch if probe else None
        )
        if note:
            say(note)
        if probe is not None:
            say(probe.verdict())
        pp = self.spec.parallel.degrees[1]
        if pp > 1:
            from raytrain.preflight import check_pipeline

            say(check_pipeline(self.model_fn, self.loss_fn, sample, pp, cpu_model, self.spec.parallel.chunks))

    def find_conditional_modules(self, sample: dict[str, Any]) -> None:
        """Find the modules the model calls on some inputs only (an expert, a branch) with a few forwards on
        `sample` (real training rows) and say so: the workers never make them FSDP units
        (`raytrain.parallel.idle`). Call after `check_loss_fn`."""
        from raytrain.parallel.idle import describe_conditional
        from raytrain.preflight import build_model_for_check, find_conditional_modules

        def cpu_model() -> nn.Module:
            torch.manual_seed(self.spec.loop.seed)
            return self.model_fn()

        found = find_conditional_modules(self.loss_fn, build_model_for_check(self.model_fn), sample, cpu_model)
        self.conditional_modules = tuple(found or ())
        if found:
            say(describe_conditional(found))

    def _job(self, run_dir: str, *, num_rows: int | None = None, **data: Any) -> WorkerJob:
        """The `WorkerJob` every worker receives; checks `lr_schedule_fn` over the run's length first."""
        from raytrain.data.materialized import run_total_steps
        from raytrain.preflight import check_lr_schedule_fn
        from raytrain.worker_loop import WorkerJob

        spec = self.spec
        if self.lr_schedule_fn is not None:
            total = spec.lr.decay_steps or spec.loop.max_steps
            if num_rows is not None and total is None:
                total = run_total_steps(
                    num_rows=num_rows,
                    global_batch=spec.batch.global_batch,
                    drop_last=spec.batch.drop_last,
                    epochs=spec.loop.epoch_limit,
                    max_steps=None,
                    step=0,
                    epoch=0,
                    sample_in_epoch=0,
                )
            check_lr_schedule_fn(self.lr_schedule_fn, max(1, total or 1))
        return WorkerJob(
            spec=spec,
            run_dir=run_dir,
            model_fn=self.model_fn,
            loss_fn=self.loss_fn,
            optimizer_fn=self.optimizer_fn,
            lr_schedule_fn=self.lr_schedule_fn,
            units_fn=self.units_fn,
            tp_plan_fn=self.tp_plan_fn,
            trackers=self.trackers,
            meta_init=self.meta_init,
            conditional_modules=self.conditional_modules,
            pretrained=self.pretrained,
            **data,
        )

    def fit(self) -> FitResult:
        """Run training to the end (or until failures exceed `max_failures`); blocks. Starts a local Ray
        instance when none is connected (`RAY_ADDRESS` or `ray.init` elsewhere connects to a cluster). Holds the
        run directory's lock (`raytrain.run_lock`) throughout: the same run started again meanwhile refuses."""
        from raytrain.storage import keep_out_of_uploads

        run_dir, storage = check_storage(self.spec, self.storage_filesystem)
        if self.spec.checkpoint.is_local:
            keep_out_of_uploads(self.spec.checkpoint.storage_path)
        with run_lock(run_dir):
            return self._fit(run_dir, storage)

    def check(self) -> None:
        """Every check `fit` makes before a worker starts (storage, checkpoints, the user's functions on the model,
        the pretrained weights' names, the data and `loss_fn` on real rows, the cluster's room), and nothing more:
        `raytrain fit --dry-run`. Starts a local Ray instance when none is connected (Ray datasets need one)."""
        run_dir, storage = check_storage(self.spec, self.storage_filesystem)
        self._prepare(run_dir, storage)

    def _prepare(self, run_dir: str, storage: RunStorage) -> tuple[WorkerJob, dict[str, Any]]:
        """The checks before a worker starts, and what the workers get: the job and Ray Train's datasets."""
        from raytrain.data.materialized import (
            IndexedData,
            as_column,
            check_columns,
            check_numeric_columns,
            steps_per_epoch,
        )

        spec = self.spec
        check_resumable(storage)
        resume_from = cross_mode_resume(storage, run_dir, spec.cluster.recovery)
        self.check_user_functions()
        connect_ray(local_cpus(spec), local_cpus_reason(spec))
        waiting = check_capacity(spec)
        if waiting:
            say(waiting)
            append_line(run_dir, f"[raytrain] {waiting}")
        train = self.datasets["train"]
        val_set = self.datasets.get("val")
        val: IndexedData | None = None
        if isinstance(val_set, ParquetSource):  # small by nature: read whole on the driver, in place
            val = IndexedData.from_parquet(*val_set.resolve(), self.required_columns)
        elif val_set is not None:
            val = IndexedData.from_dataset(val_set, None, self.required_columns)
        trainer_datasets: dict[str, Any] = {}
        if isinstance(train, ParquetSource) or spec.loop.deterministic:
            data: ParquetIndex | IndexedData
            if isinstance(train, ParquetSource):
                data = train.index(self.required_columns, spec.loop.id_column, spec.batch.global_batch)
            else:
                data = IndexedData.from_dataset(train, spec.loop.id_column, self.required_columns)
            steps_per_epoch(data.num_rows, spec.batch.global_batch, spec.batch.drop_last)  # drop_last: B <= N
            if resume_from is None and (spec.cluster.recovery == "live" or storage.newest_checkpoint() is None):
                # a fresh start; a restart-mode resume says its run length after its decisions (the worker's line)
                say(describe_run_length(data.num_rows, spec.batch.global_batch, spec.batch.drop_last, spec.loop))
            head = data.head(1000)
            check_numeric_columns(head, self.required_columns)
            self.check_loss_fn({name: column[:2] for name, column in head.items()})
            self.find_conditional_modules({name: column[:4] for name, column in head.items()})
            if isinstance(data, ParquetIndex):
                replicas = spec.cluster.max_workers // spec.parallel.replica
                for line in describe_reads(data, train.partitions, spec.batch.global_batch, replicas):
                    say(line)
            job = self._job(run_dir, data=data, val_data=val, num_rows=data.num_rows)
        else:
            check_columns(train, (*self.required_columns, spec.loop.id_column or ""))
            if spec.batch.drop_last:  # counting may read the data once; only needed for this check
                steps_per_epoch(train.count(), spec.batch.global_batch, drop_last=True)
            head = {name: as_column([c]) for name, c in train.take_batch(1000, batch_format="numpy").items()}
            check_numeric_columns(head, self.required_columns)
            ids = np.asarray(head[spec.loop.id_column]) if spec.loop.id_column else None
            if ids is not None and ids.dtype.kind not in "iu":
                raise ConfigError(f"id_column {spec.loop.id_column!r} must hold integers, got dtype {ids.dtype}")
            self.check_loss_fn({name: column[:2] for name, column in head.items()})
            self.find_conditional_modules({name: column[:4] for name, column in head.items()})
            job = self._job(run_dir, val_data=val, empty_batch={name: column[:0] for name, column in head.items()})
            trainer_datasets["train"] = train
        return replace(job, resume_from=resume_from), trainer_datasets

    def _fit(self, run_dir: str, storage: RunStorage) -> FitResult:
        from ray.train import CheckpointConfig as RayCheckpointConfig

        # Ray Train V2 classes at run time; the type stubs still describe V1, hence the ignores below.
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.v2.api.exceptions import ControllerError

        from raytrain.data.streaming import ExactSplitConfig
        from raytrain.ray_hooks import (
            RefreshClusterView,
            RunLog,
            StopRepeatedUserErrors,
            actor_id,
            actor_record,
            torch_trainer_class,
        )
        from raytrain.start_watch import StartWatch
        from raytrain.worker_loop import train_loop_per_worker

        spec = self.spec
        job, trainer_datasets = self._prepare(run_dir, storage)
        cluster = spec.cluster
        if spec.cluster.recovery == "live":
            return self._fit_live(job, run_dir, storage)
        if not storage.is_local:
            say(f"checkpoints go to {storage.uri}; the run's files (metrics, events, log) to {run_dir}")
        workers: int | tuple[int, int] = (
            cluster.min_workers
            if cluster.min_workers == cluster.max_workers
            else (cluster.min_workers, cluster.max_workers)
        )
        view = RefreshClusterView(run_dir, cluster.resize_monitor_interval_s)
        from raytrain.capacity import describe_request

        bundle = {"CPU": 1.0, **cluster.resources_per_worker, **({"GPU": 1.0} if cluster.use_gpu else {})}
        request = describe_request(cluster.min_workers, bundle)
        if cluster.max_workers > cluster.min_workers:
            request = request.replace(
                f"{cluster.min_workers} worker", f"{cluster.min_workers} to {cluster.max_workers} worker"
            )
        hooks = [StopRepeatedUserErrors(), RunLog(run_dir, request), view]
        trainer = torch_trainer_class(spec.parallel.degrees[0], replica=spec.parallel.replica)(
            train_loop_per_worker,
            train_loop_config={"job": job},
            datasets=trainer_datasets or None,
            dataset_config=ExactSplitConfig(datasets_to_split=["train"]) if trainer_datasets else None,
            scaling_config=ScalingConfig(  # type: ignore[call-arg]
                num_workers=workers,  # type: ignore[arg-type]
                use_gpu=cluster.use_gpu,
                resources_per_worker=dict(cluster.resources_per_worker),
                elastic_resize_monitor_interval_s=cluster.resize_monitor_interval_s,
            ),
            run_config=RunConfig(  # type: ignore[call-arg]
                name=spec.checkpoint.run_name,
                storage_path=posixpath.dirname(storage.path),
                storage_filesystem=None if spec.checkpoint.is_local else storage.fs,
                failure_config=FailureConfig(max_failures=cluster.max_failures),
                checkpoint_config=RayCheckpointConfig(num_to_keep=spec.checkpoint.keep),
                worker_runtime_env={"env_vars": worker_env()},
                callbacks=hooks,  # type: ignore[arg-type]  # V2 callbacks; V1 stubs
            ),
        )
        quiet = is_quiet()
        watch = StartWatch(run_dir, lambda: actor_id(trainer.controller), actor_record, echo=not quiet)
        tail = RunLogTail(run_dir).start() if quiet else None
        try:
            watch.start()
            result = trainer.fit()
        except ControllerError as err:  # raytrain's controller callback stopped a bug from being retried
            if isinstance(err.controller_failure, UserCodeError):
                raise err.controller_failure from None
            raise
        except KeyboardInterrupt:  # Ctrl-C, at any moment (start-up retries included): stop the run now
            watch.stop()  # before the controller is killed: no line on its death after this one
            trainer.stop()
            _say_interrupted(storage)
            raise
        finally:
            watch.stop()
            if tail is not None:
                tail.stop()
        return self._result(run_dir, storage, result.metrics, result.checkpoint)

    def _result(self, run_dir: str, storage: RunStorage, metrics: dict[str, Any] | None, checkpoint: Any) -> FitResult:
        spec = self.spec
        return FitResult(
            metrics=metrics,
            checkpoint=checkpoint,
            run_dir=run_dir,
            metrics_path=os.path.join(run_dir, METRICS_FILE),
            samples_path=os.path.join(run_dir, SAMPLES_FILE) if spec.loop.audit_samples else None,
            events_path=os.path.join(run_dir, EVENTS_FILE),
            storage_uri=storage.uri,
        )

    def _fit_live(self, job: WorkerJob, run_dir: str, storage: RunStorage) -> FitResult:
        """`fit` with `ClusterConfig(recovery="live")`: torchft replica groups as Ray actors (`raytrain.live`)."""
        from ray.train import Checkpoint

        from raytrain.live import describe_groups
        from raytrain.live.driver import LiveRun

        say(f"live recovery: {describe_groups(job.spec)}; a lost replica is replaced while the others go on")
        self.live_run = LiveRun(job, run_dir)
        tail = RunLogTail(run_dir).start() if is_quiet() else None
        try:
            result = self.live_run.fit()
        except KeyboardInterrupt:  # Ctrl-C: LiveRun.fit has stopped its replicas and its log on the way out
            _say_interrupted(storage)
            raise
        finally:
            if tail is not None:
                tail.stop()
        metrics = read_jsonl(os.path.join(run_dir, METRICS_FILE))
        checkpoint = Checkpoint.from_directory(result.checkpoint) if result.checkpoint else None
        return self._result(run_dir, storage, metrics[-1] if metrics else None, checkpoint)
