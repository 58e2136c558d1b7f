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
from raytrain.ports import free_port


@pytest.mark.parametrize("backend", ["nccl", "NCCL"])
def test_nccl_collectives_use_the_cuda_device(backend: str) -> None:
    assert device_for_backend(backend, cuda_device=3) == torch.device("cuda", 3)


@pytest.mark.parametrize("backend", ["gloo", "mpi", "cpu:gloo"])
def test_other_backends_use_the_cpu(backend: str) -> None:
    assert device_for_backend(backend) == torch.device("cpu")


@pytest.fixture
def gloo_group() -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
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
