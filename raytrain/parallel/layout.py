"""The model-parallel layout of a run, on the driver, before any worker starts: `tp`/`pp` "auto" chosen by the
memory planner, and the chosen layout checked on the meta model.

`auto` (`ParallelConfig(tp="auto", pp="auto", device_memory_gb=..., workers_per_node=...)`) applies
`raytrain.memory_plan.plan_memory`'s recommendation once, on the driver, for the smallest world the run may have
(`min_workers`: the sharded states are largest there):

* ddp, zero1, zero2 or zero3 recommended: tp = pp = 1 (the strategy itself is `LoopConfig.strategy`; "auto" is
  decided on the workers from their memory at every start);
* ``tp=<d>`` or ``tp=<d>,pp=<s>`` recommended: that layout. The planner counts ZeRO-1 over the dp replicas; raytrain
  cannot run zero1 with tp/pp (its ZeRO-1 takes no DTensors), but zero2 holds no more: p Ψ/(d s) + (g + o) Ψ/N
  against (p + g) Ψ/(d s) + o Ψ/N, with N >= d s. So the layout fits with strategy zero2 or zero3, and with
  "auto" (the workers then pick among ddp, zero2 and zero3 from their memory); a strategy the user fixed is kept;
* nothing fits: a `ConfigError` with the planner's reason.

The decision is a function of the config and the model only (not of the nodes that happen to be up), so a rerun
or a resume of the same run chooses the same layout. State bytes are counted as raytrain's loop keeps them: fp32
parameters, gradients and Adam's two moments ("adam", 4 + 4 + 8 bytes) in every precision.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from torch import nn

from raytrain.config import ClusterConfig, ParallelConfig, TrainSpec
from raytrain.errors import ConfigError
from raytrain.memory_plan import GB, plan_memory
from raytrain.parallel.apply import UnitsFn, fsdp_units
from raytrain.parallel.pipeline import cut_stages, stage_models
from raytrain.parallel.tensor import TPPlanFn, check_tp_plan

ModelFn = Callable[[], nn.Module]


def choose_layout(
    *,
    num_params: int,
    largest_unit: int,
    min_workers: int,
    workers_per_node: int,
    device_memory_bytes: int,
) -> tuple[int, int, str]:
    """Pure: (tp, pp, reason) that `auto` runs for a model of `num_params` trainable parameters (largest FSDP unit
    `largest_unit`) on at least `min_workers` workers of `device_memory_bytes`, `workers_per_node` per node. The
    planner's nodes are gcd(min_workers, workers_per_node) workers wide (a TP group divides both the node and the
    smallest world). Raises `ConfigError` when nothing fits."""
    per_node = math.gcd(min_workers, workers_per_node)
    plan = plan_memory(
        num_params,
        min_workers,
        optimizer="adam",
        gpu_memory_bytes=device_memory_bytes,
        gpus_per_node=per_node,
        largest_layer_params=largest_unit,
    )
    rec = plan.recommendation
    where = f"{min_workers} workers of {device_memory_bytes / GB:.3g} GB, {per_node} per node"
    if rec == "none":
        raise ConfigError(
            f"tp/pp 'auto': the model ({num_params:,} parameters) fits no layout on {where}: {plan.reason}"
        )
    if not rec.startswith("tp="):
        return 1, 1, f"layout auto -> tp 1, pp 1 on {where} (planner: {rec}, {plan.reason})"
    degrees = dict(part.split("=") for part in rec.split(","))
    tp, pp = int(degrees["tp"]), int(degrees.get("pp", "1"))
    return tp, pp, f"layout auto -> tp {tp}, pp {pp} on {where}, counted with zero2 on the dp axis ({plan.reason})"


def resolve_parallel(
    parallel: ParallelConfig, cluster: ClusterConfig, model_fn: ModelFn, units_fn: UnitsFn | None = None
) -> tuple[ParallelConfig, str]:
    """`parallel` with "auto" tp/pp replaced by `choose_layout`'s choice for `model_fn`'s model (built on the meta
    device), and the reason; unchanged with "" when tp and pp are integers. A pipeline schedule when the choice
    has no pipeline (pp 1), or sequence parallel when it has no tp (tp 1), is left off and named in the reason."""
    if parallel.tp != "auto":
        return parallel, ""
    from raytrain.parallel.strategy import unit_params
    from raytrain.preflight import build_model_for_check

    assert parallel.device_memory_gb is not None and parallel.workers_per_node is not None  # ParallelConfig checks
    model = build_model_for_check(model_fn)
    sizes = unit_params(model, fsdp_units(model, units_fn)[0])
    tp, pp, reason = choose_layout(
        num_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
        largest_unit=max(sizes),
        min_workers=cluster.min_workers,
        workers_per_node=parallel.workers_per_node,
        device_memory_bytes=int(parallel.device_memory_gb * GB),
    )
    changes: dict[str, object] = {"tp": tp, "pp": pp}
    unused = []  # what the user asked of a pipeline or of tp that the chosen layout does not have
    if pp == 1 and parallel.pp_schedule != "gpipe":  # pp_chunks > 1 comes only with interleaving
        unused.append(f"pp_schedule {parallel.pp_schedule!r}")
        changes |= {"pp_schedule": "gpipe", "pp_chunks": None}
    if tp == 1 and parallel.sequence_parallel:
        unused.append("sequence_parallel")
        changes["sequence_parallel"] = False
    if unused:
        reason += f"; unused at tp {tp}, pp {pp}, so left off: {', '.join(unused)}"
    return dataclasses.replace(parallel, **changes), reason  # type: ignore[arg-type]


def resolved_spec(model_fn: ModelFn, units_fn: UnitsFn | None = None, **sections: Any) -> tuple[TrainSpec, str]:
    """`TrainSpec(**sections)` with tp/pp "auto" resolved first (`resolve_parallel`), and the reason; a
    `ConfigError` the chosen layout causes (e.g. max_workers not a multiple of its tp * pp) carries the reason."""
    parallel, reason = resolve_parallel(sections.pop("parallel"), sections["cluster"], model_fn, units_fn)
    try:
        return TrainSpec(parallel=parallel, **sections), reason
    except ConfigError as err:
        if not reason:
            raise
        raise ConfigError(f"{err} ({reason})") from None


def check_model_parallel(
    model_fn: ModelFn,
    tp: int,
    pp: int,
    tp_plan_fn: TPPlanFn | None = None,
    pp_schedule: str = "gpipe",
    pp_chunks: int = 1,
    sequence_parallel: bool = False,
) -> list[str]:
    """Driver-side check of a tp x pp layout on the meta model: the pipeline stages (`pp_chunks` chunks each) can
    be cut, and the TP plan exists and splits every planned layer evenly, on the whole model and on each stage as
    a worker applies it; with `sequence_parallel`, the model has a block list and each colwise layer sits in a
    module below its block (`raytrain.parallel.sequence`).
    Returns the lines to log (none for tp = pp = 1); raises `ConfigError` naming the problem."""
    from raytrain.preflight import build_model_for_check

    def build() -> nn.Module:
        return build_model_for_check(model_fn)

    lines = []
    if tp > 1:
        stages = (lambda: stage_models(build, pp, pp_chunks)) if pp > 1 else None
        whole = build()
        plan = check_tp_plan(whole, tp_plan_fn, tp, stages)
        lines.append(f"tensor parallel: {len(plan)} linear layers split over tp = {tp} workers of a node")
        if sequence_parallel:
            from raytrain.parallel.sequence import sequence_blocks, sequence_modules

            blocks = sequence_blocks(whole)
            gathered = sequence_modules(whole, plan, blocks)
            shown = ", ".join(gathered[:2]) + (", ..." if len(gathered) > 2 else "")
            lines.append(
                f"sequence parallel: the blocks {blocks} hold 1/{tp} of the positions between the split layers; "
                f"{len(gathered)} modules gather their input ({shown})"
            )
    if pp > 1:
        cut = cut_stages(build(), pp * pp_chunks)
        chunked = f" ({pp_chunks} chunks each)" if pp_chunks > 1 else ""
        lines.append(
            f"pipeline parallel: {len(cut.units)} units in {pp} stages{chunked} of "
            f"{', '.join(f'{n:,}' for n in cut.rank_sizes(pp))} parameters ({cut.how}; {pp_schedule} over the "
            "accumulation micro-batches)"
        )
    return lines
