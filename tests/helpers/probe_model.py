"""A small LightningModule for the probe's tests (``--model tests.helpers.probe_model:TinyLM``)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn


class TinyLM(pl.LightningModule):
    """Embedding, an MLP and a head over one batch of token windows (``example_input_array``)."""

    def __init__(self, vocab: int = 64, width: int = 64, batch: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Embedding(vocab, width), nn.Linear(width, 4 * width), nn.GELU(),
            nn.Linear(4 * width, vocab),
        )  # fmt: skip
        self.example_input_array = torch.randint(0, vocab, (batch, 32))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self.net(idx)
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())


class NoExample(pl.LightningModule):
    """No ``example_input_array``: the probe cannot time it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
