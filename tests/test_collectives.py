"""The loop's collectives put their tensors on the process group's device: CUDA for nccl (which takes CUDA tensors
only), the CPU for gloo. No machine here has two GPUs, so the rule is tested by itself, and the helpers run on a
real one-process gloo group (they run whenever a group exists, so a one-GPU nccl run exercises them too:
`benchmarks/gpu_check.py`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from raytrain import collectives
from raytrain.collectives import device_for_backend


@pytest.mark.parametrize("backend", ["nccl", "NCCL"])
def test_nccl_collectives_use_the_cuda_device(backend: str) -> None:
    assert device_for_backend(backend, cuda_device=3) == torch.device("cuda", 3)


@pytest.mark.parametrize("backend", ["gloo", "mpi", "cpu:gloo"])
def test_other_backends_use_the_cpu(backend: str) -> None:
    assert device_for_backend(backend) == torch.device("cpu")


@pytest.fixture
def gloo_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one process: no port to race for
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_helpers_run_on_a_real_group_with_the_groups_device(gloo_group: None) -> None:
    assert collectives.collective_device() == torch.device("cpu")
    assert collectives.all_reduce_sum(2.5) == 2.5
    assert collectives.all_reduce_min(7) == 7
    assert collectives.all_gather_ints([1, 2]) == [[1, 2]]
    assert collectives.all_gather_objects({"a": 1}) == [{"a": 1}]


def test_without_a_group_the_helpers_are_identities() -> None:
    assert not dist.is_initialized()
    assert collectives.collective_device() == torch.device("cpu")
    assert collectives.all_reduce_sum(1.25) == 1.25
    assert collectives.all_gather_ints([4]) == [[4]]


def _sum_and_max(rank: int, world: int) -> tuple[float, list[float], float]:
    summed, maxed = collectives.all_reduce_sum_and_max(rank + 0.1, [float(rank), -float(rank), 2.0 - rank])
    return summed, maxed, collectives.all_reduce_sum(rank + 0.1)


def test_the_steps_one_collective_sums_the_loss_and_maxes_the_agreement_on_three_ranks() -> None:
    """The loop's per-step agreement rides in the loss collective: one all-gather gives every rank the same sum
    (as an all-reduce's, to rounding) and the same element-wise maxima."""
    from raytrain.testing.multiprocess import run_world

    results = run_world(_sum_and_max, 3)
    assert all(r[:2] == results[0][:2] for r in results)  # bit-identical on every rank
    summed, maxed, reduced = results[0]
    assert summed == pytest.approx(reduced, abs=1e-12) and summed == pytest.approx(3.3)
    assert maxed == [2.0, 0.0, 2.0]
    assert collectives.all_reduce_sum_and_max(1.5, [3.0]) == (1.5, [3.0])  # no group: the values themselves
