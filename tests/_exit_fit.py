"""Two 2-rank fits in one script, then a normal exit (``tests/test_user_code.py``)::

    python -m torch.distributed.run --nproc-per-node 2 tests/_exit_fit.py ALGORITHM [diverge]

A small attention model with the defaults a user gets (the exchange overlapped with backward, on
a thread and a process group of its own). Each rank prints ``exit-check: rank R done`` after
both fits; whatever runs after that (interpreter shutdown) must not abort the process.

``diverge``: the loss is NaN from the start, so the run stops with ``NonFiniteError`` on every
rank (after ``max_consecutive_skips`` skipped steps); only rank 0 may print a traceback.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_onebit  # noqa: F401  (registers the strategy names)


class Attention(L.LightningModule):
    def __init__(self, diverge: bool = False) -> None:
        super().__init__()
        self.diverge = diverge
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(32, 32)
        self.block = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
        self.head = torch.nn.Linear(32, 32)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        logits = self.head(self.block(self.embed(x[:, :-1])))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        return loss * float("nan") if self.diverge else loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, betas=(0.9, 0.95))


def main(algorithm: str, diverge: bool = False) -> None:
    data = torch.randint(0, 32, (512, 9), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        trainer = L.Trainer(
            strategy=algorithm,
            accelerator="cpu",
            devices=2,
            max_steps=24,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Attention(diverge), DataLoader(TensorDataset(data), batch_size=16))
    print(f"exit-check: rank {trainer.global_rank} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], diverge=sys.argv[2:] == ["diverge"])
