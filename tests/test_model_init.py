"""FSDP units found in other libraries' module structures, and ties kept whole by units, tensor parallelism and
pipeline stages; the driver's init choice; the memory tracker; the loop's memory accounting and layout choice
(pure: no process group, no Ray). The init contract itself: `test_init_contract.py`."""

from __future__ import annotations

import pytest
import torch
from test_init_contract import LeavesEmpty
from torch import nn
from user_models import NanoGPT

from raytrain.errors import ConfigError
from raytrain.memory_plan import loop_memory
from raytrain.memory_tracker import LiveBytes
from raytrain.parallel.apply import fsdp_units, has_forward, repeated_blocks, split_ties
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


def test_a_tie_is_never_split_over_fsdp_units() -> None:
    model = NanoGPT()  # wte (root child) tied to lm_head; blocks are ModuleDicts, which FSDP cannot shard
    units, why = fsdp_units(model)
    assert model.wte not in units and model.lm_head not in units
    assert "left to the root (they share a tied parameter" in why and "wte" in why and "lm_head" in why
    assert all(has_forward(unit) for unit in units)
    with pytest.raises(ConfigError, match=r"units_fn puts the tied parameter wte.weight = lm_head.weight in different"):
        fsdp_units(model, lambda m: [m.wte, m.lm_head])
    assert split_ties(model, [model.wpe]) == []


def test_a_tied_layer_cannot_be_split_by_tensor_parallelism() -> None:
    from raytrain.parallel.tensor import resolve_plan
    from raytrain.toy import GPT

    tied = GPT(tie_embeddings=True)
    assert resolve_plan(tied, tied.tp_plan(), 2)  # the plan leaves the head whole
    with pytest.raises(ConfigError, match=r"tp plan: 'head' is colwise but its parameter is tied"):
        resolve_plan(tied, {**tied.tp_plan(), "head": "colwise"}, 2)


def test_a_tie_across_pipeline_stages_needs_one_optimizer_group() -> None:
    from raytrain.preflight import check_stage_ties

    def by_position(model: nn.Module, lr: float) -> torch.optim.Optimizer:  # the first layer at half the LR
        named = list(model.named_parameters())
        first = {"params": [p for n, p in named if n.startswith("0.")], "lr": lr / 2}
        return torch.optim.AdamW([first, {"params": [p for n, p in named if not n.startswith("0.")]}], lr=lr)

    def tied_sequential() -> nn.Module:
        model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 8, bias=False))
        model[3].weight = model[0].weight
        return model

    lines = check_stage_ties(tied_sequential, lambda params, lr: torch.optim.AdamW(params, lr=lr), 2, 1e-3)
    assert lines == [
        "pipeline: 0.weight = 3.weight is tied across stages 0, 1: a copy on each, gradients summed over them"
    ]
    with pytest.raises(
        ConfigError, match=r"gives the tied parameter '0.weight' \(pipeline stage 0\) lr=0.0005 but its"
    ):
        check_stage_ties(tied_sequential, by_position, 2, 1e-3)


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
    assert ddp.parts == {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi}  # grads: views of the buckets
    assert loop_memory(psi, "ddp", 1).parts == {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi}
    # DDP's first step holds the gradients twice before the optimizer's state exists: 12Ψ when the state is smaller
    zero1 = loop_memory(psi, "zero1", 4)
    assert zero1.parts == {"params": 4 * psi, "grads": 4 * psi, "optimizer": 2 * psi, "ddp_first_step": 2 * psi}
    assert loop_memory(psi, "zero1", 2).total == loop_memory(psi, "ddp", 4, optimizer_bytes_per_param=0).total
    assert "ddp_first_step" not in loop_memory(psi, "zero1", 1, optimizer_bytes_per_param=0).parts  # not wrapped
    zero3 = loop_memory(psi, "zero3", 4, largest_unit_params=unit, accumulation_steps=4, grad_accumulation="sharded")
    assert zero3.parts == {
        "params": psi,
        "optimizer": 2 * psi,
        "unit_transient": 20 * unit,
        "grads": psi,
        "new_grad_shard": unit,  # the unit's new shard (4U/W) beside the one it is added to
    }
    whole = loop_memory(psi, "zero3", 4, largest_unit_params=unit, accumulation_steps=4)
    assert whole.parts["accumulated_grads"] == 4 * psi and "grads" not in whole.parts
    bf16 = loop_memory(psi, "zero2", 4, largest_unit_params=unit, precision="bf16")
    assert bf16.parts["gathered"] == 2 * psi  # every unit gathered, in bf16
    # around a unit's backward: its bf16 gradient and the fp32 reduce-scatter input, and the gradient cast to fp32
    assert (bf16.parts["unit_transient"], bf16.parts["grad_cast"]) == (6 * unit, 4 * unit)
    assert "grad_cast" not in loop_memory(psi, "zero2", 4, largest_unit_params=unit).parts  # fp32: nothing to cast
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
    _trainer(GPT2Like).check_user_functions()
    assert "model init: " in capsys.readouterr().out
    meta = _trainer(GPT2Like, init="meta")
    meta.check_user_functions()
    assert meta.meta_init
    assert "model init: recorded on the meta device; each rank replays" in capsys.readouterr().out
    full = _trainer(GPT2Like, init="full")
    full.check_user_functions()
    assert not full.meta_init and "model init: init 'full' was asked for" in capsys.readouterr().out
    forced = _trainer(LeavesEmpty, init="meta")
    with pytest.raises(ConfigError, match=r"init 'meta' is not possible for this model: 'scale' is created with"):
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
