"""The `raytrain` command line.

    raytrain plan --global-batch 1024 --micro-batch 16 --workers 1:12
    raytrain plan --params 7.5e9 --gpus 64 --gpu-memory-gb 80 --gpus-per-node 8 --json

Every bad input ends with one line `raytrain: error: ...` and exit code 2 (a traceback only with --verbose).
Subcommands import what they need when they run, so `raytrain --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import posixpath
import sys
import time
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from raytrain.console import VERBOSE_ENV, counted, leave_interrupt_line_to_caller, say, set_output
from raytrain.errors import ConfigError, UserCodeError
from raytrain.run_lock import run_lock

if TYPE_CHECKING:
    from raytrain.cli.fit_config import FitJob
    from raytrain.trainer import FitResult

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line `raytrain: error: ...` and exit 2 (not the usage block)."""

    def error(self, message: str) -> NoReturn:
        """Print `message` as one line and exit with code 2."""
        where = self.prog.removeprefix("raytrain").strip()
        self.exit(EXIT_USAGE, f"raytrain: error: {where + ': ' if where else ''}{message} (see --help)\n")


def _count(text: str) -> int:
    """Parse a count such as ``7.5e9``, ``125M``, ``1.3B`` or ``1024``."""
    suffixes = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
    scale = suffixes.get(text[-1:].upper(), 1.0)
    number = text[:-1] if scale != 1.0 else text
    try:
        value = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count like 1024, 7.5e9 or 125M, got {text!r}") from None
    if value != int(value):
        raise argparse.ArgumentTypeError(f"expected a whole count, got {text!r}")
    return int(value)


def _degree(text: str) -> int | str:
    """A tp/pp flag: an integer or "auto"."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or 'auto', got {text!r}") from None


def _add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="print the batch plan per world size and the memory table",
        description="Print how a fixed global batch splits over every world size in a range, and/or the "
        "per-device model-state memory of DDP and ZeRO-1/2/3 with a strategy recommendation.",
        epilog="layouts (ParallelConfig tp, pp; --tp/--pp here):\n"
        "  W workers = pp stages x dp replicas x tp shards; TP innermost (tp consecutive ranks on one node), PP\n"
        "  outermost. The batch plan is computed for dp = W / (tp x pp): each replica trains one share of the global\n"
        "  batch and elasticity adds or removes whole replicas (Ray Train's size is rounded down to a multiple of\n"
        "  tp x pp, counting whole TP groups per node). ddp, zero2, zero3 run on the dp axis; zero1 and fp16 do not\n"
        "  combine with tp/pp. tp splits the linear layers a plan names (tp_plan_fn or the model's tp_plan());\n"
        "  pp cuts the model between its blocks (nn.Sequential, transformers decoders, pipeline_split()) into\n"
        "  stages of balanced parameters, GPipe, 1F1B or interleaved 1F1B (pp_schedule, pp_chunks) over the\n"
        "  accumulation micro-batches; streaming mode (deterministic=False) is refused with either.\n\n"
        "examples:\n"
        "  raytrain plan --global-batch 1024 --micro-batch 16 --workers 1:12\n"
        "  raytrain plan --global-batch 96 --micro-batch 16 --workers 2:8 --tp 2\n"
        "  raytrain plan --params 7.5e9 --gpus 64 --gpu-memory-gb 80 --gpus-per-node 8\n"
        "  raytrain plan --global-batch 96 --micro-batch 32 --workers 2:4 --params 125M --gpus 4 --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    batch = p.add_argument_group("batch plan")
    batch.add_argument("--global-batch", type=int, help="effective batch B per optimizer step (fixed)")
    batch.add_argument("--micro-batch", type=int, help="most samples one worker processes per micro-step")
    batch.add_argument("--workers", default=None, help="world sizes to plan for: N or MIN:MAX")
    batch.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default %(default)s)")
    batch.add_argument("--pp", type=int, default=1, help="pipeline stages (default %(default)s)")
    mem = p.add_argument_group("memory plan")
    mem.add_argument("--params", type=_count, help="parameter count, e.g. 7.5e9 or 125M")
    mem.add_argument("--gpus", type=int, help="data-parallel devices N")
    mem.add_argument("--gpu-memory-gb", type=float, help="memory per device in GB (1e9 bytes)")
    mem.add_argument("--gpus-per-node", type=int, help="devices per node (TP stays inside a node)")
    mem.add_argument(
        "--optimizer",
        default="adamw",
        choices=["adamw", "sgd_momentum", "sgd"],
        help="whose fp32 states raytrain keeps: adamw (Adam too) 8 bytes/param, sgd_momentum 4, sgd 0 (default "
        "%(default)s)",
    )
    mem.add_argument(
        "--precision", default="fp32", choices=["fp32", "bf16"], help="compute precision (default %(default)s)"
    )
    mem.add_argument("--largest-layer-params", type=_count, default=0, help="params of the largest layer")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from raytrain.batch_plan import parse_worker_range, plan_batch

    want_batch = any(v is not None for v in (args.global_batch, args.micro_batch, args.workers))
    want_memory = any(v is not None for v in (args.params, args.gpus, args.gpu_memory_gb))
    if not want_batch and not want_memory:
        raise ConfigError(
            "plan needs --global-batch/--micro-batch/--workers (batch plan) or --params/--gpus (memory plan)"
        )
    out: dict[str, object] = {}
    lines: list[str] = []
    if want_batch:
        for flag, value in (("--global-batch", args.global_batch), ("--micro-batch", args.micro_batch)):
            if value is None:
                raise ConfigError(f"{flag} is required for the batch plan")
        from raytrain.config import ParallelConfig

        replica = ParallelConfig(tp=args.tp, pp=args.pp).replica
        low, high = parse_worker_range(args.workers or str(replica))
        worlds = [w for w in range(low, high + 1) if w % replica == 0]
        if not worlds:
            raise ConfigError(f"--workers {low}:{high} holds no multiple of tp x pp = {replica}")
        plans = [plan_batch(args.global_batch, args.micro_batch, w // replica) for w in worlds]
        out["batch"] = [{**plan.to_dict(), "workers": w} for w, plan in zip(worlds, plans, strict=True)]
        if replica > 1:
            lines.append(f"tp {args.tp}, pp {args.pp}: the plan is per data-parallel replica of {replica} workers")
            lines.append(f"{'W':>4} {'dp':>4} {'k':>5} {'max micro':>9} {'global':>7}  samples per replica")
        else:
            lines.append(f"{'W':>4} {'k':>5} {'max micro':>9} {'global':>7}  samples per rank")
        for w, plan in zip(worlds, plans, strict=True):
            samples = " ".join(str(n) for n in plan.per_rank_samples)
            dp = f"{plan.world_size:>4} " if replica > 1 else ""
            lines.append(
                f"{w:>4} {dp}{plan.accumulation_steps:>5} {plan.max_micro_batch:>9} "
                f"{sum(plan.per_rank_samples):>7}  {samples}"
            )
    if want_memory:
        for flag, value in (("--params", args.params), ("--gpus", args.gpus)):
            if value is None:
                raise ConfigError(f"{flag} is required for the memory plan")
        if args.gpu_memory_gb is not None and not args.gpu_memory_gb > 0:
            raise ConfigError(f"--gpu-memory-gb must be > 0, got {args.gpu_memory_gb}")
        if lines:
            lines.append("")
        lines += _memory_plan(args, out)
    print(json.dumps(out) if args.json else "\n".join(lines))
    return 0


OPTIMIZER_STATE_BYTES = {"adamw": 8, "sgd_momentum": 4, "sgd": 0}  # per parameter, fp32, as raytrain keeps them


def _memory_plan(args: argparse.Namespace, out: dict[str, object]) -> list[str]:
    """The memory part of `raytrain plan`: each strategy's peak per device as raytrain's loop allocates it
    (`raytrain.memory_plan.loop_memory`: fp32 parameters and gradients, the optimizer's fp32 states, the gathered
    units), and one recommendation, the layout raytrain itself would choose: `strategy="auto"`'s pick among ddp,
    zero2 and zero3, else tp/pp `auto`'s layout, else none; then what the other optimizers would change."""
    from raytrain.memory_plan import GB, loop_memory
    from raytrain.parallel.layout import choose_layout as choose_model_parallel
    from raytrain.parallel.strategy import RESERVE_FRACTION, choose_layout

    memory = None if args.gpu_memory_gb is None else int(args.gpu_memory_gb * 1e9)

    def peaks(state_bytes: int) -> dict[str, int]:
        return {
            name: loop_memory(
                args.params,
                name,
                args.gpus,
                largest_unit_params=args.largest_layer_params,
                optimizer_bytes_per_param=state_bytes,
                precision=args.precision,
            ).total
            for name in ("ddp", "zero1", "zero2", "zero3")
        }

    def recommend(optimizer: str) -> tuple[str, str]:
        assert memory is not None
        try:
            layout = choose_layout(
                "auto",
                "unsharded",
                num_params=args.params,
                largest_unit=args.largest_layer_params,
                world_size=args.gpus,
                accumulation_steps=1,
                precision=args.precision,
                memory_bytes=memory,
                optimizer_kind=optimizer,
            )
            return layout.strategy, layout.reason.removeprefix("strategy auto -> ")
        except ConfigError:
            pass
        try:
            tp, pp, why = choose_model_parallel(
                num_params=args.params,
                largest_unit=args.largest_layer_params,
                min_workers=args.gpus,
                workers_per_node=args.gpus_per_node or args.gpus,
                device_memory_bytes=memory,
            )
            return f"tp={tp},pp={pp}", f"no data-parallel strategy fits; {why} (counted with AdamW's states)"
        except ConfigError as err:
            return "none", str(err)

    table = peaks(OPTIMIZER_STATE_BYTES[args.optimizer])
    out["memory"] = table
    lines = [
        f"peak per device as raytrain allocates it: fp32 parameters and gradients and {args.optimizer}'s fp32 states "
        f"({OPTIMIZER_STATE_BYTES[args.optimizer]} bytes/param), compute in {args.precision}, largest FSDP unit "
        f"{args.largest_layer_params:,} parameters; activations not counted"
    ]
    budget = None if memory is None else memory * (1 - RESERVE_FRACTION)
    header = f"{'strategy':<9} {'GB/device':>10}" + ("" if budget is None else f"  fits {budget / GB:.3g} GB budget?")
    lines.append(header)
    for name, size in table.items():
        fits = "" if budget is None else ("  yes" if size <= budget else "  no")
        lines.append(f"{name:<9} {size / GB:>10.3g}{fits}")
    if memory is None:
        lines.append("recommendation: give --gpu-memory-gb to get one")
        return lines
    choice, why = recommend(args.optimizer)
    out["recommendation"] = choice
    lines.append(f"recommendation: {choice} ({why}; zero1 is never chosen: raytrain's zero2 holds less)")
    others = {name: recommend(name)[0] for name in OPTIMIZER_STATE_BYTES if name != args.optimizer}
    out["recommendation_by_optimizer"] = {args.optimizer: choice, **others}
    lines.append("with another optimizer: " + ", ".join(f"{name} -> {pick}" for name, pick in others.items()))
    return lines


def _add_demo_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="elastic training on an embedded local cluster of fake nodes, with a shrink and a grow",
        description="Start a local Ray cluster of fake CPU nodes (no set-up), train a small model with a fixed "
        "global batch, apply membership events, then print a summary and write a loss/world-size plot.",
        epilog="examples:\n"
        "  raytrain demo\n"
        "  raytrain demo --events 'kill@10,remove@25,add@45' --audit-samples --json\n"
        "  raytrain demo --nodes 2 --workers 2 --events none --steps 30\n"
        "  raytrain demo --autoscale                 # nodes from Ray's autoscaler, one spot reclaim\n"
        "  raytrain demo --tp 2 --nodes 2            # tensor parallel, 2 slots per node: W 4 -> 2 -> 4\n"
        "  raytrain demo --pp 2 --nodes 4            # pipeline parallel across nodes: W 4 -> 2 -> 4\n"
        "  raytrain demo --recovery live --events kill@15,kill@35   # survivors never restart",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nodes", type=int, default=3, help="fake nodes (default %(default)s)")
    p.add_argument(
        "--slots-per-node",
        type=int,
        default=None,
        help="worker slots per fake node; removing a node removes this many workers (default: tp)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel degree: the MLP's layers split over tp workers of one node; the world grows and "
        "shrinks in whole replicas of tp workers (with --recovery live: inside each replica group; default "
        "%(default)s)",
    )
    p.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline stages: the MLP cut in pp stages on pp workers (GPipe over the accumulation micro-batches); "
        "a replica is tp x pp workers (default %(default)s)",
    )
    p.add_argument(
        "--workers",
        default=None,
        help="elastic range MIN:MAX or a fixed N (default 1:3; with --tp or --pp: tp x pp:nodes x slots-per-node)",
    )
    p.add_argument("--global-batch", type=int, default=96, help="effective batch per step (default %(default)s)")
    p.add_argument("--micro-batch", type=int, default=16, help="per-worker micro-batch cap (default %(default)s)")
    p.add_argument("--steps", type=int, default=240, help="optimizer steps (default %(default)s)")
    p.add_argument(
        "--epoch-steps",
        type=int,
        default=50,
        help="steps per epoch: the synthetic data set has global-batch x this many rows (default %(default)s)",
    )
    p.add_argument(
        "--sample-time",
        type=float,
        default=0.003,
        help="simulated compute seconds per sample, so the toy model trains at a real model's pace and events "
        "land mid-run; 0 to train at full speed (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--storage", default="raytrain_runs", help="directory for runs (default %(default)s)")
    p.add_argument("--run-name", default="", help="run directory name (default: demo-<timestamp>)")
    p.add_argument("--strategy", default="ddp", choices=["ddp", "zero1", "zero2", "zero3", "auto"])
    p.add_argument(
        "--dp-shard",
        type=int,
        default=1,
        help="with --recovery live: data ranks per replica group, sharding the model with --strategy zero2/zero3 "
        "(HSDP; with --tp each is tp workers; the world grows and shrinks by whole groups; default %(default)s)",
    )
    p.add_argument("--checkpoint-every", type=int, default=5, help="steps between checkpoints (default %(default)s)")
    p.add_argument(
        "--background-save",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write checkpoint files in a background thread (CheckpointConfig.background_save; default: on)",
    )
    p.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Parquet files read in place in an order from (seed, epoch) only, identical at every world size "
        "(default: on); --no-deterministic streams a Ray dataset instead",
    )
    p.add_argument("--audit-samples", action="store_true", help="write samples.jsonl and check it at the end")
    p.add_argument(
        "--events",
        default=None,
        help="KIND@STEP,... with KIND remove|add|kill|drain (drain: announce the removal 8 s ahead, then remove), "
        "with --autoscale kill|drain|reclaim (reclaim: the node provider takes a node back without notice), "
        "or none (default remove@20,add@60; with --autoscale reclaim@60)",
    )
    p.add_argument(
        "--autoscale",
        action="store_true",
        help="start with the head and cluster.yaml's min_workers nodes only and let Ray's autoscaler (fake local "
        "provider, cluster.yaml's node types scaled to 1 CPU) add nodes for the trainer's demand, replace a "
        "reclaimed one and remove idle ones after training",
    )
    p.add_argument(
        "--cluster-yaml",
        default="",
        help="node types for --autoscale (default: the cluster.yaml shipped with raytrain)",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=10.0,
        help="--autoscale: seconds before an idle worker node is removed (cluster.yaml: 5 minutes; default "
        "%(default)s)",
    )
    p.add_argument(
        "--faults",
        default="",
        help="inject worker crashes (SIGKILL) at RANK:STEP:PHASE,... or random:SEED:COUNT:LAST_STEP, PHASE in forward, "
        "backward, optimizer, checkpoint, report (see raytrain/faults.py)",
    )
    p.add_argument(
        "--recovery",
        choices=["restart", "live"],
        default="restart",
        help="restart: Ray Train restarts the worker group from the last checkpoint (default); live: torchft "
        "replica groups, a killed worker's peers finish the step with the same global batch and never restart, "
        "a replacement heals from a peer (needs the live extra)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON summary object at the end")
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from raytrain.batch_plan import parse_worker_range
    from raytrain.cli.demo import DemoOptions, run_demo

    slots = args.slots_per_node if args.slots_per_node is not None else max(1, args.tp)
    replica = max(1, args.tp) * max(1, args.pp)
    default_workers = "1:3" if replica == 1 and slots == 1 else f"{replica}:{args.nodes * slots}"
    low, high = parse_worker_range(args.workers if args.workers is not None else default_workers)
    if args.faults:
        from raytrain.faults import ENV, parse_faults

        parse_faults(args.faults)  # a bad spec fails here, not in the workers
        os.environ[ENV] = args.faults  # the workers get it with the job (`raytrain.trainer.worker_env`)
    args.run_name = args.run_name or time.strftime("demo-%Y%m%d-%H%M%S")
    args.run_dir = os.path.join(os.path.abspath(args.storage), args.run_name)  # for an interruption's message
    options = DemoOptions(
        nodes=args.nodes,
        slots_per_node=slots,
        tp=args.tp,
        pp=args.pp,
        min_workers=low,
        max_workers=high,
        global_batch=args.global_batch,
        micro_batch=args.micro_batch,
        steps=args.steps,
        seed=args.seed,
        storage=args.storage,
        run_name=args.run_name,
        deterministic=args.deterministic,
        audit_samples=args.audit_samples,
        events=args.events if args.events is not None else ("reclaim@60" if args.autoscale else "remove@20,add@60"),
        autoscale=args.autoscale,
        cluster_yaml=args.cluster_yaml,
        idle_timeout_s=args.idle_timeout,
        strategy=args.strategy,
        checkpoint_every=args.checkpoint_every,
        background_save=args.background_save,
        sample_time_s=args.sample_time,
        epoch_steps=args.epoch_steps,
        recovery=args.recovery,
        dp_shard=args.dp_shard,
    )
    summary = run_demo(options)
    if args.json:
        print(json.dumps(summary))
    else:
        print(format_summary(summary))
    return 0


def format_audit(report: dict[str, dict[str, int]]) -> str:
    """The demo's sample audit (`audit_epochs`: per completed epoch, ids duplicated and missing) for people:
    "epochs 0-3: every sample exactly once", else each epoch that was not, with its counts."""
    if not report:
        return "no epoch completed"
    epochs = sorted(int(epoch) for epoch in report)
    span = f"epoch {epochs[0]}" if len(epochs) == 1 else f"epochs {epochs[0]}-{epochs[-1]}"
    wrong = [(e, report[str(e)]) for e in epochs if report[str(e)]["duplicates"] or report[str(e)]["missing"]]
    if not wrong:
        return f"{span}: every sample exactly once"
    return "; ".join(f"epoch {e}: {c['duplicates']} duplicated, {c['missing']} missing" for e, c in wrong)


def format_summary(summary: dict[str, Any]) -> str:
    """The demo's summary for people."""
    lines = [
        f"run directory   {summary['run_dir']}",
        f"steps           {summary['steps']} in {summary['wall_s']} s, final loss {summary['final_loss']:.4f}",
        f"global batch    {summary['global_batch_sizes']} at every step",
        f"world sizes     {' -> '.join(str(w) for w in summary['world_sizes'])} ({summary['restarts']} restarts)",
    ]
    live = summary.get("live")
    for event in summary["events"]:
        if live is not None:
            recovered = (
                f"the next step committed at world {event['recovered_world_size']} {event['recovery_s']:.2f} s later"
                if event["recovered_time"]
                else "no step committed after it"
            )
            if event.get("grown_s") is not None:
                recovered += f"; a new group trained from {event['grown_s']:.2f} s after it"
        elif event["recovered_time"]:
            recovered = (
                f"training again at world {event['recovered_world_size']} after {event['recovery_s']:.1f} s, "
                f"{counted(event['steps_lost'], 'step')} retrained"
            )
        else:
            recovered = "no restart observed"
        lines.append(f"event           {event['kind']} at step {event['applied_step']}: {event['detail']}; {recovered}")
    if live is not None:
        finished = ", ".join(f"{r['replica']} (pid {r['pid']}, from step {r['first_step']})" for r in live["finished"])
        lines.append(
            f"live            {len(live['lost'])} replica(s) lost, {len(live.get('left', []))} left ahead of a drain, "
            f"{live['steps_retrained']} step(s) trained again, {live['restarts']} fallback restart(s); ran to the "
            f"end: {finished}"
        )
    for note in summary["skipped_events"]:
        lines.append(f"skipped         {note}")
    if "autoscale" in summary:
        auto = summary["autoscale"]
        launched = ", ".join(f"{n} x {t}" for t, n in auto["launched_by_type"].items()) or "none"
        lines.append(f"autoscaler      launched {launched}; at full size {auto['grow_s']} s after the start")
        for item in auto["replace"]:
            lines.append(
                f"replacement     node {item['node'][-8:]} reclaimed: back at world {item['world_size_before']} "
                f"after {item['replace_s']} s"
            )
        down = auto["scale_down_s"]
        lines.append(
            "scale-down      "
            + (f"no worker node left {down} s after training" if down is not None else "idle nodes NOT removed")
        )
    if "audit" in summary:
        lines.append(f"audit           {format_audit(summary['audit'])}")
    lines.append(f"plot            {summary['plot']}")
    return "\n".join(lines)


def _add_fit_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "fit",
        help="train from a TOML config file (on RAY_ADDRESS's cluster, or a local Ray instance)",
        description="Run a training job described by a TOML file (its keys: docs/config.md). "
        "Flags override the file. With RAY_ADDRESS set (as under `ray job submit`) it trains on that cluster; "
        "otherwise it starts a local Ray instance.",
        epilog="examples:\n"
        "  raytrain fit examples/fit_mlp.toml --dry-run\n"
        "  raytrain fit examples/fit_mlp.toml --workers 2:3 --steps 40 --storage /tmp/runs\n"
        "  ray job submit --address http://127.0.0.1:8265 --working-dir . -- raytrain fit examples/fit_mlp.toml",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="path to the TOML file")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run every check a real start runs (storage, your functions on the model, the data and loss_fn on real "
        "rows, pretrained weights, the cluster's room) and print the plan; no worker starts",
    )
    p.add_argument("--workers", help="override [cluster] min/max_workers: MIN:MAX or N")
    p.add_argument("--global-batch", type=int, help="override [batch] global_batch")
    p.add_argument("--micro-batch", type=int, help="override [batch] micro_batch")
    p.add_argument("--steps", type=int, help="override [loop] max_steps")
    p.add_argument("--epochs", type=int, help="override [loop] epochs")
    p.add_argument("--strategy", help="override [loop] strategy")
    p.add_argument("--seed", type=int, help="override [loop] seed")
    p.add_argument(
        "--storage", help="override [checkpoint] storage_path: a directory or a URI such as s3://bucket/runs"
    )
    p.add_argument("--log-dir", help="override [checkpoint] log_dir: where a URI storage's run files go")
    p.add_argument(
        "--tp", type=_degree, help="override [parallel] tp (tensor-parallel degree, or auto: tp and pp chosen together)"
    )
    p.add_argument("--pp", type=_degree, help="override [parallel] pp (pipeline stages, or auto)")
    p.add_argument("--run-name", help="override [checkpoint] run_name")
    p.add_argument("--json", action="store_true", help="print one JSON summary object at the end")
    p.set_defaults(run=_run_fit)


def _fit_overrides(args: argparse.Namespace) -> dict[str, dict[str, object]]:
    from raytrain.batch_plan import parse_worker_range

    table = {
        "batch": {"global_batch": args.global_batch, "micro_batch": args.micro_batch},
        "loop": {"max_steps": args.steps, "epochs": args.epochs, "strategy": args.strategy, "seed": args.seed},
        "checkpoint": {"storage_path": args.storage, "run_name": args.run_name, "log_dir": args.log_dir},
        "cluster": {},
        "parallel": {"tp": args.tp, "pp": args.pp},
    }
    if "auto" in (args.tp, args.pp) and None in (args.tp, args.pp):  # tp and pp are chosen together
        table["parallel"] = {"tp": "auto", "pp": "auto"}
    if args.workers:
        low, high = parse_worker_range(args.workers)
        table["cluster"] = {"min_workers": low, "max_workers": high}
    return {section: {k: v for k, v in values.items() if v is not None} for section, values in table.items()}


def _run_fit(args: argparse.Namespace) -> int:
    from raytrain.cli.fit_config import describe_plan, parse_fit_config
    from raytrain.trainer import check_ray_address, check_resumable, check_storage

    job = parse_fit_config(args.config, _fit_overrides(args))
    args.run_dir, args.storage_at = check_storage(job.spec)  # before any Ray process starts, in --dry-run too
    check_resumable(args.storage_at)
    check_ray_address()
    if args.dry_run:  # every check of a real start, then the plan; no worker starts
        _make_trainer(job, dashboard=False).check()
        print(describe_plan(job))
        return 0
    with run_lock(args.run_dir):  # before Ray starts: a second `raytrain fit` of the same run refuses at once
        return _train_fit(job, args)


def _make_trainer(job: FitJob, dashboard: bool = True) -> Any:
    """The `ElasticTrainer` of a parsed config file (its datasets built on the driver, Ray started for them; a
    local instance without its dashboard when `dashboard` is False: a dry run trains nothing)."""
    from raytrain.trainer import ElasticTrainer

    if job.layout_reason:
        say(job.layout_reason)
    return ElasticTrainer(
        model_fn=job.entries["model"],
        loss_fn=job.entries["loss"],
        optimizer_fn=job.entries["optimizer"],
        datasets=_build_datasets(job, dashboard),
        batch=job.spec.batch,
        lr=job.spec.lr,
        loop=job.spec.loop,
        checkpoint=job.spec.checkpoint,
        cluster=job.spec.cluster,
        parallel=job.spec.parallel,
        required_columns=job.required_columns,
        lr_schedule_fn=job.entries.get("lr_schedule"),
        tp_plan_fn=job.entries.get("tp_plan"),
        init_from=job.init_from,
        init_key_map=job.entries.get("init_key_map"),
        init_missing=job.init_missing,
        init_unexpected=job.init_unexpected,
    )


def _train_fit(job: FitJob, args: argparse.Namespace) -> int:
    trainer = _make_trainer(job)
    started = time.time()
    result = trainer.fit()
    summary = fit_summary(result, started)
    print(json.dumps(summary) if args.json else format_fit_summary(summary))
    return 0


def format_fit_summary(summary: dict[str, Any]) -> str:
    """`raytrain fit`'s summary for people, laid out as the demo's (`format_summary`)."""
    start = summary["resumed_from_step"]
    loss = summary["final_loss"]
    sizes = summary["world_sizes"]
    return "\n".join(
        [
            f"run directory   {summary['run_dir']}",
            f"steps           {summary['steps']}"
            + (f" (resumed from step {start})" if start else " (from the start)")
            + (f", final loss {loss:.4f}" if loss is not None else "")
            + (f", val_loss {summary['val_loss']:.4f}" if summary.get("val_loss") is not None else "")
            + (f", last epoch {summary['last_epoch']}" if summary["last_epoch"] is not None else ""),
            f"world sizes     {' -> '.join(str(w) for w in sizes) or '-'} ({summary['restarts']} restarts)",
            f"checkpoint      {summary['checkpoint'] or 'none'}",
        ]
    )


def _build_datasets(job: FitJob, dashboard: bool = True) -> dict[str, Any]:
    """Call the datasets builder after Ray is up (a local instance, sized for the run, with its dashboard unless
    `dashboard` is False, unless RAY_ADDRESS names a cluster)."""
    from raytrain.trainer import connect_ray, local_cpus, local_cpus_reason

    connect_ray(local_cpus(job.spec), local_cpus_reason(job.spec), dashboard=dashboard)
    datasets = job.entries["datasets"]()
    if not isinstance(datasets, dict) or "train" not in datasets:
        raise ConfigError(
            f"the datasets entry must return a dict with a 'train' dataset, got {type(datasets).__name__}"
        )
    return datasets


def fit_summary(result: FitResult, since: float) -> dict[str, Any]:
    """The end-of-run summary of this invocation (worker-group starts after `since`, a `time.time()`): steps,
    the last step's epoch, the world sizes, restarts, final loss and validation loss, where things are."""
    from raytrain.rank0 import read_jsonl

    metrics = read_jsonl(result.metrics_path)
    starts = [s for s in read_jsonl(result.events_path) if s.get("time", 0) >= since]
    return {
        "run_dir": result.run_dir,
        "resumed_from_step": starts[0]["step"] if starts else None,
        "steps": metrics[-1]["step"] if metrics else 0,
        "last_epoch": metrics[-1]["epoch"] if metrics else None,
        "world_sizes": [s["world_size"] for s in starts],
        "restarts": max(0, len(starts) - 1),
        "final_loss": metrics[-1]["loss"] if metrics else None,
        "val_loss": metrics[-1].get("val_loss") if metrics else None,  # the final validation, on the last line
        "checkpoint": (
            f"{result.storage_uri or result.run_dir}/{posixpath.basename(result.checkpoint.path)}"
            if result.checkpoint is not None
            else None
        ),
    }


def _resume_hint(args: argparse.Namespace) -> str:
    """Where the checkpoint a resume restores is (the newest of either recovery mode: Ray Train's last committed
    one or a whole live one; a newer one may have been written but never committed) and the command that resumes
    from it, or, before the first checkpoint, the command that starts the run again (one line)."""
    import shlex

    import pyarrow.fs as pafs

    from raytrain.storage import RunStorage

    if args.command == "export":
        return f"{args.out_dir} may hold part of the files: run the export again with --overwrite"
    run_dir = getattr(args, "run_dir", None)
    fit_storage = getattr(args, "storage_at", None)  # `raytrain fit`: its checkpoints may be on object storage
    storage = fit_storage or (RunStorage(pafs.LocalFileSystem(), run_dir, run_dir) if run_dir else None)  # demo
    where = storage.uri if storage is not None else None
    try:
        found = storage.newest_checkpoint() if storage is not None else None
    except OSError as err:  # object storage unreachable while interrupted: say so, never a traceback
        return f"the latest checkpoint in {where} could not be read ({err})"
    command = ["raytrain", *sys.argv[1:]]
    if args.command == "demo" and "--run-name" not in command:
        command += ["--run-name", args.run_name]
    if found is None and where is None:  # a command without a run (`plan`)
        return "no run to resume"
    if found is None:
        return f"no checkpoint was written in {where} yet; the same command starts from step 0: {shlex.join(command)}"
    step, path = found
    if fit_storage is not None:
        path = f"{fit_storage.uri}/{posixpath.basename(path)}"
    return f"the last checkpoint is {path} (step {step}); resume with: {shlex.join(command)}"


def build_parser() -> argparse.ArgumentParser:
    """The `raytrain` argument parser with all subcommands."""
    parser = OneLineErrorParser(
        prog="raytrain",
        description="Elastic distributed PyTorch training on Ray: the effective batch, LR and sample order "
        "stay the same when workers join or leave.",
        epilog="examples:\n"
        "  raytrain demo                                     # elastic training on fake local nodes, ~2 min\n"
        "  raytrain plan --global-batch 1024 --micro-batch 16 --workers 1:12\n"
        "  raytrain fit examples/fit_mlp.toml --dry-run      # check a job and print its plan\n"
        "  raytrain fit examples/fit_mlp.toml --workers 2    # train it (local Ray, or RAY_ADDRESS's cluster)\n"
        "each command has --help with more examples",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--verbose", action="store_true", help="show Ray's own output (workers, controller, raylets) and tracebacks"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_plan_parser(subparsers)
    _add_demo_parser(subparsers)
    _add_fit_parser(subparsers)
    from raytrain.cli.export_cmd import add_export_parser

    add_export_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `raytrain` console script; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    if args.verbose:
        os.environ[VERBOSE_ENV] = "1"  # Ray's own output on the driver (`raytrain.console`)
    if getattr(args, "json", False):
        set_output(sys.stderr)  # stdout carries the JSON object only
    leave_interrupt_line_to_caller(True)  # Ctrl-C: one line, below, with the command that resumes
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        print(f"raytrain: interrupted; {_resume_hint(args)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ConfigError, UserCodeError) as err:
        if args.verbose:  # the whole traceback (the worker's, for a bug in a worker) above the same line and code
            print(getattr(err, "worker_traceback", None) or traceback.format_exc().rstrip(), file=sys.stderr)
        print(f"raytrain: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        leave_interrupt_line_to_caller(False)  # a caller of main() in the same process gets fit()'s line again


if __name__ == "__main__":
    sys.exit(main())
