"""`raytrain fit`: a training job described by a TOML file.

    raytrain fit examples/fit_mlp.toml [--workers 2:3] [--steps 50] [--dry-run]

The file names Python entries for the builders and holds the config fields, one table per config dataclass:

    [entry]                       # "module:function" or "path/to/file.py:function" (relative to the file)
    model = "fit_entry.py:model"          # () -> torch.nn.Module
    loss = "fit_entry.py:loss"            # (model, batch) -> Tensor[n]
    optimizer = "fit_entry.py:optimizer"  # (params, lr) or (model, lr) -> torch.optim.Optimizer
    datasets = "fit_entry.py:datasets"    # () -> {"train": "s3://..." | path | ParquetSource | ray.data.Dataset,
                                          #        "val"?: ...}  (called on the driver)
    lr_schedule = "fit_entry.py:schedule" # optional: (step, total_steps) -> factor of the peak LR
    tp_plan = "fit_entry.py:tp_plan"      # optional: (model) -> {module pattern: "colwise" | "rowwise"} ([parallel] tp)
    init_from = "gpt2-small/"             # optional: pretrained weights, a safetensors file or a Hugging Face model
                                          # directory (relative to the file) or a URI such as s3://bucket/model
    init_key_map = "fit_entry.py:rename"  # optional: (name in the files) -> model name | None
    init_missing = "init"                 # optional: a model tensor init_from lacks keeps its init ("error": refuse)
    init_unexpected = "error"             # optional: a tensor of init_from the model lacks ("ignore": leave it out)
    required_columns = ["x", "y"]

    [batch]      -> BatchConfig      [lr] -> LRConfig      [loop] -> LoopConfig
    [checkpoint] -> CheckpointConfig [cluster] -> ClusterConfig [parallel] -> ParallelConfig (optional)

Unknown tables or keys are errors that name the key and the valid ones. Command-line flags override file values.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

from raytrain.config import (
    BatchConfig,
    CheckpointConfig,
    ClusterConfig,
    LoopConfig,
    LRConfig,
    ParallelConfig,
    TrainSpec,
)
from raytrain.errors import ConfigError

SECTIONS: dict[str, type] = {
    "batch": BatchConfig,
    "lr": LRConfig,
    "loop": LoopConfig,
    "checkpoint": CheckpointConfig,
    "cluster": ClusterConfig,
    "parallel": ParallelConfig,
}
ENTRY_KEYS = ("model", "loss", "optimizer", "datasets")
OPTIONAL_ENTRY_KEYS = ("lr_schedule", "tp_plan", "init_key_map")
INIT_KEYS = ("init_from", "init_missing", "init_unexpected")  # strings of [entry] for pretrained weights


def read_toml(path: str) -> dict[str, Any]:
    """Parse the TOML file at `path`; `ConfigError` naming the file for a missing file or bad syntax."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {path!r} is not valid TOML: {err}") from None


def _check_keys(where: str, given: dict[str, Any], valid: list[str]) -> None:
    unknown = sorted(set(given) - set(valid))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in [{where}]; valid keys are {sorted(valid)}")


def load_entry(spec: str, base_dir: str) -> Callable[..., Any]:
    """Import "module:attr" or "file.py:attr" (a path relative to `base_dir`); `ConfigError` when it fails.

    A project of several files works as it does with `python file.py`: the entry file's directory is put on the
    driver's `sys.path` first, so the file imports its neighbours (`import charmodel`). The entry module and every
    module imported from that directory are registered with Ray's own (vendored) cloudpickle to be shipped by
    value, so Ray workers, which cannot import them by name (another machine, another working directory), still
    get the functions and the classes they use. Under `ray job submit --working-dir` the same holds.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"entry {spec!r} must look like 'module:function' or 'path/file.py:function'")
    try:
        if module_name.endswith(".py"):
            path = os.path.join(base_dir, module_name)
            name = "raytrain_entry_" + os.path.splitext(os.path.basename(path))[0]
            loader_spec = importlib.util.spec_from_file_location(name, path)
            if loader_spec is None or loader_spec.loader is None or not os.path.exists(path):
                raise ConfigError(f"entry {spec!r}: file {path!r} does not exist")
            module = importlib.util.module_from_spec(loader_spec)
            project = os.path.dirname(os.path.abspath(path))
            if project not in sys.path:
                sys.path.insert(0, project)
            sys.modules[name] = module
            loader_spec.loader.exec_module(module)
            ship_by_value(project)
        else:
            module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"entry {spec!r}: cannot import {module_name!r}: {err}") from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise ConfigError(f"entry {spec!r}: {module_name!r} has no callable {attr!r}")
    return function


def ship_by_value(directory: str) -> list[str]:
    """Register every imported module whose file lies under `directory` (and is not an installed package) with
    Ray's cloudpickle to be pickled by value; returns their names."""
    from ray import cloudpickle  # Ray's vendored copy: the one Ray serialises functions with

    root = os.path.join(os.path.abspath(directory), "")
    shipped = []
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and os.path.abspath(file).startswith(root) and "site-packages" not in file:
            try:
                cloudpickle.register_pickle_by_value(module)
            except ValueError:  # a submodule of a package not in sys.modules by itself: its package covers it
                continue
            shipped.append(name)
    return shipped


@dataclasses.dataclass(frozen=True)
class FitJob:
    """A parsed config file: the validated spec and the (not yet called) builders."""

    spec: TrainSpec
    entries: dict[str, Callable[..., Any]]
    required_columns: tuple[str, ...]
    layout_reason: str = ""  # why tp/pp "auto" chose the layout in `spec` ("" when they were given)
    init_from: str | None = None  # pretrained weights: a local path (absolute) or a URI
    init_missing: str = "init"  # ElasticTrainer's init_missing
    init_unexpected: str = "error"  # ElasticTrainer's init_unexpected


def parse_fit_config(path: str, overrides: dict[str, dict[str, Any]] | None = None) -> FitJob:
    """Read, merge `overrides` ({section: {key: value}}) over the file, validate everything, import the entries."""
    raw = read_toml(path)
    _check_keys("top level", raw, ["entry", *SECTIONS])
    entry = dict(raw.get("entry", {}))
    _check_keys("entry", entry, [*ENTRY_KEYS, *OPTIONAL_ENTRY_KEYS, "required_columns", *INIT_KEYS])
    missing = [k for k in ENTRY_KEYS if k not in entry]
    if missing:
        raise ConfigError(f"[entry] is missing {missing}; it needs {list(ENTRY_KEYS)}")
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        values = {**raw.get(name, {}), **(overrides or {}).get(name, {})}
        _check_keys(name, values, [f.name for f in dataclasses.fields(cls)])
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        absent = [key for key in required if key not in values]
        if absent:
            raise ConfigError(f"[{name}] is missing required key(s) {absent}")
        sections[name] = cls(**values)
    base_dir = os.path.dirname(os.path.abspath(path))
    entries = {key: load_entry(entry[key], base_dir) for key in (*ENTRY_KEYS, *OPTIONAL_ENTRY_KEYS) if key in entry}
    from raytrain.parallel.layout import resolved_spec

    spec, reason = resolved_spec(entries["model"], **sections)
    init_from = entry.get("init_from")
    if init_from is not None and not isinstance(init_from, str):
        raise ConfigError(f"[entry] init_from must be a path or URI (a string), got {init_from!r}")
    if init_from is not None and "://" not in init_from:
        init_from = os.path.join(base_dir, init_from)
    from raytrain.pretrained import MISSING_CHOICES, UNEXPECTED_CHOICES

    choices = {"init_missing": MISSING_CHOICES, "init_unexpected": UNEXPECTED_CHOICES}
    for key, valid in choices.items():
        if key in entry and entry[key] not in valid:
            raise ConfigError(f"[entry] {key} must be one of {list(valid)}, got {entry[key]!r}")
        if key in entry and init_from is None:
            raise ConfigError(f"[entry] {key} applies to init_from weights; the file sets no init_from")
    return FitJob(
        spec,
        entries,
        tuple(entry.get("required_columns", ())),
        reason,
        init_from,
        entry.get("init_missing", "init"),
        entry.get("init_unexpected", "error"),
    )


def describe_plan(job: FitJob) -> str:
    """The dry-run report: the batch plan for every W in [min, max], the LR, the model (built on the meta device)
    and the peak memory per worker of each strategy at `max_workers` (`raytrain.memory_plan.loop_memory`)."""
    from raytrain.memory_plan import STRATEGIES, format_bytes, loop_memory
    from raytrain.parallel.apply import fsdp_units
    from raytrain.parallel.dims import ParallelDims
    from raytrain.parallel.strategy import unit_params
    from raytrain.preflight import build_model_for_check

    spec = job.spec
    parallel = spec.parallel
    lines = [f"global batch {spec.batch.global_batch}, micro-batch cap {spec.batch.micro_batch}"]
    for world in range(spec.cluster.min_workers, spec.cluster.max_workers + 1):
        if world % parallel.replica:
            continue  # never run: Ray Train's size is rounded down to whole replicas
        dims = ParallelDims.of(world, *parallel.degrees)
        text = spec.batch.plan(dims.dp).describe()
        if dims.model_parallel:  # the plan is per replica: "W 4 = dp 2, tp 2, pp 1: accumulation 2, ..."
            text = f"W {world} = {dims.describe()}:" + text.split(":", 1)[1].replace("samples/rank", "samples/replica")
        lines.append("  " + text)
    schedule = "lr_schedule entry" if "lr_schedule" in job.entries else f"{spec.lr.schedule} schedule"
    lines.append(
        f"lr: peak {spec.lr.peak_lr(spec.batch.global_batch):.3e} ({spec.lr.rule} rule, warmup "
        f"{spec.lr.warmup_steps}, {schedule})"
    )
    model = build_model_for_check(job.entries["model"])
    units, why = fsdp_units(model)
    sizes = unit_params(model, units)
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    lines.append(f"model: {total:,} parameters; FSDP units: {why}, largest {max(sizes):,}")
    if job.layout_reason:
        lines.append(job.layout_reason)
    from raytrain.parallel.layout import check_model_parallel

    lines += check_model_parallel(
        job.entries["model"],
        *parallel.degrees,
        job.entries.get("tp_plan"),
        parallel.pp_schedule,
        parallel.chunks,
        parallel.sequence_parallel,
    )
    world = spec.cluster.max_workers // parallel.replica  # the data-parallel replicas at max_workers
    k = spec.batch.plan(world).accumulation_steps
    peaks = []
    for name in STRATEGIES:
        mode = "sharded" if spec.parallel.grad_accumulation == "sharded" else "unsharded"
        plan = loop_memory(
            total,
            name,
            world,
            largest_unit_params=max(sizes),
            root_unit_params=sizes[-1],
            accumulation_steps=k,
            grad_accumulation=mode,
            precision=spec.parallel.precision,
        )
        peaks.append(f"{name} {format_bytes(plan.total)}")
    what = (
        f"dp={world} (model-parallel layouts: the whole model's state, an upper bound)"
        if parallel.replica > 1
        else f"W={world}"
    )
    lines.append(f"peak per worker at {what}, k={k} (AdamW, without activations): " + ", ".join(peaks))
    decided = " (chosen on the workers from their memory at every start)" if spec.loop.strategy == "auto" else ""
    lines.append(f"strategy: {spec.loop.strategy}{decided}")
    if spec.cluster.recovery == "live":
        from raytrain.live import describe_groups

        lines.append(
            f"recovery: live ({describe_groups(spec)}; a lost worker's peers finish its step with the same global "
            "batch and go on, a replacement heals from a peer)"
        )
    else:
        lines.append("recovery: restart (Ray Train restarts the worker group from the latest checkpoint)")
    return "\n".join(lines)
