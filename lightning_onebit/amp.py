"""A loss scaler whose overflow decision is the same on every rank (16-mixed with local
gradients)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from typing_extensions import override


class _RankSyncedGradScaler(torch.amp.GradScaler):
    """GradScaler whose overflow flag is the maximum over ranks.

    In the compression phase every rank has its own local gradients, so one rank can overflow
    while the others do not; skipping the step on that rank alone would desynchronise the
    optimizers (and deadlock their exchange). One extra 1-element all_reduce per step.
    """

    @override
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if not (self._enabled and dist.is_available() and dist.is_initialized()):
            return
        for found_inf in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)


def _synced_scaler(scaler: torch.amp.GradScaler) -> _RankSyncedGradScaler:
    synced = _RankSyncedGradScaler(
        device=scaler._device,
        init_scale=scaler._init_scale,
        growth_factor=scaler._growth_factor,
        backoff_factor=scaler._backoff_factor,
        growth_interval=scaler._growth_interval,
        enabled=scaler._enabled,
    )
    if scaler._scale is not None:  # already used: keep its current scale
        synced.load_state_dict(scaler.state_dict())
    return synced
