"""Building on meta and initialising module by module; FSDP units found in other libraries' module structures;
the memory tracker; the loop's memory accounting and layout choice (pure: no process group, no Ray)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raytrain.errors import ConfigError
from raytrain.memory_plan import loop_memory
from raytrain.memory_tracker import LiveBytes
from raytrain.model_init import build_on_meta, check_init, init_weights
from raytrain.parallel.apply import fsdp_units, repeated_blocks
from raytrain.parallel.strategy import choose_layout, unit_params


class GPT2Like(nn.Module):
    """The nesting of Hugging Face's GPT-2: model.transformer.h[i], embeddings and head outside the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(50, 16)
        self.transformer.h = nn.ModuleList(
            nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True) for _ in range(3)
        )
        self.transformer.ln_f = nn.LayerNorm(16)
        self.lm_head = nn.Linear(16, 50, bias=False)


class LlamaLike(nn.Module):
    """The nesting of Llama-style models: model.model.layers[i], each block with inner lists of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])) for _ in range(4)
        )
        self.head = nn.Linear(8, 3)


def test_repeated_blocks_are_found_wherever_a_library_nests_them() -> None:
    gpt = GPT2Like()
    assert [name for name, _ in repeated_blocks(gpt)] == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    llama = LlamaLike()
    # The outermost list only: the blocks' own inner lists are part of the blocks.
    assert [name for name, _ in repeated_blocks(llama)] == [f"model.layers.{i}" for i in range(4)]
    units, why = fsdp_units(llama)
    assert len(units) == 4 and why == "4 repeated blocks (Sequential) + root"
    sizes = unit_params(llama, units)
    assert sizes == [3 * 72] * 4 + [27]  # each block's own parameters, then what only the root holds (the head)


def test_without_repeated_blocks_units_are_the_direct_children_and_a_hook_overrides() -> None:
    mlp = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    units, why = fsdp_units(mlp)
    assert units == [mlp[0], mlp[2]] and why.startswith("no repeated blocks")
    units, why = fsdp_units(mlp, lambda model: [model[2]])
    assert units == [mlp[2]] and why == "1 units from units_fn"


def test_meta_build_then_init_is_deterministic_and_independent_of_other_modules() -> None:
    def build() -> nn.Module:
        return GPT2Like()

    first, second = build_on_meta(build), build_on_meta(build)
    assert first is not None and second is not None and all(p.is_meta for p in first.parameters())
    for model in (first, second):
        model.to_empty(device="cpu")
        init_weights(model, seed=7)
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    # torch's own initialisation semantics are kept: LayerNorm weights 1, MultiheadAttention's in-proj bias 0.
    assert torch.equal(first.transformer.ln_f.weight, torch.ones(16))
    assert torch.count_nonzero(first.transformer.h[0].self_attn.in_proj_bias) == 0
    # A module's values depend on the seed and its name only: another seed changes them.
    other = build_on_meta(build)
    assert other is not None
    other.to_empty(device="cpu")
    init_weights(other, seed=8)
    assert not torch.equal(other.lm_head.weight, first.lm_head.weight)


class OwnInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(3))  # initialised in __init__ only: lost on meta


class ForgetsBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)
        self.register_buffer("freqs", torch.arange(4.0))

    def reset_parameters(self) -> None:  # resets nothing of its own: `freqs` would be garbage after meta
        pass


def test_check_init_names_the_module_that_cannot_be_initialised_on_meta() -> None:
    for model_fn, message in (
        (lambda: nn.Sequential(nn.Linear(2, 2), OwnInit()), "module '1' (OwnInit) owns parameters or buffers but"),
        (lambda: nn.Sequential(ForgetsBuffer()), "module '0' (ForgetsBuffer): reset_parameters() leaves ['freqs']"),
    ):
        model = build_on_meta(model_fn)
        assert model is not None
        blocker = check_init(model, seed=0)
        assert blocker is not None and blocker.startswith(message), blocker
    assert check_init(build_on_meta(GPT2Like), seed=0) is None  # type: ignore[arg-type]


def test_live_bytes_counts_allocations_frees_and_in_place_resizes() -> None:
    tracker = LiveBytes()
    with tracker:
        a = torch.zeros(1000)  # 4,000 bytes
        b = torch.ones(500, dtype=torch.float64)  # 4,000 bytes
        tracker.mark("two")
        del a
        tracker.mark("one")
        b.untyped_storage().resize_(0)  # how FSDP2 frees an unsharded parameter
        tracker.mark("resized")
    assert tracker.marks["two"] == (8000, 8000)
    assert tracker.marks["one"][0] == 4000
    assert tracker.marks["resized"][0] == 0
    assert tracker.peak == 8000


def test_loop_memory_follows_the_strategies_structure() -> None:
    psi, unit = 1_000_000, 100_000
    ddp = loop_memory(psi, "ddp", 4, largest_unit_params=unit)
    assert ddp.parts == {"params": 4 * psi, "grads": 4 * psi, "ddp_buckets": 4 * psi, "optimizer": 8 * psi}
    assert loop_memory(psi, "ddp", 1).parts == {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi}
    zero3 = loop_memory(psi, "zero3", 4, largest_unit_params=unit, accumulation_steps=4, grad_accumulation="sharded")
    assert zero3.parts == {"params": psi, "optimizer": 2 * psi, "unit_transient": 20 * unit, "grads": psi}
    whole = loop_memory(psi, "zero3", 4, largest_unit_params=unit, accumulation_steps=4)
    assert whole.parts["accumulated_grads"] == 4 * psi and "grads" not in whole.parts
    bf16 = loop_memory(psi, "zero2", 4, largest_unit_params=unit, precision="bf16")
    assert bf16.parts["gathered"] == 2 * psi  # every unit gathered, in bf16
    zero2 = loop_memory(psi, "zero2", 4, largest_unit_params=unit, accumulation_steps=4, grad_accumulation="sharded")
    assert zero3.total < zero2.total < ddp.total
    with pytest.raises(ConfigError, match="grad_accumulation must be unsharded or sharded, got 'auto'"):
        loop_memory(psi, "zero3", 4, grad_accumulation="auto")


def test_auto_layout_takes_the_least_communication_that_fits_and_says_why() -> None:
    psi, unit = 10_000_000, 1_000_000
    kwargs = {"num_params": psi, "largest_unit": unit, "world_size": 4, "accumulation_steps": 4, "precision": "fp32"}
    roomy = choose_layout("auto", "auto", memory_bytes=10**9, **kwargs)  # type: ignore[arg-type]
    assert (roomy.strategy, roomy.grad_accumulation) == ("ddp", "unsharded")
    tight = choose_layout("auto", "auto", memory_bytes=100_000_000, **kwargs)  # type: ignore[arg-type]
    assert tight.strategy == "zero3" and tight.grad_accumulation == "sharded"
    assert "strategy auto -> zero3" in tight.reason and "grad_accumulation auto -> sharded" in tight.reason
    roomier = choose_layout("zero3", "auto", memory_bytes=200_000_000, **kwargs)  # type: ignore[arg-type]
    assert roomier.grad_accumulation == "unsharded" and "within" in roomier.reason
    with pytest.raises(ConfigError, match=r"strategy 'auto': the model .* does not fit on 4 worker"):
        choose_layout("auto", "auto", memory_bytes=10_000_000, **kwargs)  # type: ignore[arg-type]


def _trainer(model_fn, **parallel):  # type: ignore[no-untyped-def]
    from raytrain.config import BatchConfig, LoopConfig, LRConfig, ParallelConfig
    from raytrain.toy import sgd, squared_error
    from raytrain.trainer import ElasticTrainer

    return ElasticTrainer(
        model_fn=model_fn,
        loss_fn=squared_error,
        optimizer_fn=sgd,
        datasets={"train": None},
        batch=BatchConfig(global_batch=8, micro_batch=4),
        lr=LRConfig(base_lr=0.1),
        loop=LoopConfig(strategy=parallel.pop("strategy", "zero3")),
        parallel=ParallelConfig(**parallel),
    )


def test_the_driver_decides_how_workers_build_the_model_and_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    meta = _trainer(GPT2Like)
    meta.check_user_functions()
    assert meta.meta_init
    assert "model init: on the meta device; each rank materializes only its shard" in capsys.readouterr().out
    full = _trainer(lambda: nn.Sequential(nn.Linear(2, 2), OwnInit()))
    full.check_user_functions()
    assert not full.meta_init
    assert "model init: whole on every rank (module '1' (OwnInit) owns parameters" in capsys.readouterr().out
    forced = _trainer(lambda: nn.Sequential(nn.Linear(2, 2), OwnInit()), init="meta")
    with pytest.raises(ConfigError, match=r"init 'meta' is not possible for this model: module '1' \(OwnInit\)"):
        forced.check_user_functions()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"precision": "fp8"}, "precision must be one of fp32, bf16, fp16, got 'fp8'"),
        ({"grad_accumulation": "lazy"}, "grad_accumulation must be one of auto, unsharded, sharded, got 'lazy'"),
        ({"init": "zeros"}, "init must be one of auto, meta, full, got 'zeros'"),
        ({"activation_checkpointing": "yes"}, "activation_checkpointing must be true or false, got 'yes'"),
        ({"precision": "fp16"}, "precision 'fp16' needs strategy ddp or zero1 .* got strategy 'zero3'"),
    ],
)
def test_bad_parallel_options_name_the_field_and_the_valid_values(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _trainer(GPT2Like, **options)
