"""Tests for raytrain.memory_plan: ZeRO accounting, parameter counting, recommendation, validation."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raytrain.errors import ConfigError
from raytrain.memory_plan import (
    BYTES_PER_PARAM,
    GB,
    OPTIMIZER_KINDS,
    STRATEGIES,
    MemoryPlan,
    StateBytes,
    count_parameters,
    format_memory_table,
    model_state_bytes,
    plan_memory,
)

# ---------------------------------------------------------------- accounting


@pytest.mark.parametrize(
    ("strategy", "paper_gb", "exact_gb"),
    [("ddp", 120.0, 120.0), ("zero1", 31.4, 31.40625), ("zero2", 16.6, 16.640625), ("zero3", 1.9, 1.875)],
)
def test_zero_paper_figure_1(strategy: str, paper_gb: float, exact_gb: float) -> None:
    got = model_state_bytes(7_500_000_000, strategy, 64, "mixed_adam")  # type: ignore[arg-type]
    assert got == exact_gb * GB
    # The figure prints one decimal: 1.875 shows as 1.9 (1.3 % off), the others are within 1 %.
    assert round(got / GB, 1) == paper_gb
    assert got / GB == pytest.approx(paper_gb, rel=0.01 if strategy != "zero3" else 0.014)


def test_seed_example_84_gb_ddp_is_10_5_gb_zero3_on_8_gpus() -> None:
    psi = 5_250_000_000
    assert model_state_bytes(psi, "ddp", 8) == 84 * GB
    assert model_state_bytes(psi, "zero3", 8) == 10_500_000_000


def test_bytes_per_param_table() -> None:
    expected = {
        "mixed_adam": StateBytes(2, 2, 12),
        "adam": StateBytes(4, 4, 8),
        "sgd_momentum": StateBytes(4, 4, 4),
        "sgd": StateBytes(4, 4, 0),
    }
    assert expected == BYTES_PER_PARAM
    assert set(BYTES_PER_PARAM) == set(OPTIMIZER_KINDS)
    assert BYTES_PER_PARAM["mixed_adam"].total == 16


@pytest.mark.parametrize(
    ("optimizer", "expected"),
    [
        # Ψ = 1000, N = 4: ddp (p+g+o)Ψ, zero1 (p+g)Ψ + oΨ/N, zero2 pΨ + (g+o)Ψ/N, zero3 (p+g+o)Ψ/N
        ("adam", {"ddp": 16_000, "zero1": 10_000, "zero2": 7_000, "zero3": 4_000}),
        ("sgd_momentum", {"ddp": 12_000, "zero1": 9_000, "zero2": 6_000, "zero3": 3_000}),
        ("sgd", {"ddp": 8_000, "zero1": 8_000, "zero2": 5_000, "zero3": 2_000}),
        ("mixed_adam", {"ddp": 16_000, "zero1": 7_000, "zero2": 5_500, "zero3": 4_000}),
    ],
)
def test_small_model_exact(optimizer: str, expected: dict[str, int]) -> None:
    got = {s: model_state_bytes(1000, s, 4, optimizer) for s in STRATEGIES}  # type: ignore[arg-type]
    assert got == expected


def test_uneven_split_rounds_shards_up() -> None:
    # 10 params over 4 devices: each holds a padded shard of 3 params.
    assert model_state_bytes(10, "zero3", 4, "sgd") == 8 * 3
    assert model_state_bytes(10, "zero1", 4, "adam") == 8 * 10 + 8 * 3


@settings(max_examples=60, deadline=None)
@given(
    psi=st.integers(1, 10**13),
    n=st.integers(1, 4096),
    optimizer=st.sampled_from(OPTIMIZER_KINDS),
)
def test_sharding_order_and_monotone_in_devices(psi: int, n: int, optimizer: str) -> None:
    def at(devices: int) -> list[int]:
        return [model_state_bytes(psi, s, devices, optimizer) for s in STRATEGIES]  # type: ignore[arg-type]

    ddp, zero1, zero2, zero3 = at(n)
    assert zero3 <= zero2 <= zero1 <= ddp
    assert len(set(at(1))) == 1
    assert all(more <= fewer for more, fewer in zip(at(n + 1), at(n), strict=True))


# ---------------------------------------------------------------- count_parameters


def test_count_parameters_sequential() -> None:
    nn = pytest.importorskip("torch.nn")
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert count_parameters(model) == (58, 40)
    model[0].weight.requires_grad_(False)
    assert count_parameters(model) == (26, 18)


def test_count_parameters_rejects_non_module() -> None:
    pytest.importorskip("torch")
    with pytest.raises(ConfigError, match=r"module must be a torch\.nn\.Module, got list"):
        count_parameters([1, 2])  # type: ignore[arg-type]


def test_import_is_torch_and_ray_free() -> None:
    code = "import sys, raytrain.memory_plan; assert not {'torch', 'ray'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- recommendation


def test_no_budget_means_no_recommendation() -> None:
    plan = plan_memory(1000, 4)
    assert plan.recommendation == ""
    assert plan.budget_bytes is None
    assert list(plan.bytes_per_device) == ["ddp", "zero1", "zero2", "zero3"]


# mixed_adam, Ψ = 1e9 on 8 GPUs: ddp 16 GB, zero1 5.5 GB, zero2 3.75 GB, zero3 2 GB.
@pytest.mark.parametrize(
    ("gpu_gb", "largest", "expected"),
    [(16, 0, "ddp"), (6, 0, "zero1"), (4, 0, "zero2"), (2, 0, "zero3"), (3, 250_000_000, "zero3")],
)
def test_recommend_ddp_and_zero_stages(gpu_gb: int, largest: int, expected: str) -> None:
    plan = plan_memory(10**9, 8, gpu_memory_bytes=gpu_gb * GB, reserve_fraction=0, largest_layer_params=largest)
    assert plan.recommendation == expected
    assert plan.budget_bytes == gpu_gb * GB
    assert plan.recommended_bytes is not None and plan.recommended_bytes <= plan.budget_bytes
    assert plan.reason


def test_recommend_tensor_parallel_inside_one_node() -> None:
    # Ψ = 0.8e9 on 8 GPUs, budget 2 GB. zero3 1.6 GB + working set 4 x 1.25e8 = 0.5 GB -> 2.1 GB: too big.
    # tp=2: 4Ψ/2 + 12Ψ/8 = 2.8 GB; tp=4: 0.8 + 1.2 = 2.0 GB fits.
    plan = plan_memory(800_000_000, 8, gpu_memory_bytes=2 * GB, reserve_fraction=0, largest_layer_params=125_000_000)
    assert plan.recommendation == "tp=4"
    assert plan.recommended_bytes == 2 * GB


def test_recommend_tensor_and_pipeline_parallel_across_nodes() -> None:
    # Ψ = 1.6e9 on 2 nodes x 8 GPUs, budget 1.8 GB. zero3 1.6 + 0.4 working set = 2.0 GB: too big.
    # tp=8 (one node): 4Ψ/8 + 12Ψ/16 = 2.0 GB: too big; tp=8,pp=2: 4Ψ/16 + 12Ψ/16 = 1.6 GB fits.
    plan = plan_memory(
        1_600_000_000,
        16,
        gpu_memory_bytes=1_800_000_000,
        gpus_per_node=8,
        reserve_fraction=0,
        largest_layer_params=100_000_000,
    )
    assert plan.recommendation == "tp=8,pp=2"
    assert plan.recommended_bytes == 1_600_000_000


def test_recommend_none_names_devices_needed_for_zero3() -> None:
    # 7.5e9 mixed_adam = 120 GB of model states on one 80 GB GPU (64 GB budget); layer of 2.5e9 gathers 10 GB.
    plan = plan_memory(7_500_000_000, 1, gpu_memory_bytes=80 * GB, largest_layer_params=2_500_000_000)
    assert plan.budget_bytes == 64 * GB
    assert plan.recommendation == "none"
    assert plan.recommended_bytes is None
    # 54 GB left for states: 3 devices hold 40 GB each (fits), 2 devices 60 GB (does not).
    assert "ZeRO-3 would fit on 3 devices" in plan.reason
    assert model_state_bytes(7_500_000_000, "zero3", 3) + 10 * GB <= 64 * GB
    assert model_state_bytes(7_500_000_000, "zero3", 2) + 10 * GB > 64 * GB


def test_recommend_none_when_working_set_alone_is_too_big() -> None:
    plan = plan_memory(10**9, 8, gpu_memory_bytes=GB, reserve_fraction=0, largest_layer_params=10**9)
    assert plan.recommendation == "none"
    assert "working set alone" in plan.reason


def test_bigger_reserve_moves_to_a_later_stage() -> None:
    # Ψ = 1e9 mixed_adam on 8 GPUs of 20 GB; budgets 20, 10, 4, 3.4, 2.6, 1 GB; zero3 gathers 1 GB.
    reserves = (0, 0.5, 0.8, 0.83, 0.87, 0.95)
    recs = [
        plan_memory(
            10**9, 8, gpu_memory_bytes=20 * GB, reserve_fraction=r, largest_layer_params=250_000_000
        ).recommendation
        for r in reserves
    ]
    assert recs == ["ddp", "zero1", "zero2", "zero3", "tp=4", "none"]


_ORDER = ["ddp", "zero1", "zero2", "zero3"]


def _rank(rec: str, gpus_per_node: int, nodes: int) -> int:
    """Position of `rec` in the fixed order the recommendation tries layouts."""
    order = list(_ORDER)
    order += [f"tp={d}" for d in range(2, gpus_per_node + 1) if gpus_per_node % d == 0]
    order += [f"tp={gpus_per_node},pp={s}" for s in range(2, nodes + 1) if nodes % s == 0]
    return order.index(rec) if rec != "none" else len(order)


@settings(max_examples=60, deadline=None)
@given(
    psi=st.integers(1, 10**11),
    gpus_per_node=st.sampled_from([1, 2, 4, 8]),
    nodes=st.integers(1, 6),
    gpu_memory=st.integers(1, 200 * GB),
    largest_share=st.floats(0, 1),
    reserves=st.lists(st.floats(0, 0.99), min_size=2, max_size=4),
    optimizer=st.sampled_from(OPTIMIZER_KINDS),
)
def test_recommendation_never_moves_earlier_as_reserve_grows(
    psi: int,
    gpus_per_node: int,
    nodes: int,
    gpu_memory: int,
    largest_share: float,
    reserves: list[float],
    optimizer: str,
) -> None:
    n = gpus_per_node * nodes
    largest = int(psi * largest_share)
    plans = [
        plan_memory(
            psi,
            n,
            optimizer=optimizer,  # type: ignore[arg-type]
            gpu_memory_bytes=gpu_memory,
            gpus_per_node=gpus_per_node,
            reserve_fraction=r,
            largest_layer_params=largest,
        )
        for r in sorted(reserves)
    ]
    ranks = [_rank(p.recommendation, gpus_per_node, nodes) for p in plans]
    assert ranks == sorted(ranks)
    for p in plans:
        assert p.budget_bytes is not None
        if p.recommendation == "none":
            assert p.recommended_bytes is None
        else:
            assert p.recommended_bytes is not None and p.recommended_bytes <= p.budget_bytes


@settings(max_examples=60, deadline=None)
@given(psi=st.integers(1, 10**11), budget=st.integers(1, 10**11), largest_share=st.floats(0, 1))
def test_none_hint_is_the_smallest_device_count_for_zero3(psi: int, budget: int, largest_share: float) -> None:
    largest = int(psi * largest_share)
    plan = plan_memory(
        psi, 1, gpu_memory_bytes=budget, reserve_fraction=0, largest_layer_params=largest, optimizer="sgd"
    )
    if plan.recommendation != "none" or "would fit on" not in plan.reason:
        return
    devices = int(plan.reason.split("would fit on ")[1].split()[0])
    working_set = 8 * largest

    def zero3_fits(d: int) -> bool:
        return model_state_bytes(psi, "zero3", d, "sgd") + working_set <= budget

    assert zero3_fits(devices)
    assert devices == 1 or not zero3_fits(devices - 1)


# ---------------------------------------------------------------- validation


_LARGEST = r"largest_layer_params must be an integer in \[0, num_params=1000\],"


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"num_params": 0}, r"num_params must be an integer >= 1, got 0"),
        ({"num_params": 7.5e9}, r"num_params must be an integer >= 1, got 7500000000\.0"),
        ({"num_params": True}, r"num_params must be an integer >= 1, got True"),
        ({"num_devices": 0}, r"num_devices must be an integer >= 1, got 0"),
        ({"optimizer": "lamb"}, r"optimizer must be one of mixed_adam, adam, sgd_momentum, sgd, got 'lamb'"),
        ({"gpu_memory_bytes": 0}, r"gpu_memory_bytes must be an integer >= 1, got 0"),
        ({"gpus_per_node": 0}, r"gpus_per_node must be an integer >= 1, got 0"),
        ({"gpus_per_node": 3}, r"gpus_per_node must be an integer >= 1 that divides num_devices=8, got 3"),
        ({"reserve_fraction": 1.0}, r"reserve_fraction must be a number in \[0, 1\), got 1\.0"),
        ({"reserve_fraction": -0.1}, r"reserve_fraction must be a number in \[0, 1\), got -0\.1"),
        ({"reserve_fraction": float("nan")}, r"reserve_fraction must be a number in \[0, 1\), got nan"),
        ({"largest_layer_params": -1}, rf"{_LARGEST} got -1"),
        ({"largest_layer_params": 1001}, rf"{_LARGEST} got 1001"),
    ],
)
def test_plan_memory_rejects_bad_input(kwargs: dict[str, object], pattern: str) -> None:
    args: dict[str, object] = {"num_params": 1000, "num_devices": 8, "gpu_memory_bytes": GB} | kwargs
    with pytest.raises(ConfigError, match=pattern):
        plan_memory(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        ((0, "ddp", 8), r"num_params must be an integer >= 1, got 0"),
        ((10, "ddp", 0), r"num_devices must be an integer >= 1, got 0"),
        ((10, "zero4", 8), r"strategy must be one of ddp, zero1, zero2, zero3, got 'zero4'"),
        ((10, "ddp", 8, "adamw"), r"optimizer must be one of .*, got 'adamw'"),
    ],
)
def test_model_state_bytes_rejects_bad_input(args: tuple[object, ...], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        model_state_bytes(*args)  # type: ignore[arg-type]


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        plan_memory(0, 1)


# ---------------------------------------------------------------- format_memory_table


def test_format_memory_table_with_budget() -> None:
    plan = plan_memory(7_500_000_000, 64, gpu_memory_bytes=80 * GB, gpus_per_node=8)
    table = format_memory_table(plan)
    for strategy in STRATEGIES:
        assert strategy in table
    assert plan.recommendation == "zero1"
    assert "recommendation: zero1 (" in table
    assert plan.reason in table
    rows = {line.split()[0]: line.split() for line in table.splitlines()[1:5]}
    assert rows["ddp"][1:] == ["120", "no"]
    assert rows["zero3"][1:] == ["1.88", "yes"]


def test_format_memory_table_without_budget() -> None:
    plan = plan_memory(125_000_000, 4)
    table = format_memory_table(plan)
    assert all(s in table for s in STRATEGIES)
    assert "fits" not in table
    assert table.splitlines()[-1].startswith("recommendation: - (")


def test_memory_plan_is_frozen() -> None:
    plan = plan_memory(1000, 2)
    assert isinstance(plan, MemoryPlan)
    with pytest.raises(AttributeError):
        plan.recommendation = "ddp"  # type: ignore[misc]
