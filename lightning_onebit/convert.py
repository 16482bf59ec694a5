"""Converting a torch Adam/AdamW into a 1-bit optimizer: group keys, learning-rate scaling and
the LR schedulers that drove the original (the ones they hold included)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_onebit._compat import mark_step_for_lr_schedulers

#: torch Adam/AdamW group keys that are implementation switches the 1-bit optimizers lack
_TORCH_ONLY = (
    "amsgrad",
    "maximize",
    "foreach",
    "capturable",
    "differentiable",
    "fused",
    "decoupled_weight_decay",
)


#: learning rates that converting to 1-bit LAMB with ``lamb_lr`` rescales: param-group keys
#: (torch's schedulers keep their own there) and LR scheduler attributes
_LR_GROUP_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")


_TORCH_SCHEDULER_GROUP_KEYS = ("max_momentum", "base_momentum")


_LR_SCHEDULER_ATTRS = ("base_lrs", "max_lrs", "min_lrs", "eta_min", "_last_lr")


_SCHEDULER_TYPES = (
    torch.optim.lr_scheduler.LRScheduler,
    torch.optim.lr_scheduler.ReduceLROnPlateau,
)


def _plain(value: Any) -> Any:
    """Hyperparameters as Python numbers (torch allows 0-dim tensors for lr/betas)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


def _repoint_scheduler(
    scheduler: Any, old: torch.optim.Optimizer, new: torch.optim.Optimizer, lr_scale: float = 1.0
) -> None:
    """Make an LR scheduler built for ``old`` drive ``new`` (same groups, same order).

    Every reference to ``old`` is replaced, in the scheduler and in the schedulers it holds
    (SequentialLR's and ChainedScheduler's children, or a custom scheduler's), and their
    absolute learning rates (``base_lrs``, ``eta_min``, ...) are multiplied by ``lr_scale``.
    """
    found = False
    for obj in _schedulers_within(scheduler):
        for key, value in vars(obj).items():
            if value is old:
                setattr(obj, key, new)
                found = True
            elif isinstance(value, list) and any(v is old for v in value):
                setattr(obj, key, [new if v is old else v for v in value])
                found = True
        if lr_scale != 1.0:
            for key in _LR_SCHEDULER_ATTRS:
                value = getattr(obj, key, None)
                if isinstance(value, list):
                    setattr(obj, key, [v * lr_scale for v in value])
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    setattr(obj, key, value * lr_scale)
    if not found:
        raise MisconfigurationException(
            f"LR scheduler {type(scheduler).__name__} does not drive the optimizer returned by "
            "configure_optimizers: build it on that optimizer"
        )
    # torch wraps optimizer.step to warn when scheduler.step() comes first; wrap the new one too
    mark_step_for_lr_schedulers(new)


def _schedulers_within(scheduler: Any) -> list[Any]:
    """``scheduler`` and every scheduler it holds, at any depth (each once)."""
    found: list[Any] = []
    todo = [scheduler]
    while todo:
        obj = todo.pop()
        if any(obj is f for f in found):
            continue
        found.append(obj)
        for value in vars(obj).values():
            for v in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(v, _SCHEDULER_TYPES):
                    todo.append(v)
    return found
