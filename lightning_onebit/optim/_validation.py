"""Argument checks shared by the optimizers: a ``ValueError`` naming the argument, its value and
the valid range."""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["check_betas", "check_group_flags", "check_int", "check_real"]


def check_real(
    name: str,
    value: Any,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
    hint: str = "",
) -> None:
    """Raise a ValueError naming ``name``, its value and the valid range unless it is inside
    (``hint``, if given, is appended: what the range depends on, or what to do)."""
    lo, hi = ("(" if low_open else "["), (")" if high_open else "]")
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (
            value < high if high_open else value <= high
        )
    if not ok:
        raise ValueError(
            f"{name} must be a number in {lo}{low}, {high}{hi}, got {value!r}"
            + (f" ({hint})" if hint else "")
        )


def check_int(name: str, value: Any, low: int) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def check_betas(betas: Any) -> None:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    check_real("betas[0]", betas[0], 0.0, 1.0, high_open=True)
    check_real("betas[1]", betas[1], 0.0, 1.0, high_open=True)


#: torch Adam/AdamW per-group flags the 1-bit optimizers cannot honour, and why
_REFUSED_FLAGS = {
    "amsgrad": "has no amsgrad variant (its variance is frozen after the warmup)",
    "capturable": "cannot be captured in a CUDA graph (its step communicates and reads "
    "its non-finite verdict on the host)",
    "differentiable": "does not differentiate through its step (it runs under no_grad, in "
    "fused kernels)",
}

#: torch Adam/AdamW per-group flags the 1-bit optimizers honour per group
_HONOURED_FLAGS = ("maximize", "decoupled_weight_decay")


def check_group_flags(name: str, gi: int, group: dict[str, Any]) -> None:
    """Refuse, naming param group ``gi``, the torch flags ``name`` cannot honour (set to
    ``True``), and honoured flags that are not booleans."""
    for key, why in _REFUSED_FLAGS.items():
        if group.get(key):
            raise ValueError(f"param group {gi} has {key}=True: {name} {why}; set {key}=False")
    for key in _HONOURED_FLAGS:
        if key in group and not isinstance(group[key], bool):
            raise ValueError(f"param group {gi}: {key} must be True or False, got {group[key]!r}")
