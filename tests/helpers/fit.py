"""Fit a LightningModule on CPU ranks and collect what every rank ended with (test helper).

:func:`fit_ranks` is the one Trainer run the strategy tests (``char_model._fit``) and the users'
models (``user_models.fit_user_model``) share: a quiet CPU Trainer, one epoch of exactly the
data the run needs, and one record per rank written by :class:`RecordRanks` at the end of fit.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

__all__ = ["OneThread", "RecordRanks", "fit_ranks", "inner_optimizer"]


def inner_optimizer(trainer: L.Trainer) -> Any:
    """The trainer's optimizer, unwrapped from Lightning's ``LightningOptimizer``."""
    opt = trainer.strategy.optimizers[0]
    return getattr(opt, "_optimizer", opt)


class RecordRanks(Callback):
    """Every rank writes its record to ``out/rank{r}.pt`` at the end of fit.

    The record: parameters and buffers (``params``, with ``param_names`` for the parameters; tied
    weights under each of their names), ``numel``, the held-out ``eval_loss`` where the module has
    an ``eval_loss()`` (computed on that rank; else ``None``), the optimizer's type, phases,
    phase, step count, skipped steps, counters, lrs and 0/1 Adam's ``local_step_scaler``, the logged ``metrics``, whether it
    overlaps the exchange with backward and in how many buckets, and, per training batch (= per
    optimizer step without gradient accumulation), the train loss, the phase the step ran in and
    the bytes ``step()`` sent (``history``).
    """

    def __init__(self, out: Path) -> None:
        self.out = out
        self.history: list[dict[str, Any]] = []
        self._phase: str | None = None
        self._t0 = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.history = []
        self._t0 = time.perf_counter()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, i: int) -> None:
        self._phase = getattr(inner_optimizer(trainer), "phase", None)  # the phase step i runs in

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        opt = inner_optimizer(trainer)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.history.append(
            {
                "loss": float(loss) if loss is not None else math.nan,
                "phase": self._phase,
                "bytes": getattr(opt, "comm_stats", {}).get("bytes_last_step"),
            }
        )

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        opt = inner_optimizer(trainer)
        params = list(pl_module.parameters())  # tied parameters once
        eval_loss = getattr(pl_module, "eval_loss", None)
        exchange = getattr(getattr(opt, "flat", None), "exchange", None)
        record = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "params": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
            "param_names": [
                k
                for k, v in pl_module.state_dict(keep_vars=True).items()
                if isinstance(v, nn.Parameter)
            ],
            "numel": sum(p.numel() for p in params if p.requires_grad),
            "eval_loss": eval_loss() if callable(eval_loss) else None,
            "optimizer": type(opt).__name__,
            "phases": getattr(type(opt), "PHASES", None),
            "phase": getattr(opt, "phase", None),
            "step_count": getattr(opt, "step_count", None),
            "skipped_steps": getattr(opt, "skipped_steps", None),
            "params_differ_across_ranks": getattr(opt, "params_differ_across_ranks", False),
            "comm_stats": dict(getattr(opt, "comm_stats", {})),
            "lr": [g["lr"] for g in opt.param_groups],
            "local_step_scaler": getattr(opt, "local_step_scaler", None),
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "overlap": getattr(opt, "overlaps_backward", None),
            "buckets": len(getattr(exchange, "buckets", [None])),
            "global_step": trainer.global_step,
            "history": self.history,
            "seconds": time.perf_counter() - self._t0,
        }
        torch.save(record, self.out / f"rank{trainer.global_rank}.pt")


class OneThread(Callback):
    """One torch thread per fork-started rank, as OneBitStrategy sets for its own: GNU OpenMP
    hangs in a forked child once the parent process has used its thread pool (plain DDP's
    ``ddp_notebook`` does not guard against it)."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        torch.set_num_threads(1)


def fit_ranks(
    module: L.LightningModule,
    data: Callable[[int], Dataset],
    strategy: Any,
    tmp: Path,
    steps: int,
    devices: int = 2,
    batch_size: int = 32,
    epoch_steps: int | None = None,
    ckpt_path: str | None = None,
    callbacks: list[Callback] | None = None,
    **trainer_kw: Any,
) -> list[dict]:
    """Train ``module`` for ``steps`` optimizer steps on ``devices`` CPU ranks under ``strategy``.

    Args:
        module: the LightningModule (with ``strategy="..._notebook"`` or ``start_method="fork"``
            the ranks fork from this process and get a copy of it).
        data: ``data(n)``: a dataset of ``n`` samples.
        strategy: what ``L.Trainer(strategy=...)`` takes.
        tmp: where the ranks write their records (older ``rank*.pt`` there are removed first).
        steps: ``max_steps``.
        devices: CPU ranks.
        batch_size: per rank.
        epoch_steps: optimizer steps per epoch (default ``steps``: the run sees each sample
            once); resuming at an epoch boundary replays exactly the same batches.
        ckpt_path: resume from this checkpoint.
        callbacks: added after the recorder; checkpointing is on only if one of them is a
            ``ModelCheckpoint``.
        **trainer_kw: for ``L.Trainer`` (``accumulate_grad_batches`` also sizes the epoch).

    Returns:
        Every rank's record (see :class:`RecordRanks`), by rank.
    """
    tmp = Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    for old in tmp.glob("rank*.pt"):
        old.unlink()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks or []),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[RecordRanks(tmp), OneThread(), *(callbacks or [])],
        default_root_dir=tmp,
        **trainer_kw,
    )
    # Lightning's distributed sampler shuffles with seed 0: every strategy sees the same batches
    n = (epoch_steps or steps) * batch_size * devices * trainer_kw.get("accumulate_grad_batches", 1)
    loader = DataLoader(data(n), batch_size=batch_size, shuffle=True)
    omp = os.environ.get("OMP_NUM_THREADS")
    try:
        trainer.fit(module, loader, ckpt_path=ckpt_path)
    finally:  # an in-process (devices=1) fit sets OMP_NUM_THREADS for the later forked ones
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = omp
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(devices)]
