"""Models as users bring them: written by others (torch.nn, transformers) or in their style (nanoGPT), each a
picklable zero-argument builder. Shared by the init-contract, pretrained-weights and Ray tests.

transformers' models are built from tiny configs (no download). ResNet comes from transformers too: torchvision
does not import beside the CPU build of torch 2.13 that CI installs (its C++ operators are built for another
torch), while transformers' ResNet is the same architecture (BasicLayer stages, BatchNorm with running statistics,
kaiming-normal convolutions from its own `_init_weights`).
"""

from __future__ import annotations

import math

import torch
from torch import nn


class NanoGPT(nn.Module):
    """nanoGPT's structure and init, written as Karpathy writes it: standard torch layers, the embedding tied to the
    head, a causal-mask buffer, `self.apply(self._init_weights)` at the root and a scaled init of the residual
    projections by parameter name."""

    def __init__(self, vocab: int = 32, context: int = 8, width: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.ModuleList(
            nn.ModuleDict(
                {"ln": nn.LayerNorm(width), "c_attn": nn.Linear(width, 3 * width), "c_proj": nn.Linear(width, width)}
            )
            for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # https://paperswithcode.com/method/weight-tying
        self.register_buffer("bias", torch.tril(torch.ones(context, context, dtype=torch.bool)))
        self.register_buffer("steps", torch.tensor(7, dtype=torch.long))  # an integer buffer no reset touches
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))
        mask = self.bias[:t, :t]
        for block in self.h:
            q, k, v = block["c_attn"](block["ln"](x)).chunk(3, dim=-1)
            att = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            x = x + block["c_proj"](att @ v)
        return self.lm_head(self.ln_f(x))


class Attention(nn.Module):
    """Causal self-attention as its own module (as transformers' decoders hold it): q, k, v and the output
    projection, heads counted from the projected width (a tensor-parallel rank holds fewer)."""

    def __init__(self, width: int, head_dim: int, dropout: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q, self.k, self.v, self.proj = (nn.Linear(width, width) for _ in range(4))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        q, k, v = (m(x).view(n, t, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        att = self.drop(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return self.proj(att.transpose(1, 2).reshape(n, t, -1))


class MLP(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.hidden_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.hidden_drop(nn.functional.gelu(self.fc(x))))


class DropoutBlock(nn.Module):
    def __init__(self, width: int, head_dim: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn, self.mlp = Attention(width, head_dim, dropout), MLP(width, dropout)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.resid_drop(self.attn(self.ln1(x)))
        return x + self.resid_drop(self.mlp(self.ln2(x)))


class DropoutDecoder(nn.Module):
    """A GPT-2-style decoder with dropout everywhere GPT-2 has it (embeddings, attention, MLP hidden units, each
    residual branch), attention and MLP in their own modules (so sequence parallel can gather their input), a
    `pipeline_split()` and a `tp_plan()`. Tokens [n, T] -> logits [n, T, vocab]."""

    def __init__(
        self,
        vocab: int = 16,
        context: int = 8,
        width: int = 32,
        head_dim: int = 8,
        layers: int = 2,
        dropout: float = 0.3,
    ) -> None:
        super().__init__()
        self.token, self.position = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.embed_drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(DropoutBlock(width, head_dim, dropout) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed_drop(self.token(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device)))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    def pipeline_split(self) -> dict[str, object]:
        return {"blocks": "blocks", "first": ["token", "position"], "last": ["norm", "head"]}

    def tp_plan(self) -> dict[str, str]:
        return {
            **{f"blocks.*.attn.{name}": "colwise" for name in "qkv"},
            "blocks.*.attn.proj": "rowwise",
            "blocks.*.mlp.fc": "colwise",
            "blocks.*.mlp.out": "rowwise",
        }


class ScaledResidual(nn.Module):
    """A parent whose `reset_parameters` writes its child's weight (a depth-scaled residual init): the parent owns
    no tensor itself."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.depth = depth
        self.inner = nn.Linear(width, width)
        self.out = nn.Linear(width, width)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.out.weight, std=0.02 / math.sqrt(2 * self.depth))
        nn.init.zeros_(self.out.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.relu(self.inner(x)))


def scaled_residual_stack() -> nn.Module:
    """Blocks initialised by their parent, and a LayerNorm."""
    return nn.Sequential(*(ScaledResidual() for _ in range(3)), nn.LayerNorm(16))


def torch_transformer() -> nn.Module:
    """`torch.nn.Transformer`, whose root `_reset_parameters` re-initialises every matrix (xavier uniform)."""
    return nn.Transformer(32, 4, 2, 2, 64, dropout=0.0, batch_first=True)


def gpt2(layers: int = 2) -> nn.Module:
    """transformers' GPT2LMHeadModel (tied head, Conv1D layers, its own `_init_weights`), tiny, without dropout
    (a training forward then equals transformers' own inference forward)."""
    import transformers

    config = transformers.GPT2Config(
        n_layer=layers,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def gpt2_classifier(labels: int = 3) -> nn.Module:
    """transformers' GPT2ForSequenceClassification with `gpt2()`'s trunk: a new head (`score`) on a pretrained LM."""
    import transformers

    config = gpt2().config
    config.num_labels, config.pad_token_id = labels, 0
    return transformers.GPT2ForSequenceClassification(config)


def llama(tie: bool = True, layers: int = 2) -> nn.Module:
    """transformers' LlamaForCausalLM, tiny, with or without `tie_word_embeddings`."""
    import transformers

    config = transformers.LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(config)


def llama_untied() -> nn.Module:
    return llama(tie=False)


def resnet() -> nn.Module:
    """transformers' ResNetForImageClassification (ResNet-18's basic blocks, BatchNorm), tiny."""
    import transformers

    config = transformers.ResNetConfig(
        layer_type="basic", depths=[1, 1], hidden_sizes=[8, 16], embedding_size=8, num_labels=3
    )
    return transformers.ResNetForImageClassification(config)


FAMILIES = {
    "torch.nn.Transformer": torch_transformer,
    "nanoGPT": NanoGPT,
    "parent-resets-child": scaled_residual_stack,
    "transformers.GPT2": gpt2,
    "transformers.Llama-tied": llama,
    "transformers.Llama": llama_untied,
    "transformers.ResNet": resnet,
}


class InitPatterns(nn.Module):
    """Construction patterns found in models users bring, each of which the sharded build must reproduce:
    operations with several outputs of one shape (sort, topk, max(dim), var_mean, std_mean, argsort, square QR),
    a target network seeded like its online twin (`torch.manual_seed` inside the constructor, then a deepcopy), a
    buffer drawn from a private fixed-seed generator, ViT's `trunc_normal_` (truncated tightly, so truncation
    shows), a buffer set to NaN on purpose, and tensors kept as attributes: `_`-named, in a list, in a dict, in a
    tuple. Its forward uses the attribute tensors, so garbage in them shows in the loss."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.patch = nn.Parameter(torch.empty(64, width))  # from the run's seed: before the constructor seeds
        nn.init.trunc_normal_(self.patch, std=1.0, a=-0.5, b=0.5)
        x = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.5, 4.0, -1.0, 2.5]])
        values, order = torch.sort(x, dim=1, descending=True)
        self.register_buffer("sorted_values", values)
        self.register_buffer("sort_order", order)
        self.register_buffer("topk_index", torch.topk(x, 2, dim=1).indices)
        self.register_buffer("row_max_index", x.max(dim=1).indices)
        var, mean = torch.var_mean(x, dim=1)
        self.register_buffer("var", var)
        self.register_buffer("mean", mean)
        std, mean2 = torch.std_mean(x, dim=1)
        self.register_buffer("std_and_mean", torch.stack([std, mean2]))
        self.register_buffer("argsorted", torch.argsort(x, dim=1))
        q, r = torch.linalg.qr(torch.tensor([[2.0, 1.0], [1.0, 3.0]]))
        self.register_buffer("qr", torch.cat([q, r]))
        torch.manual_seed(1234)  # a target network that starts as a copy of the online one
        self.online = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))
        torch.manual_seed(1234)
        self.target = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))
        generator = torch.Generator().manual_seed(7)
        self.register_buffer("fixed_noise", torch.randn(width, generator=generator))
        self.register_buffer("missing", torch.full((3,), float("nan")))  # NaN on purpose: "no value yet"
        self._scale = torch.full((width,), 0.5)
        self.masks = [torch.ones(width), torch.arange(width, dtype=torch.float32) / width]
        self.constants = {"shift": torch.linspace(-1.0, 1.0, width)}
        self.pair = (torch.eye(width)[0], 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self._scale * self.masks[0] + self.masks[1] + self.constants["shift"] + self.pair[0]
        h = h + self.fixed_noise + self.patch.mean(0)
        return (self.online(h) - self.target(h).detach()).squeeze(-1) + self.sorted_values[0, 0]


class Expert(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class TopOneMoE(nn.Module):
    """A mixture of experts with top-1 routing as transformers' Mixtral loop writes it: each expert runs on the
    rows routed to it and is not called when none is, so experts sit out steps per rank (and, with a router
    biased away from the last expert, globally). Built with patterns the sharded build must reproduce: the router
    drawn by `trunc_normal_`, a jitter buffer from a private generator, a temperature kept as a `_`-attribute and
    per-expert scales in a list. Features [n, width] -> [n]."""

    def __init__(self, width: int = 5, experts: int = 4, hidden: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts)
        nn.init.trunc_normal_(self.router.weight, std=0.5, a=-1.0, b=1.0)
        self.experts = nn.ModuleList(Expert(width, hidden) for _ in range(experts))
        self.head = nn.Linear(width, 1)
        with torch.no_grad():
            self.router.bias[-1] -= 2.0  # the last expert is rarely chosen: idle in whole steps
        self.register_buffer("jitter", 0.01 * torch.randn(width, generator=torch.Generator().manual_seed(0)))
        self._temperature = torch.tensor(1.5)
        self.scales = [torch.full((1,), 1.0 - 0.1 * index) for index in range(experts)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.jitter.to(x.dtype)
        weights = (self.router(x) / self._temperature.to(x.dtype)).softmax(dim=-1)
        choice = weights.argmax(dim=-1)
        out = x
        for index, expert in enumerate(self.experts):
            rows = (choice == index).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            scale = self.scales[index].to(x.dtype)
            out = out.index_add(0, rows, expert(x[rows]) * weights[rows, index : index + 1] * scale)
        return self.head(out).squeeze(-1)


class SometimesBranch(nn.Module):
    """A branch some samples take (those whose first feature is above 1.5): called only for a micro-batch that holds
    one, so it sits out whole steps on some ranks and some steps everywhere. Features [n, width] -> [n]."""

    def __init__(self, width: int = 5) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(width, 8), nn.Tanh(), nn.Linear(8, 1))
        self.extra = nn.Sequential(nn.Linear(width, 4), nn.Tanh(), nn.Linear(4, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.trunk(x).squeeze(-1)
        rows = (x[:, 0] > 1.5).nonzero().squeeze(-1)
        if rows.numel():
            out = out.index_add(0, rows, self.extra(x[rows]).squeeze(-1))
        return out
