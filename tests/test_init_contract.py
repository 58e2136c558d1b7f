"""The init contract (`raytrain.model_init`), on models written by others: the model raytrain trains starts as the
user's `model_fn()` builds it.

- The full build at W = 1 equals `torch.manual_seed(seed); model_fn()` exactly (through the worker's own
  `build_model` and `apply_parallelism`).
- The sharded build (recorded on meta, replayed per tensor): every deterministic tensor (ties, buffers of any
  dtype, constants, zeros, ones) exactly equal; every random tensor drawn from the distribution the model's own
  init code uses (a two-sample Kolmogorov-Smirnov test against the eager build's values, with a control that the
  test tells 0.02 from torch's default init); ties stay one parameter.
- Both are the same at every W and strategy: zero2, zero3 at W = 2 gather to the W = 1 values bit for bit, ties
  kept, on gloo (tensor and pipeline parallel are covered by `test_parallel_equivalence.py`, whose one-process
  reference starts from the W = 1 values).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from torch import nn
from user_models import FAMILIES, InitPatterns, NanoGPT, llama, resnet

from raytrain.model_init import FULL_BUILD_MAX_BYTES, check_trace, choose_init, materialize, record_build
from raytrain.model_tensors import tie_groups
from raytrain.parallel.apply import apply_parallelism
from raytrain.testing.multiprocess import run_world

SEED = 3
BUILDERS = {**FAMILIES, "patterns": InitPatterns}
W2_FAMILIES = ("nanoGPT", "transformers.Llama-tied", "transformers.ResNet", "patterns")


def _eager(model_fn) -> nn.Module:  # type: ignore[no-untyped-def]
    torch.manual_seed(SEED)
    return model_fn()


def _sharded(model_fn) -> tuple[nn.Module, dict[str, bool]]:  # type: ignore[no-untyped-def]
    """The sharded build at W = 1, and for every tensor name whether its recorded init draws random numbers."""
    built = record_build(model_fn)
    trace = built.trace
    random = {name: any(trace.ops[i].random for i in trace.closure(ref.storage)) for name, ref in trace.tensors.items()}
    materialize(built.model, "cpu", trace, SEED)
    return built.model, random


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical CDFs."""
    a, b = np.sort(a.ravel()), np.sort(b.ravel())
    points = np.concatenate([a, b])
    cdf_a = np.searchsorted(a, points, side="right") / len(a)
    cdf_b = np.searchsorted(b, points, side="right") / len(b)
    return float(np.abs(cdf_a - cdf_b).max())


def same_distribution(a: torch.Tensor, b: torch.Tensor) -> bool:
    """KS test at the 0.1 % level (critical value 1.95 sqrt((n + m) / (n m)))."""
    n, m = a.numel(), b.numel()
    return ks_statistic(a.double().numpy(), b.double().numpy()) < 1.95 * np.sqrt((n + m) / (n * m))


def test_the_distribution_test_tells_a_custom_init_from_torchs_default() -> None:
    """The control: the check below would catch what raytrain did before (GPT-2's embeddings at torch's default
    N(0, 1) instead of transformers' N(0, 0.02); a kaiming-uniform Linear instead of nanoGPT's N(0, 0.02))."""
    gen = torch.Generator().manual_seed(0)
    custom = torch.randn(64, 32, generator=gen) * 0.02
    assert same_distribution(custom, torch.randn(64, 32, generator=gen) * 0.02)
    assert not same_distribution(custom, torch.randn(64, 32, generator=gen))
    assert not same_distribution(custom, nn.Linear(32, 64).weight.detach())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_sharded_build_reproduces_the_model_as_its_own_code_builds_it(family: str) -> None:
    model_fn = FAMILIES[family]
    eager = _eager(model_fn)
    sharded, random = _sharded(model_fn)
    assert check_trace(record_build(model_fn).trace, SEED) is None
    want, got = _tensors(eager), _tensors(sharded)
    assert list(got) == list(want)
    assert tie_groups(sharded) == tie_groups(eager)  # ties stay one parameter
    assert eager.state_dict().keys() == sharded.state_dict().keys()
    compared = 0
    for name, value in want.items():
        assert (got[name].shape, got[name].dtype) == (value.shape, value.dtype), name
        if not random[name]:
            assert torch.equal(got[name], value), f"{name}: a deterministic tensor differs"
        elif value.numel() >= 64:
            assert same_distribution(got[name].detach(), value.detach()), f"{name}: another distribution"
            assert not torch.equal(got[name], value)  # drawn anew, from (seed, operation), not copied
            compared += 1
    assert compared > 0


@pytest.mark.parametrize("family", ["nanoGPT", "transformers.Llama-tied", "transformers.ResNet"])
def test_the_full_build_equals_the_users_model_exactly(family: str) -> None:
    from raytrain.config import (
        BatchConfig,
        CheckpointConfig,
        ClusterConfig,
        LoopConfig,
        LRConfig,
        ParallelConfig,
        TrainSpec,
    )
    from raytrain.toy import sgd, squared_error
    from raytrain.worker_loop import WorkerJob, build_model

    spec = TrainSpec(
        batch=BatchConfig(global_batch=4, micro_batch=4),
        lr=LRConfig(base_lr=0.1),
        loop=LoopConfig(seed=SEED),
        parallel=ParallelConfig(init="full"),
        checkpoint=CheckpointConfig(),
        cluster=ClusterConfig(),
    )
    job = WorkerJob(spec=spec, run_dir=None, model_fn=FAMILIES[family], loss_fn=squared_error, optimizer_fn=sgd)
    model, trace = build_model(job)
    assert trace is None
    model = apply_parallelism(model, "ddp", torch.device("cpu"), 1)
    eager = _eager(FAMILIES[family])
    for (name, value), (_, want) in zip(_tensors(model).items(), _tensors(eager).items(), strict=True):
        assert torch.equal(value, want), name
    assert tie_groups(model) == tie_groups(eager)


def _gathered(rank: int, world: int, family: str, strategy: str) -> dict[str, object]:
    """The model's tensors after the sharded build and `apply_parallelism` at W = `world`, gathered whole."""
    built = record_build(BUILDERS[family])
    model = apply_parallelism(built.model, strategy, torch.device("cpu"), world, init=built.trace, seed=SEED)
    model = getattr(model, "module", model)
    tensors = {
        name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
        for name, t in _tensors(model).items()
    }
    return {"tensors": tensors, "ties": tie_groups(model)}


@functools.cache
def _w1(family: str) -> dict[str, torch.Tensor]:
    return _tensors(_sharded(BUILDERS[family])[0])


def _world_main(rank: int, world: int) -> dict[tuple[str, str], dict[str, object]]:
    return {
        (family, strategy): _gathered(rank, world, family, strategy)
        for family in W2_FAMILIES
        for strategy in ("zero1", "zero2", "zero3")
    }


@pytest.fixture(scope="module")
def at_w2() -> list[dict[tuple[str, str], dict[str, object]]]:
    return run_world(_world_main, 2, preload=("torch", "raytrain.worker_loop", "transformers"))


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("family", W2_FAMILIES)
def test_the_sharded_build_is_the_same_at_every_world_size_and_strategy(
    at_w2: list[dict[tuple[str, str], dict[str, object]]], family: str, strategy: str
) -> None:
    want = _w1(family)
    for rank in at_w2:
        result = rank[family, strategy]
        tensors = result["tensors"]
        assert isinstance(tensors, dict) and list(tensors) == list(want)
        for name, value in want.items():
            assert torch.equal(tensors[name].nan_to_num(7.0), value.nan_to_num(7.0)), f"{name} at W = 2, {strategy}"
        assert result["ties"] == tie_groups(BUILDERS[family]())


class LeavesEmpty(nn.Module):
    """A model whose constructor allocates a parameter with torch.empty and never writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.empty(4))


class ReadsAValue(nn.Module):
    """timm-style: the constructor reads tensor values (`.tolist()`), which no memory-less build can."""

    def __init__(self) -> None:
        super().__init__()
        rates = torch.linspace(0, 0.1, 3).tolist()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in rates)


def test_the_driver_chooses_the_build_and_names_why() -> None:
    small = choose_init("auto", NanoGPT, SEED)
    assert not small.sharded and "built whole on every rank, exactly as model_fn builds it" in small.reason
    assert choose_init("meta", NanoGPT, SEED).sharded
    assert choose_init("auto", NanoGPT, SEED, prefer_sharded=True).sharded
    assert not choose_init("full", resnet, SEED).sharded
    with pytest.raises(
        ValueError, match=r"'scale' is created with torch.empty and model_fn leaves \(part of\) it unset"
    ):
        choose_init("meta", LeavesEmpty, SEED)
    unreadable = choose_init("auto", ReadsAValue, SEED, prefer_sharded=True)
    assert not unreadable.sharded and "model_fn cannot be recorded without memory" in unreadable.reason
    assert FULL_BUILD_MAX_BYTES == 2**30


def test_the_tie_survives_sharding_into_training() -> None:
    """After the sharded build a tied parameter is one parameter: one gradient, one optimizer state, equal after
    a step (W = 1 here; at W = 2 the parallel-equivalence tests train it)."""
    built = record_build(functools.partial(llama, True))
    model = apply_parallelism(built.model, "ddp", torch.device("cpu"), 1, init=built.trace, seed=SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 64, (2, 8))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(1 for p in optimizer.state if p is model.lm_head.weight) == 1


def _reachable(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of `model` by name: parameters, buffers and attribute tensors (`raytrain.model_tensors`)."""
    from raytrain.model_tensors import attribute_tensors

    return {**_tensors(model), **dict(attribute_tensors(model))}


def test_the_sharded_build_reproduces_the_patterns_users_write() -> None:
    """`InitPatterns` (user_models): operations with several outputs keep each output's own values (an index
    buffer stays integers, a var_mean's mean is the mean); draws from generators the constructor controls replay
    exactly (the seeded twin networks start equal to each other and to the eager build; the private generator's
    buffer does not follow the run's seed); trunc_normal_ draws from its truncated distribution; a NaN set on
    purpose is kept; attribute tensors (`_`-named, in a list, a dict, a tuple) come out real. Every tensor but
    the one drawn from the run's seed equals the eager build bit for bit, and so does the forward."""
    from user_models import InitPatterns

    eager = _eager(InitPatterns)
    built = record_build(InitPatterns)
    assert check_trace(built.trace, SEED) is None
    materialize(built.model, "cpu", built.trace, SEED)
    sharded = built.model
    want, got = _reachable(eager), _reachable(sharded)
    assert list(got) == list(want) and {"_scale", "masks.1", "constants.shift", "pair.0"} <= set(got)
    for name, value in want.items():
        assert not got[name].is_meta, name
        if name != "patch":
            assert torch.equal(got[name].nan_to_num(7.0), value.nan_to_num(7.0)), f"{name} differs from eager"
    assert got["sort_order"].dtype == torch.int64 and got["sort_order"].tolist() == [[0, 2, 1, 3], [1, 3, 0, 2]]
    assert torch.isnan(got["missing"]).all()
    patch = got["patch"].detach()
    assert patch.abs().max() <= 0.5 and not torch.equal(patch, want["patch"])
    assert same_distribution(patch, want["patch"].detach())
    for other_seed in (SEED + 1, SEED + 2):  # the private generator's draw: the same whatever the run's seed
        again = record_build(InitPatterns)
        materialize(again.model, "cpu", again.trace, other_seed)
        assert torch.equal(again.model.fixed_noise, want["fixed_noise"])
        assert not torch.equal(again.model.patch, patch)  # the run's seed does move the unseeded draw
    x = torch.randn(5, 8)
    with torch.no_grad():
        sharded.patch.copy_(eager.patch)  # the one random tensor: with it equal, the forwards are equal
        assert torch.equal(sharded(x), eager(x))


def test_what_the_sharded_build_cannot_reproduce_is_named() -> None:
    """Memory left unset (torch.empty never written) is refused naming the tensor, also when only part of it is
    set; NaN set on purpose is not; a lazy module is refused in every init mode with what to do instead."""
    from raytrain.errors import ConfigError

    class PartlySet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.empty(4))
            self.table[:2] = 1.0

    class NanOnPurpose(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(2, 2)
            self.register_buffer("unknown", torch.empty(3).fill_(float("nan")))

    assert check_trace(record_build(PartlySet).trace, SEED) == (
        "'table' is created with torch.empty and model_fn leaves (part of) it unset"
    )
    assert check_trace(record_build(NanOnPurpose).trace, SEED) is None

    def lazy() -> nn.Module:
        return nn.Sequential(nn.LazyLinear(4), nn.Tanh(), nn.Linear(4, 1))

    for mode in ("auto", "meta", "full"):
        with pytest.raises(ConfigError, match=r"lazy module \(LazyLinear: '0.weight' has no shape until its first"):
            choose_init(mode, lazy, SEED)
