"""Write the checkpoints and per-rank files in ``tests/data/rank_files/``: one of each kind the
strategies write, made by the release before rank files were loaded with ``weights_only=True``
(commit 33c34f8), so that the tests show such files still load.

    python tests/data/make_rank_files.py      # from the repository root, on an editable install

Kinds (2 CPU ranks, gloo, a model of 212 parameters):

* ``trainer_onebit_adam``: ``OneBitStrategy`` 1-bit Adam in its compression phase (the flat
  exchange's error buffers and ``rescale_variance``'s sums of squared gradients);
* ``trainer_zero_one_local``: 0/1 Adam between two synchronisations of its local phase (each
  rank's whole optimizer state and its own parameters);
* ``trainer_lamb_overlap``: 1-bit LAMB overlapped with backward (the bucketed exchange);
* ``fabric_onebit_adam``: ``OneBitFabricStrategy`` 1-bit Adam (a step-keyed checkpoint).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import shutil
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_onebit import OneBitFabricStrategy, OneBitStrategy

OUT = Path(__file__).parent / "rank_files"
STEPS = 8


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=g)
    return TensorDataset(x, x[:, :4].sin())


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_model()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def trainer_kind(name: str, **strategy: object) -> None:
    out = OUT / name
    shutil.rmtree(out, ignore_errors=True)
    trainer = L.Trainer(
        strategy=OneBitStrategy(start_method="fork", **strategy),
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=out, filename="last", every_n_train_steps=STEPS)],
    )
    trainer.fit(Tiny(), DataLoader(data(), batch_size=16))


def fabric_kind(name: str) -> None:
    out = OUT / name
    shutil.rmtree(out, ignore_errors=True)
    fabric = L.Fabric(
        strategy=OneBitFabricStrategy(freeze_step=4, start_method="fork"),
        accelerator="cpu",
        devices=2,
    )
    fabric.launch(_fabric_run, out)


def _fabric_run(fabric: L.Fabric, out: Path) -> None:
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(DataLoader(data(), batch_size=16))
    for _, (x, y) in zip(range(STEPS), loader, strict=False):
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    fabric.save(out / "last.ckpt", {"model": model, "optimizer": opt, "step": STEPS})


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parents[2]))
    trainer_kind("trainer_onebit_adam", freeze_step=4)
    trainer_kind(
        "trainer_zero_one_local",
        algorithm="zero_one_adam",
        freeze_step=2,
        local_step_scaler=2,
        local_step_clipper=4,
    )
    trainer_kind(
        "trainer_lamb_overlap", algorithm="onebit_lamb", freeze_step=4, overlap_bucket_mb=0.0004
    )
    fabric_kind("fabric_onebit_adam")
    for f in sorted(OUT.rglob("*")):
        if f.is_file():
            print(f"{f.relative_to(OUT)}: {f.stat().st_size} bytes")
