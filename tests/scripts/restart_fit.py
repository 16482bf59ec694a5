"""One 2-rank fit under ``torchrun --max-restarts 1`` that one rank interrupts with SIGKILL
(``scripts/restart_check.py`` runs it)::

    python -m torch.distributed.run --nproc-per-node 2 --max-restarts 1 \\
        tests/scripts/restart_fit.py STRATEGY OUT [--kill-at STEP] [--kill-rank R]

``STRATEGY``: ``onebit_adam``, ``zero_one_adam``, ``onebit_lamb`` (the switch after step
``SWITCH``) or ``ddp``. A small attention model trains ``STEPS`` steps; ``ModelCheckpoint`` saves
``last.ckpt`` every ``EVERY`` steps, at the end of an epoch, so a resume replays the same batches.
Every attempt resumes from ``ckpt_path="last"``. With ``--kill-at``, rank ``R`` (default 1)
SIGKILLs itself after that step, once (a marker in ``OUT`` says it did); torchrun then stops the
other rank and starts both again. At the end each rank writes its parameters to
``OUT/final-rank{R}.pt`` and prints ``restart-fit: rank R done``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import signal
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_onebit import OneBitStrategy

STEPS, SWITCH, EVERY, BATCH = 160, 80, 40, 16


class Attention(L.LightningModule):
    """Token embeddings, one self-attention block and a classifier of the next token."""

    def __init__(self, vocab: int = 32, dim: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.TransformerEncoderLayer(dim, 2, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def training_step(self, batch: Any, i: int) -> torch.Tensor:
        x, y = batch
        logits = self.head(self.block(self.embed(x)).mean(1))  # (B, V)
        return nn.functional.cross_entropy(logits, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class KillOnce(Callback):
    """Rank ``rank`` SIGKILLs itself after optimizer step ``step``, the first time only."""

    def __init__(self, step: int, rank: int, marker: Path) -> None:
        self.step, self.rank, self.marker = step, rank, marker

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        mine = trainer.global_step == self.step and trainer.global_rank == self.rank
        if mine and not self.marker.exists():
            self.marker.write_text(str(self.step))
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("strategy")
    p.add_argument("out", type=Path)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--kill-rank", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 32, (EVERY * BATCH * 2, 12), generator=g)
    data = DataLoader(TensorDataset(x, x[:, :3].sum(1) % 32), batch_size=BATCH, shuffle=True)
    strategy: Any = "ddp"
    if a.strategy != "ddp":
        strategy = OneBitStrategy(algorithm=a.strategy, freeze_step=SWITCH)
    callbacks: list[Callback] = [
        ModelCheckpoint(dirpath=a.out / "ckpt", every_n_train_steps=EVERY, save_last=True)
    ]
    if a.kill_at is not None:
        callbacks.append(KillOnce(a.kill_at, a.kill_rank, a.out / "killed"))
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=a.out,
    )
    model = Attention()
    trainer.fit(model, data, ckpt_path="last")
    r = trainer.global_rank
    torch.save(
        {k: v.detach().clone() for k, v in model.state_dict().items()}, a.out / f"final-rank{r}.pt"
    )
    print(f"restart-fit: rank {r} done", flush=True)


if __name__ == "__main__":
    main()
