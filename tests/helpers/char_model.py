"""The character-level model the strategy tests train (standard-library source, next-character
prediction, no downloads) and the 2-rank fit helper they share."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset

from lightning_onebit import kernels
from lightning_onebit.comm import fp32_allreduce_bytes
from tests.helpers.fit import fit_ranks
from tests.helpers.user_models import bytes_to_ids, stdlib_text

VOCAB, CONTEXT, EMBED, HIDDEN = 48, 8, 16, 64


ALGOS = ["onebit_adam", "zero_one_adam", "onebit_lamb"]

#: the steps that synchronise when 0/1 Adam by name runs 40 steps: the variance phase is steps
#: 1-8 (freeze_step 0.2 of the run), then the local-step interval doubles every 16 steps
#: (local_step_scaler 0.4 of the run): 1 (steps 9-24), 2 (25-40)
SYNC_STEPS_OF_40 = [*range(1, 25), *range(26, 41, 2)]


def _corpus(nbytes: int = 120_000) -> torch.Tensor:
    """Standard-library source as token ids; the VOCAB-1 most frequent bytes get their own id
    (every id occurs often in warmup: a frozen variance of 0 would make 1-bit steps explode)."""
    text = stdlib_text(nbytes)
    return bytes_to_ids(text, VOCAB, text)


class CharWindows(Dataset):
    """(CONTEXT characters, next character) pairs at fixed, evenly spread offsets."""

    def __init__(self, data: torch.Tensor, n: int, start: int = 0) -> None:
        self.data = data
        self.offsets = torch.linspace(start, len(data) - CONTEXT - 1, n).long()

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        o = int(self.offsets[i])
        return self.data[o : o + CONTEXT], self.data[o + CONTEXT]


class CharModel(L.LightningModule):
    """A plain LightningModule: nothing in it knows about 1-bit training."""

    def __init__(
        self, lr: float = 3e-3, weight_decay: float = 0.0, scheduler: bool = False, nan_at: int = -1
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Embedding(VOCAB, EMBED),  # (B, T, E)
            torch.nn.Flatten(),  # (B, T*E)
            torch.nn.Linear(CONTEXT * EMBED, HIDDEN),
            torch.nn.Tanh(),
            torch.nn.Linear(HIDDEN, VOCAB),  # (B, V)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        if self.global_step == self.hparams.nan_at and self.global_rank == 1:
            loss = loss * float("inf")  # an overflow on one rank only
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )
        if not self.hparams.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _fit(
    tmp: Path,
    strategy: Any,
    devices: int = 2,
    steps: int = 40,
    model: CharModel | None = None,
    ckpt_path: str | None = None,
    callbacks: list[Callback] | None = None,
    batch: int = 32,
    epoch_steps: int | None = None,
    **trainer_kw: Any,
) -> list[dict]:
    """Train ``model`` (default: a fresh ``CharModel()``) on the corpus' windows; every rank's
    record (``tests.helpers.fit.fit_ranks``, whose arguments these are)."""
    data = _corpus()
    return fit_ranks(
        model or CharModel(),
        lambda n: CharWindows(data, n),
        strategy,
        tmp,
        steps,
        devices,
        batch,
        epoch_steps=epoch_steps,
        ckpt_path=ckpt_path,
        callbacks=callbacks,
        **trainer_kw,
    )


def _per_call(numel: int, world: int) -> int:
    """Bytes one compressed exchange sends per rank: 2 (W - 1) records of scale + bits + pad."""
    row = math.ceil(numel / (8 * world))  # bytes of signs per chunk
    return 2 * (world - 1) * (4 + math.ceil(row / 4) * 4)


def coded_bytes(sizes: list[int], world: int, bits: int) -> int:
    """Bytes one average in integer codes of tensors of ``sizes`` values sends per rank (one
    exchange): 2 (W - 1) records of a flag and one rank's chunk (each tensor in whole blocks of
    256, the layout padded to ``W`` whole chunks of blocks) at ``bits`` a value with one fp32
    scale per block."""
    aligned = sum(-(-k // 256) * 256 for k in sizes)
    chunk = -(-aligned // (256 * world)) * 256
    return 2 * (world - 1) * (4 + kernels.row_bytes(chunk, bits, 256))


def warmup_bytes(params: dict, world: int) -> int:
    """Bytes one warmup step sends per rank with the strategies' default ``average_dtype`` on
    the CPU (int4, its variance window in int8): in int8 on every step of the tests' runs, whose
    warmups are shorter than the ``1 / (1 - beta2) = 1000`` steps of the window at torch's
    beta2."""
    return coded_bytes([int(v.numel()) for v in params.values()], world, 8)


def bf16_warmup_bytes(numel: int, world: int) -> int:
    """Bytes one warmup step averaged in bf16 sends per rank: DDP's ring allreduce of the
    gradients in 2 bytes a value, half of fp32's."""
    return fp32_allreduce_bytes(numel, world) // 2


def _rescale_bytes(params: dict, world: int, compressed_steps: int) -> int:
    """Bytes per rank of ``rescale_variance``'s all_reduces (one float per tensor, every 10th
    1-bit exchange) over ``compressed_steps`` steps of 1-bit Adam converted by the strategy."""
    return compressed_steps // 10 * (2 * (world - 1) * len(params) * 4 // world)


def _assert_same_on_all_ranks(records: list[dict]) -> None:
    for r in records[1:]:
        for k, v in records[0]["params"].items():
            assert torch.equal(v, r["params"][k]), f"parameter {k} differs across ranks"


def _held_out_loss(params: dict[str, torch.Tensor]) -> float:
    model = CharModel()
    model.load_state_dict(params)
    data = _corpus(200_000)[120_000:]
    x, y = next(iter(DataLoader(CharWindows(data, 4096), batch_size=4096)))
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model.net(x), y))
