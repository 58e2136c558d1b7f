"""The model of the two-file example project (`job.toml`, `train.py` imports this file): a character-level GRU
language model and the text encoding it reads."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

VOCAB = 128  # ASCII; anything else is read as "?"


def encode(text: str) -> np.ndarray:
    """The text as int64 character codes < VOCAB."""
    codes = np.frombuffer(text.encode("ascii", errors="replace"), dtype=np.uint8).astype(np.int64)
    return np.minimum(codes, VOCAB - 1)


class CharGRU(nn.Module):
    """Embedding -> GRU -> linear head: tokens [n, T] -> logits [n, T, VOCAB]."""

    def __init__(self, width: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.gru = nn.GRU(width, hidden, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(self.embed(tokens))
        return self.head(out)
