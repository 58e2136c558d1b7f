"""Sequence parallel (Megatron-SP, torch's `SequenceParallel`): between the tensor-parallel regions, each tp rank
holds a slice of the sequence instead of the whole activation.

Without it, the residual stream, the norms and the dropout outside the split layers run on the whole [n, T, d]
activation on every tp rank (the same values tp times). With `ParallelConfig(sequence_parallel=True)`:
- the first block of a stage (or chunk) takes this rank's slice of the T positions (`_Split`; its backward
  gathers the gradient), the last gathers them again (`_Gather`; backward: this rank's slice of the gradient);
- each module holding colwise layers (an attention, an MLP) gathers its input (`_Gather`: the colwise layers'
  input-gradient all-reduce already makes its gradient whole) and each rowwise layer reduce-scatters its output
  over the sequence (`RowwiseParallel(output_layouts=Shard(1))`) instead of all-reducing it;
- the norms and other parameters inside the blocks that tensor parallelism leaves whole see this rank's positions
  only: their gradients are summed over the tp ranks after the backward (`sum_sequence_gradients`);
- every random op between the split and the join draws from this tp rank's own stream
  (`raytrain.rng.install_rank_stream`): a dropout mask on a sequence slice must differ between the slices, while
  one on the whole sequence (an embedding's dropout before the split) must be the same on every tp rank.
So activation memory outside the split layers falls by tp, for one all-gather and one reduce-scatter per pair in
place of one all-reduce (the same bytes). The model must call each colwise layer's parent module with the hidden
states as its first positional argument or as `hidden_states=` (transformers' decoders do), and hold its colwise
layers in such a module below the block (`self_attn`, `mlp`): a block computing attention in its own forward
(raytrain's toy GPT) sees T / tp positions and is refused. T must be a multiple of tp: checked on the driver before
any worker starts (`SequenceProbe`, in the loss check's forward) and per micro-batch.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from raytrain.errors import ConfigError

_SUMMED: weakref.WeakKeyDictionary[nn.Module, tuple[str, ...]] = weakref.WeakKeyDictionary()


def _rank_and_size(group: Any) -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def _slice(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    rank, size = _rank_and_size(group)
    if tensor.shape[1] % size:
        raise ValueError(
            f"sequence parallel splits dimension 1 (the sequence) over tp = {size} ranks: got length "
            f"{tensor.shape[1]} (shape {tuple(tensor.shape)}), which is not a multiple of {size}"
        )
    return tensor.chunk(size, dim=1)[rank].contiguous()


def _all_gather(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    import torch.distributed as dist

    _, size = _rank_and_size(group)
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=1)


class _Split(torch.autograd.Function):
    """This rank's slice of the sequence; backward: the slices' gradients gathered (the input was whole and equal
    on every tp rank)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _slice(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, ctx.group), None


class _Gather(torch.autograd.Function):
    """The whole sequence from every rank's slice; backward: this rank's slice of the gradient (every tp rank holds
    the whole, equal gradient of the gathered tensor)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_gather(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _slice(grad, ctx.group), None


def hidden_states(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The hidden states a block or an attention/MLP module is called with: its first positional argument when that
    is a tensor, else its `hidden_states=` keyword (transformers' decoders); None when neither is."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    found = kwargs.get("hidden_states")
    return found if isinstance(found, torch.Tensor) else None


def _replace_hidden(args: tuple[Any, ...], kwargs: dict[str, Any], change: Any, where: str) -> Any:
    hidden = hidden_states(args, kwargs)
    if hidden is None:
        raise ValueError(f"sequence parallel: {where} was called without a tensor as first argument or hidden_states")
    if args and args[0] is hidden:
        return (change(hidden), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": change(hidden)}


class SequenceProbe:
    """Driver-side: the length of the sequence that sequence parallel cuts (dimension 1 of the hidden states
    entering the model's first block), seen during the forwards it `watch`es (the loss check's, on a few real
    rows: every batch has the same columns' shapes, so that length is every step's), and whether `tp` divides it."""

    def __init__(self, tp: int) -> None:
        self.tp = tp
        self.blocks = ""
        self.shape: tuple[int, ...] | None = None

    @contextmanager
    def watch(self, model: nn.Module) -> Iterator[None]:
        """Record the hidden states' shape entering `model`'s first block while the context is open."""
        self.blocks = sequence_blocks(model)
        first = next(b for b in model.get_submodule(self.blocks).children() if not isinstance(b, nn.Identity))

        def record(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hidden = hidden_states(args, kwargs)
            if hidden is not None and hidden.dim() >= 2:
                self.shape = tuple(hidden.shape)

        handle = first.register_forward_pre_hook(record, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    def verdict(self) -> str:
        """A line for the log; `ConfigError` naming the length, tp and a length that works when tp does not divide
        it."""
        if self.shape is None:
            return "sequence parallel: the sequence length could not be checked on the driver (the forward did not run)"
        length, tp = self.shape[1], self.tp
        if length % tp:
            raise ConfigError(
                f"sequence parallel cuts the sequence (dimension 1 of the hidden states entering {self.blocks}, shape "
                f"{self.shape}) into tp = {tp} slices: its length {length} is not a multiple of {tp} (make the "
                f"sequence length a multiple of tp, e.g. {length + tp - length % tp}, or set sequence_parallel = false)"
            )
        return f"sequence parallel: {length} positions at {self.blocks}, {length // tp} per tp rank"


def sequence_blocks(model: nn.Module) -> str:
    """The path of `model`'s list of blocks (its pipeline split's `blocks`: `raytrain.parallel.pipeline.split_of`),
    between whose ends sequence parallel cuts the sequence; `ConfigError` when the model has no split."""
    from raytrain.parallel.pipeline import split_of

    split = None if isinstance(model, nn.Sequential) else split_of(model)
    if split is None:
        raise ConfigError(
            f"sequence parallel needs the block list of {type(model).__name__} (where the sequence is cut and joined):"
            " a transformers decoder with base_model_pp_plan, or a pipeline_split() method returning {'blocks': ...}"
        )
    return split.blocks


def sequence_modules(model: nn.Module, plan: Mapping[str, str], blocks: str) -> list[str]:
    """The modules whose input sequence parallel gathers: the parents of the colwise layers in `plan` (module
    name -> style, resolved), each strictly inside one of the blocks under `blocks` (`ConfigError` naming the
    layer otherwise: a block that runs attention in its own forward cannot take T / tp positions)."""
    parents = []
    for name, style in plan.items():
        if style != "colwise":
            continue
        parent = name.rpartition(".")[0]
        inside = parent.startswith(blocks + ".") and "." in parent[len(blocks) + 1 :]
        if not inside:
            raise ConfigError(
                f"sequence parallel needs each colwise layer inside a module below its block (an attention, an "
                f"MLP) whose input it gathers; {name!r} sits directly in {parent or 'the model'!r}"
            )
        if parent not in parents:
            parents.append(parent)
    order = {name: position for position, (name, _) in enumerate(model.named_modules())}
    return sorted(parents, key=lambda name: order.get(name, len(order)))


def _ends(container: nn.Module) -> tuple[set[int], set[int]]:
    """The ids of the blocks that start and that end a run of `container`'s blocks: its first and last block, or,
    in a pipeline stage, those of each chunk it holds (`raytrain.parallel.pipeline.KeptBlocks`; other stages'
    placeholders left out). Decided once, so a block recomputed in the backward (outside any chunk's forward)
    splits and joins as in its forward."""
    chunk_of = getattr(container, "_chunk_of", {})
    runs: dict[int, list[nn.Module]] = {}
    for key, block in container._modules.items():
        if block is not None and not isinstance(block, nn.Identity):
            runs.setdefault(chunk_of.get(key, 0), []).append(block)
    return {id(run[0]) for run in runs.values()}, {id(run[-1]) for run in runs.values()}


def apply_sequence_parallel(
    model: nn.Module, plan: Mapping[str, str], blocks: str, tp_group: Any, device: torch.device | None = None
) -> str:
    """Install sequence parallel on `model` (one pipeline stage or the whole model) whose layers in `plan` tensor
    parallelism split, rowwise outputs reduce-scattered over the sequence: the blocks under `blocks` split the
    sequence at the first block of a run (`_ends`) and gather it after the last, drawing random numbers from the tp
    rank's own stream in between (`raytrain.rng.install_rank_stream`; `device`: the run's, for its generator);
    the colwise layers' parents gather their input; the parameters inside the blocks left whole are recorded for
    `sum_sequence_gradients`. Call after activation checkpointing (its recompute then replays the split and the
    stream's entry) and before FSDP. Returns a line for the log."""
    from torch.distributed.tensor import DTensor

    from raytrain.rng import install_rank_stream

    container = model.get_submodule(blocks)
    firsts, lasts = _ends(container)
    rank, _ = _rank_and_size(tp_group)
    stream = install_rank_stream(model, rank, device)
    for parent in sequence_modules(model, plan, blocks):

        def gather(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], where: str = parent) -> Any:
            return _replace_hidden(args, kwargs, lambda t: _Gather.apply(t, tp_group), where)

        model.get_submodule(parent).register_forward_pre_hook(_eager(gather), with_kwargs=True)
    for name, block in container.named_children():

        def split(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], where: str = name) -> Any:
            if id(module) not in firsts:
                return None
            stream.enter()  # the positions differ per rank from here: so do the random numbers
            return _replace_hidden(args, kwargs, lambda t: _Split.apply(t, tp_group), f"{blocks}.{where}")

        def join(module: nn.Module, _args: Any, output: Any) -> Any:
            if id(module) not in lasts:
                return None
            stream.leave()
            if isinstance(output, tuple):
                return (_Gather.apply(output[0], tp_group), *output[1:])
            return _Gather.apply(output, tp_group)

        block.register_forward_pre_hook(_eager(split), with_kwargs=True)
        block.register_forward_hook(_eager(join))
    summed = tuple(
        name
        for name, parameter in model.named_parameters()
        if name.startswith(blocks + ".") and not isinstance(parameter, DTensor)
    )
    _SUMMED[model] = summed
    return (
        f"sequence parallel over the blocks {blocks}: each tp rank holds 1/tp of the positions between the split "
        f"layers; {len(summed)} parameters left whole there (norms) have their gradients summed over tp"
    )


def sum_sequence_gradients(model: nn.Module, group: Any) -> None:
    """Sum the gradients of the parameters sequence parallel left whole inside the blocks (each tp rank computed
    them on its positions only) over the tp `group` (collective; after the step's last backward)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    # A parameter used on the gathered whole sequence inside an attention or MLP module (e.g. an MoE router) would be
    # counted tp times here: such models need it in the TP plan or outside the blocks.
    for name in _SUMMED.get(model, ()):
        parameter = model.get_parameter(name)
        if parameter.grad is None:
            continue
        grad = parameter.grad
        dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=group)


def _eager(hook: Any) -> Any:
    """A hook that runs eagerly inside a compiled block (it runs collectives and reshapes the input)."""
    return torch.compiler.disable(hook)
