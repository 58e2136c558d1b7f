"""The one multi-process harness of raytrain's tests and benchmarks: W fresh processes, a real process group.

    results = run_world(fn, world, *args)      # fn(rank, world, *args) in every rank; returns [result of rank r]

Each rank joins the default process group (gloo with one intra-op thread, as a Ray Train CPU worker
has; or nccl with CUDA device `rank`), runs `fn`, saves its return value (anything `torch.save` takes) and leaves
the group. An exception in a rank is raised in the caller with that rank's traceback. Processes start from a
forkserver (torch imported once, then every rank forked from it: the isolation of spawn without its seconds of
imports per rank); `RAYTRAIN_TEST_START_METHOD=spawn` uses spawn instead.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

START_METHOD = os.environ.get("RAYTRAIN_TEST_START_METHOD", "forkserver")


def _rank_entry(
    rank: int,
    fn: Callable[..., Any],
    world: int,
    rendezvous: str,
    backend: str,
    timeout_s: float,
    out_dir: str,
    args: tuple[Any, ...],
) -> None:
    import torch
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        backend,
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_world(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    backend: str = "gloo",
    preload: Sequence[str] = ("torch", "raytrain.worker_loop"),
    timeout_s: float = 120.0,
) -> list[Any]:
    """Run `fn(rank, world, *args)` on `world` fresh processes in one process group; return each rank's result in
    rank order. `fn` and `args` must be picklable (module-level). The ranks meet through a file in a fresh
    temporary directory, not a TCP port: no other process can take it between choosing and binding."""
    import torch
    import torch.multiprocessing as mp

    if START_METHOD == "forkserver" and preload:
        multiprocessing.set_forkserver_preload(list(preload))  # ignored once the forkserver runs
    with tempfile.TemporaryDirectory(prefix="raytrain-world-") as out_dir:
        rendezvous = str(Path(out_dir) / "rendezvous")
        entry_args = (fn, world, rendezvous, backend, timeout_s, out_dir, args)
        mp.start_processes(_rank_entry, args=entry_args, nprocs=world, start_method=START_METHOD)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]
