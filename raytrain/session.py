"""Bring your own loop: raytrain's guarantees inside a plain Ray Train `train_func`.

    def train_func(config):
        run = raytrain.attach(batch=BatchConfig(global_batch=64, micro_batch=16), lr=LRConfig(base_lr=1e-3),
                              data="data/train/", loop=LoopConfig(strategy="zero2", epochs=3))
        model, optimizer = run.prepare(MyModel, lambda params, lr: AdamW(params, lr=lr))
        for step in run.steps():                      # resumes at the right sample after a restart or resize
            for micro in step.micro_batches():        # this rank's share of the global batch
                step.backward(my_loss(model, micro))  # per-sample losses; the gradient sync on the last only
            step.optimizer_step()                     # LR by the rule, clipping, non-finite steps skipped
            run.report({"my_metric": ...})            # added to the step's line (rank 0 writes it)

    TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=(1, 4)), run_config=RunConfig(...)).fit()

The user owns the loop, the model code and any per-step code; raytrain owns what makes the training invariant to
the world size: the global batch split exactly over whatever world exists, the LR by its named rule of the
global batch, the data order (every sample once per epoch, the data position in every checkpoint), and
checkpoints that reshard at another world size. It is the same machinery as `ElasticTrainer`'s: `prepare` builds
the `Run` its workers build (`raytrain.worker_loop.start_run`), `steps` is their step loop and each step a
`raytrain.step.Step`; only the body of the loop is the user's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch import nn

from raytrain.config import BatchConfig, CheckpointConfig, ClusterConfig, LoopConfig, LRConfig, ParallelConfig
from raytrain.errors import ConfigError
from raytrain.step import Step

ModelFn = Callable[[], nn.Module]


def attach(
    *,
    batch: BatchConfig,
    lr: LRConfig,
    data: Any,
    loop: LoopConfig | None = None,
    checkpoint: CheckpointConfig | None = None,
    parallel: ParallelConfig | None = None,
    run_dir: str | None = None,
    required_columns: Sequence[str] = (),
    lr_schedule_fn: Callable[[int, int], float] | None = None,
) -> Session:
    """raytrain's guarantees for the calling Ray Train worker (call it in `train_func`, on every rank).

    Args:
        batch, lr, loop, checkpoint, parallel: raytrain's configuration (`raytrain.config`); the world size is
            the worker group's. `checkpoint` sets how often (`every_steps`) and how (`background_save`); where
            checkpoints go is Ray Train's `RunConfig` (storage_path, name, `CheckpointConfig(num_to_keep=...)`).
        data: the training set: a Parquet path or URI or a `raytrain.ParquetSource` (read in place, each rank its
            share), a `ray.data.Dataset` (materialized once, by rank 0, in Ray's object store), or a map-style
            dataset (`len()` and `[i]` -> a dict of numbers, arrays or tensors; read whole by every rank). The
            order is raytrain's in each case: deterministic mode (`LoopConfig.deterministic=True`) only.
        run_dir: where rank 0 writes metrics.jsonl, events.jsonl, samples.jsonl and raytrain.log; None: Ray
            Train's run directory when its storage is local (an object-storage run must name a local one).
        required_columns: columns the loop reads; checked on the data when `prepare` indexes it.
        lr_schedule_fn: optional `lr_schedule_fn(step, total_steps) -> factor` (see `ElasticTrainer`).

    Returns a `Session`; nothing is built until `Session.prepare`. `ConfigError` names a bad value.
    """
    loop = loop or LoopConfig()
    if not loop.deterministic:
        raise ConfigError(
            "raytrain.attach trains in deterministic mode only (its exact order is what makes a resize lose no "
            "sample): leave LoopConfig.deterministic=True"
        )
    if lr_schedule_fn is not None and not callable(lr_schedule_fn):
        raise ConfigError(f"lr_schedule_fn must be callable or None, got {lr_schedule_fn!r}")
    return Session(
        batch=batch,
        lr=lr,
        data=data,
        loop=loop,
        checkpoint=checkpoint or CheckpointConfig(),
        parallel=parallel or ParallelConfig(),
        run_dir=run_dir,
        required_columns=tuple(required_columns),
        lr_schedule_fn=lr_schedule_fn,
    )


def ray_callbacks(run_dir: str, monitor_interval_s: float = 1.0) -> list[Any]:
    """Ray Train controller callbacks for the driver's `RunConfig(callbacks=...)` of an `attach` run (optional):
    after a node loss Ray Train 2.60 first restarts at the old size and waits out its worker-group start timeout
    (60 s by default) before trying the size that is left; `raytrain.ray_hooks.RefreshClusterView` waits for the
    node to be marked dead and refreshes Ray's view, so the restart at the new size comes in seconds, and a node
    that joins is seen at the next resize check (every `monitor_interval_s`). It writes its lines to
    `<run_dir>/raytrain.log` (`run_dir`: RunConfig's storage_path/name, where the run's files go)."""
    from raytrain.ray_hooks import RefreshClusterView

    if not isinstance(monitor_interval_s, int | float) or monitor_interval_s <= 0:
        raise ConfigError(f"monitor_interval_s must be > 0 (seconds), got {monitor_interval_s!r}")
    return [RefreshClusterView(os.fspath(run_dir), float(monitor_interval_s))]


def _refuse_loss(*_: Any) -> Any:
    raise RuntimeError("a raytrain.attach run has no loss_fn: its loop computes the losses (Step.backward)")


def _index(data: Any, required: Sequence[str], id_column: str | None, rank: int, global_batch: int) -> Any:
    """The training set as deterministic mode's indexed data, built once (Parquet footers, a Ray dataset's
    materialization) by rank 0 and sent to the others; a map-style dataset is read by every rank."""
    from raytrain.collectives import broadcast_object
    from raytrain.data.materialized import ColumnData, IndexedData, check_numeric_columns
    from raytrain.data.parquet import ParquetSource, as_source

    if isinstance(data, list | tuple) and data and all(isinstance(p, str | os.PathLike) for p in data):
        data = ParquetSource(list(data))  # a list of Parquet files or directories
    data = as_source(data)
    if hasattr(data, "__getitem__") and hasattr(data, "__len__") and not isinstance(data, ParquetSource):
        indexed: Any = ColumnData.from_map_style(data, id_column)
        check_numeric_columns(indexed.head(8), required)
        return indexed
    if rank == 0:
        try:
            if isinstance(data, ParquetSource):
                indexed = data.index(required, id_column, global_batch)
            elif hasattr(data, "materialize"):  # a ray.data.Dataset
                indexed = IndexedData.from_dataset(data, id_column, required)
            else:
                raise ConfigError(
                    f"data must be a Parquet path or URI, a raytrain.ParquetSource, a ray.data.Dataset or a "
                    f"map-style dataset (len() and [i]), got {type(data).__name__}"
                )
            check_numeric_columns(indexed.head(8), required)
        except ConfigError as err:
            indexed = err
    else:
        indexed = None
    indexed = broadcast_object(indexed)
    if isinstance(indexed, ConfigError):
        raise ConfigError(str(indexed))
    return indexed


class Session:
    """One worker's view of a `raytrain.attach` run (see the module docstring); made by `attach`."""

    def __init__(self, **config: Any) -> None:
        self._config = config
        self._run: Any = None  # raytrain.worker_loop.Run, built by prepare
        self._steps: Iterator[Step] | None = None

    @property
    def run(self) -> Any:
        """The typed run state (`raytrain.worker_loop.Run`) that `prepare` built."""
        if self._run is None:
            raise RuntimeError("call run.prepare(model_fn, optimizer_fn) first")
        return self._run

    def prepare(
        self,
        model_fn: ModelFn,
        optimizer_fn: Callable[..., Any],
        *,
        units_fn: Callable[[nn.Module], list[nn.Module]] | None = None,
    ) -> tuple[nn.Module, Any]:
        """Build the model and the optimizer for this worker group and restore the latest checkpoint (collective).

        `model_fn()` builds the model (a class or a function; called after `torch.manual_seed(seed)`, so every
        rank and every world size starts from the same weights); it is wrapped as `LoopConfig.strategy` says
        (ddp, zero1, zero2, zero3, auto). `optimizer_fn(params, lr=...)` (or `optimizer_fn(model, lr=...)`)
        builds the optimizer; raytrain sets its LR every step by the rule. Returns (model, optimizer): use them
        in the loop, and not their raw versions. A built `nn.Module` is refused: pass the function that builds
        it, so that raytrain seeds it (and can build it sharded)."""
        if self._run is not None:
            raise RuntimeError("run.prepare(...) is called once per worker-group start")
        if isinstance(model_fn, nn.Module):
            raise ConfigError(
                f"prepare takes the function that builds the model, got a built {type(model_fn).__name__}: pass "
                f"e.g. `lambda: {type(model_fn).__name__}(...)` (raytrain seeds the build, so every rank and every "
                "world size starts from the same weights)"
            )
        if not callable(model_fn) or not callable(optimizer_fn):
            raise ConfigError(f"prepare takes model_fn and optimizer_fn, callables; got {model_fn!r}, {optimizer_fn!r}")
        import ray.train

        from raytrain.parallel.layout import resolved_spec
        from raytrain.worker_loop import WorkerJob, start_run

        config = self._config
        context = ray.train.get_context()
        world, rank = context.get_world_size(), context.get_world_rank()
        parallel: ParallelConfig = config["parallel"]
        if parallel.tp != 1 or parallel.pp != 1:
            raise ConfigError(
                f"raytrain.attach runs data parallelism (ddp, zero1-3); tp {parallel.tp} and pp {parallel.pp} need "
                "ElasticTrainer for now"
            )
        spec, reason = resolved_spec(
            model_fn,
            units_fn,
            batch=config["batch"],
            lr=config["lr"],
            loop=config["loop"],
            checkpoint=config["checkpoint"],
            cluster=ClusterConfig(min_workers=1, max_workers=world),
            parallel=parallel,
        )
        data = _index(config["data"], config["required_columns"], spec.loop.id_column, rank, spec.batch.global_batch)
        job = WorkerJob(
            spec=spec,
            run_dir=self._run_dir(context),
            model_fn=model_fn,
            loss_fn=_refuse_loss,
            optimizer_fn=optimizer_fn,
            lr_schedule_fn=config["lr_schedule_fn"],
            units_fn=units_fn,
            data=data,
        )
        self._run = start_run(job)
        if reason:
            self._run.log.print(reason)
        return self._run.model, self._run.optimizer

    def _run_dir(self, context: Any) -> str:
        """Where rank 0 writes the run's files: the one given, else Ray Train's run directory when local."""
        given = self._config["run_dir"]
        if given is not None:
            return str(given)
        storage = context.get_storage()
        import pyarrow.fs as pafs

        if isinstance(storage.storage_filesystem, pafs.LocalFileSystem):
            return str(storage.experiment_fs_path)
        raise ConfigError(
            f"Ray Train stores this run in {storage.experiment_fs_path} on {type(storage.storage_filesystem).__name__}:"
            " pass raytrain.attach(run_dir=...) a local directory for the run's metrics and logs"
        )

    def track(self, name: str, state: Any) -> None:
        """Save `state` (an object with `state_dict()` and `load_state_dict()`, e.g. an EMA of the weights or a
        counter of your own) in every checkpoint under `name`, and restore it now from the checkpoint this start
        resumed from, if that holds it (collective; after `prepare`, before `steps`). Tensors are resharded by
        DCP like the model's (a DTensor in `state_dict()` takes this run's sharding)."""
        run = self.run
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"track: name must be an identifier (letters, digits, _), got {name!r}")
        if not callable(getattr(state, "state_dict", None)) or not callable(getattr(state, "load_state_dict", None)):
            raise ConfigError(f"track({name!r}, ...): the state needs state_dict() and load_state_dict()")
        if self._steps is not None:
            raise RuntimeError("track(...) before run.steps(): the first checkpoint would miss it otherwise")
        run.extras[name] = state
        if run.restored_from is not None:
            from raytrain.checkpoint import load_extras
            from raytrain.worker_loop import local_checkpoint

            with local_checkpoint(*run.restored_from) as local:
                missing = load_extras(local, {name: state})
            if missing:
                run.log.print(f"WARNING: the checkpoint holds no {name!r}: it starts fresh")

    def steps(self) -> Iterator[Step]:
        """The optimizer steps left in the run, from the restored position (collective: every rank walks them all).
        Between steps raytrain advances the data position, writes the step's line on rank 0, checkpoints when
        due and answers a drain notice; after the last, the final checkpoint is committed."""
        from raytrain.worker_loop import steps

        if self._steps is not None:
            raise RuntimeError("run.steps() is walked once per worker-group start")
        self._steps = steps(self.run)
        return self._steps

    def report(self, metrics: dict[str, Any]) -> None:
        """Add `metrics` (JSON values) to the current step's line in metrics.jsonl and to what Ray Train receives
        at the next checkpoint (rank 0's values are the ones written). Call inside the step loop."""
        if not isinstance(metrics, dict):
            raise TypeError(f"report takes a dict of metrics, got {type(metrics).__name__}")
        self.run.user_metrics.update(metrics)

    @property
    def module(self) -> nn.Module:
        """The user's own module inside the prepared model (DDP's wrapper taken off; FSDP keeps it in place): its
        parameter names are the model class's at every world size, the ones to key your own state by."""
        model = self.run.model
        return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model

    @property
    def rank(self) -> int:
        """This worker's rank in the group."""
        return int(self.run.rank)

    @property
    def world_size(self) -> int:
        """The worker group's size at this start."""
        return int(self.run.world)

    @property
    def step(self) -> int:
        """Optimizer steps completed so far (the checkpoint's count at the start)."""
        return int(self.run.state.step)

    @property
    def device(self) -> Any:
        """This worker's torch device."""
        return self.run.device

    @property
    def run_dir(self) -> str:
        """Where rank 0 writes the run's files."""
        return os.fspath(self.run.job.run_dir)
