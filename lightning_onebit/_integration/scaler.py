"""A loss scaler whose overflow decision is the same on every rank (16-mixed with local
gradients)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_onebit._compat import scaler_found_inf

__all__ = ["RankSyncedGradScaler", "sync_scaler_of", "synced_scaler"]


class RankSyncedGradScaler(torch.amp.GradScaler):
    """GradScaler whose overflow flag is the maximum over ranks.

    In the compression phase every rank has its own local gradients, so one rank can overflow
    while the others do not; skipping the step on that rank alone would desynchronise the
    optimizers (and deadlock their exchange). One extra 1-element all_reduce per step.
    """

    @override
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if not (self.is_enabled() and dist.is_available() and dist.is_initialized()):
            return
        for found_inf in scaler_found_inf(self, optimizer):
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)


def synced_scaler(scaler: torch.amp.GradScaler, device: str) -> RankSyncedGradScaler:
    """``scaler`` as a ``RankSyncedGradScaler`` on ``device`` ("cuda", "cpu"): the same
    current scale, growth and backoff settings and growth tracker (its ``state_dict``)."""
    synced = RankSyncedGradScaler(device=device, enabled=scaler.is_enabled())
    synced.load_state_dict(scaler.state_dict())
    return synced


def sync_scaler_of(plugin: object, device: str) -> bool:
    """Give a precision ``plugin`` with a loss scaler (``16-mixed``, the Trainer's or Fabric's)
    a ``synced_scaler`` on ``device``: local gradients can overflow on one rank only, and
    every rank must skip the same step. Returns whether the plugin has a scaler."""
    scaler = getattr(plugin, "scaler", None)
    if not isinstance(scaler, torch.amp.GradScaler):
        return False
    plugin.scaler = synced_scaler(scaler, device)  # type: ignore[attr-defined]
    return True
