"""The random streams of a step (`raytrain.rng`), in one process: seeds by place, not by rank; tensor-parallel
regions that give each tp rank its own stream, leave the outside stream as it was and survive activation
checkpointing's recompute. The multi-process checks are in test_equivalence.py (dropout at W = 1, 2, 3) and
test_parallel_equivalence.py (tp 2 at dp 1 and 2)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from raytrain.rng import MicroBatchSeeds, TensorParallelRNG, install_tp_rng, micro_batch_seed, stream_seed


def test_seeds_differ_by_every_key_and_fit_63_bits() -> None:
    seeds = {
        micro_batch_seed(s, step, offset, stage)
        for s in (0, 1)
        for step in range(4)
        for offset in range(0, 64, 16)
        for stage in (0, 1)
    }
    assert len(seeds) == 2 * 4 * 4 * 2
    assert all(0 <= s < 2**63 for s in seeds)
    assert stream_seed(1, 2) != stream_seed(2, 1)


def test_micro_batches_are_seeded_by_their_first_sample_in_the_step() -> None:
    """Replica 1 of dp 2 (offset 6, cuts 3+3) seeds its micro-batches as dp 1's micro-batches 2 and 3 are."""

    def draws(seeds: MicroBatchSeeds, j: int) -> torch.Tensor:
        seeds(j)
        return torch.rand(4)

    whole = MicroBatchSeeds(5, 2, 0, (3, 3, 3, 3), 0, None)
    half = MicroBatchSeeds(5, 2, 6, (3, 3), 0, None)
    assert torch.equal(draws(whole, 2), draws(half, 0)) and torch.equal(draws(whole, 3), draws(half, 1))
    assert not torch.equal(draws(whole, 0), draws(whole, 1))
    assert not torch.equal(draws(MicroBatchSeeds(5, 3, 0, (3,), 0, None), 0), draws(whole, 0))  # another step


class Block(nn.Module):
    """A colwise layer, dropout on its output (a region), a rowwise layer, then dropout on the whole output."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)
        self.inside, self.outside = nn.Dropout(0.5), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outside(self.down(self.inside(torch.tanh(self.up(x)))))


def _model(tp_rank: int, checkpointed: bool = False) -> tuple[nn.Module, TensorParallelRNG]:
    torch.manual_seed(0)
    block = Block()
    model = nn.Sequential(block) if not checkpointed else _Checkpointed(block)
    prefix = "0" if not checkpointed else "block"
    return model, install_tp_rng(model, [f"{prefix}.up"], [f"{prefix}.down"], tp_rank, None)


class _Checkpointed(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def _recorder(masks: dict[str, torch.Tensor], key: str) -> Callable[..., None]:
    """A forward hook keeping the first mask (the zeros of the output) of a dropout module under `key`."""

    def record(_module: nn.Module, _inputs: object, out: torch.Tensor) -> None:
        masks.setdefault(key, out == 0)

    return record


def _masks(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    masks: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout):
            module.register_forward_hook(_recorder(masks, name.rsplit(".", 1)[-1]))
    torch.manual_seed(1)
    model(x)
    return masks


def test_a_region_draws_per_tp_rank_and_the_outside_stream_agrees() -> None:
    x = torch.randn(16, 4)
    rank0, rank1 = (_masks(_model(r)[0], x) for r in (0, 1))
    assert rank0["inside"].any() and not torch.equal(rank0["inside"], rank1["inside"])
    assert torch.equal(rank0["outside"], rank1["outside"])


def test_leaving_a_region_restores_the_outside_stream() -> None:
    """After the forward the CPU generator is where the outside stream left it: one draw (the region's seed)
    past the state at the region's entry, whatever the region drew."""
    model, rng = _model(1)
    torch.manual_seed(3)
    model(torch.randn(16, 4))
    after = torch.rand(3)
    torch.manual_seed(3)
    torch.randn(16, 4)
    torch.randint(0, 2**62, (1,))  # the region's seed
    nn.functional.dropout(torch.ones(16, 4), 0.5)  # the outside dropout's draw
    assert torch.equal(after, torch.rand(3))
    assert rng.regions == 1 and not rng.inside


def test_activation_checkpointing_recomputes_the_same_region_masks() -> None:
    """The recompute in the backward restores the outside state and so re-derives the same region seed: the
    gradients equal those of the same forward without checkpointing."""
    x = torch.randn(16, 4)
    grads = []
    for checkpointed in (False, True):
        model, _ = _model(1, checkpointed)
        torch.manual_seed(7)
        model(x).square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_a_region_left_open_is_dropped_not_restored_at_the_next_forward() -> None:
    """A colwise layer called on its own (or a forward that stopped inside a region) leaves the region open; the
    next forward, seeded anew, draws exactly what a fresh model draws (the stale outside state is not restored
    over the new seed)."""
    x = torch.randn(16, 4)
    fresh = _masks(_model(1)[0], x)
    model, rng = _model(1)
    model[0].up(x)  # enters a region that no rowwise layer closes
    assert rng.inside
    again = _masks(model, x)
    assert all(torch.equal(fresh[key], again[key]) for key in ("inside", "outside"))
    assert not rng.inside


def test_a_checkpoint_unit_holding_one_side_of_a_tp_pair_is_not_checkpointed() -> None:
    """Direct children as units (no repeated blocks): the colwise and the rowwise layer are separate units, so
    neither is checkpointed, and the line says so; repeated blocks holding whole pairs are."""
    from raytrain.parallel.apply import _checkpoint_blocks
    from raytrain.toy import GPT

    split = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    line = _checkpoint_blocks(split, {"0": "colwise", "2": "rowwise"})
    assert line is not None and "0, 2 not checkpointed" in line, line
    gpt = GPT()
    assert (
        _checkpoint_blocks(
            gpt, {f"blocks.{i}.{n}": s for i in (0, 1) for n, s in (("fc", "colwise"), ("out", "rowwise"))}
        )
        is None
    )
