"""The arithmetic blocks the algorithms' ``_step`` is written in (Adam's direction and step, the
frozen variance's denominator, the decoupled and frozen updates, the NaN/Inf checks): functions
of the flat buffers, the param groups and explicit values, like torch's functional ``adam()``.
The averages they take are the optimizer's (``_averages.py``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lightning_onebit.kernels import (
    Denominator,
    ExchangeSource,
    SignRuns,
    TensorSource,
    adam_update,
    frozen_adam_update,
)

if TYPE_CHECKING:
    from lightning_onebit.optim._flat import FlatState
    from lightning_onebit.optim._variance import BiasCorrection

#: param groups (torch's): each group's hyperparameters
Groups = list[dict[str, Any]]

__all__ = [
    "SourceOf",
    "adam_direction",
    "adam_step_",
    "all_finite_on_device",
    "any_weight_decay",
    "as_source",
    "decoupled_decay",
    "decoupled_update_",
    "denominator",
    "denominator_into",
    "finite",
    "finite_on_device",
    "fp32_param",
    "frozen_adam_update_",
    "update_norm_cap",
]


def decoupled_decay(group: dict[str, Any]) -> float:
    """The group's decoupled weight decay (AdamW's, ``p -= lr * wd * p``): its
    ``weight_decay``, or 0 where ``decoupled_weight_decay=False`` makes it torch Adam's L2
    term, which ``FlatState.gather_grads`` adds to the gradient instead."""
    return group["weight_decay"] if group.get("decoupled_weight_decay", True) else 0.0


def all_finite_on_device(tensors: list[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """Whether every value of ``tensors`` (``None``: zeros) is finite, as a one-element bool
    tensor on ``device``: one read-only sweep of each, no temporary (``finite_on_device``)."""
    ends = []
    for t in tensors:
        if t is not None and t.numel():
            ends += torch.aminmax(t)
    if not ends:
        return torch.ones(1, dtype=torch.bool, device=device)
    return torch.isfinite(torch.stack(ends)).all().reshape(1)


def finite(flat: torch.Tensor) -> bool:
    """Whether every value is finite: one read-only sweep, no temporary (min and max
    propagate NaN; +Inf is the max, -Inf the min). A float64 sum would be as exact but
    materialises a float64 copy of the buffer."""
    return bool(finite_on_device(flat))


def finite_on_device(flat: torch.Tensor) -> torch.Tensor:
    """``finite`` as a one-element bool tensor on ``flat``'s device (no host read)."""
    if flat.numel() == 0:
        return torch.ones(1, dtype=torch.bool, device=flat.device)
    lo, hi = torch.aminmax(flat)
    return (torch.isfinite(lo) & torch.isfinite(hi)).reshape(1)


#: What an algorithm exchanges, for a flat slice (whole parameters), from the gradients alone
#: (its ``_exchange_source``): it reads ``.grad``, or returns a source that does when computed
#: (in ``step()``, or in the overlap's hook on the thread that runs backward).
SourceOf = Callable[[slice], "torch.Tensor | ExchangeSource"]


def as_source(values: torch.Tensor | ExchangeSource) -> ExchangeSource:
    """An exchange's input as a source: a flat tensor as a
    [kernels.TensorSource][lightning_onebit.kernels.TensorSource], a source as it is."""
    return TensorSource(values) if isinstance(values, torch.Tensor) else values


def adam_direction(
    flat: FlatState, groups: Groups, bias: BiasCorrection | None
) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """Adam's direction with decoupled weight decay, parameter by parameter, reading the
    moments in the flat buffers and each parameter where it lies: the returned function
    writes parameter ``j``'s (layout index) ``exp_avg / (sqrt(exp_avg_sq) + eps) +
    weight_decay * p`` into ``out`` (float32, contiguous, the parameter's shape) and returns
    it. With ``bias`` (``bias_correction``) the moments are bias-corrected first, per group or
    per parameter (see `BiasCorrection`).
    The hyperparameters are those of the call's time."""
    m, v = flat.views["exp_avg"], flat.views["exp_avg_sq"]
    layout = flat.layout
    per_param = bias is not None and bias.per_param
    coefs: dict[tuple[int, int | None], tuple[float, float]] = {}

    def coefficients(gi: int, j: int | None) -> tuple[float, float]:
        if (gi, j) not in coefs:
            eps, scale = groups[gi]["eps"], 1.0
            if bias is not None:  # m/bc1 / (sqrt(v/bc2) + eps)
                bc1, bc2 = bias.of(gi, j)
                eps, scale = eps * math.sqrt(bc2), math.sqrt(bc2) / bc1
            coefs[gi, j] = (eps, scale)
        return coefs[gi, j]

    def direction(j: int, out: torch.Tensor) -> torch.Tensor:
        gi = layout.group_of[j]
        eps, scale = coefficients(gi, j if per_param else None)
        torch.sqrt(v[j], out=out).add_(eps)
        torch.div(m[j], out, out=out)
        if scale != 1.0:
            out.mul_(scale)
        wd = decoupled_decay(groups[gi])
        if wd > 0:
            out.add_(fp32_param(layout.params[j]), alpha=wd)
        return out

    return direction


def fp32_param(p: torch.Tensor) -> torch.Tensor:
    """``p`` itself (detached) where it is float32 and contiguous, else a float32 contiguous
    copy: the values the flat parameter buffer would hold, for one layer's norm or decay term."""
    return p.detach().to(torch.float32, memory_format=torch.contiguous_format)


def denominator(
    flat: FlatState,
    groups: Groups,
    scales: torch.Tensor | None = None,
    idx: list[int] | None = None,
) -> Denominator:
    """The frozen variance's ``sqrt(exp_avg_sq) + eps`` of the parameters ``idx`` (consecutive
    layout indices; default: all), as the kernels take it: the flat variance and, per parameter,
    its group's ``eps`` and, where ``rescale_variance`` moved the tensors' scales (``scales``:
    ``r_j`` per tensor of the layout, ``VarianceRescale.scales``), ``sqrt(r_j)`` (then
    ``sqrt(v) * sqrt(r_j) + eps``; a float32 tensor on the device, no host read). The kernels
    compute ``d`` as they read ``v``: no buffer of it is held, and it always follows the
    variance, its scales and ``eps`` as they are now."""
    layout = flat.layout
    idx = list(range(len(layout.params))) if idx is None else idx
    eps = [groups[layout.group_of[j]]["eps"] for j in idx]
    dscale = None
    if scales is not None and idx:
        if idx != list(range(idx[0], idx[-1] + 1)):
            raise ValueError("denominator() takes consecutive layout indices")
        dscale = scales[idx[0] : idx[-1] + 1].sqrt()
    return Denominator(flat.states["exp_avg_sq"], eps, dscale)


def denominator_into(
    flat: FlatState,
    groups: Groups,
    scales: torch.Tensor | None,
    out: torch.Tensor,
    idx: list[int] | None = None,
) -> torch.Tensor:
    """``denominator(flat, groups, scales, idx)``'s values, computed with torch ops (the kernels'
    floats), into the same flat indices of ``out`` (a flat float32 buffer of the layout's size;
    the values of other parameters are left as they are), for the torch ops that take ``d`` as
    a tensor.

    Returns:
        ``out``.
    """
    layout = flat.layout
    idx = list(range(len(layout.params))) if idx is None else idx
    starts = [layout.offsets[j] for j in idx]
    sizes = [layout.params[j].numel() for j in idx]
    return denominator(flat, groups, scales, idx).write(out, starts, sizes)


def decoupled_update_(flat: FlatState, groups: Groups, x: torch.Tensor) -> None:
    """``p -= lr * (x + weight_decay * p)`` for every parameter (``x``: a flat direction). The
    decay is subtracted, ``p += -lr * wd * p``, one rounding of the result: the factor ``p *
    float32(1 - lr * wd)`` would carry the same rounding error into every step (it decays 1.5%
    too much at ``lr * wd = 1e-6``, 17% at ``1e-7``)."""
    views = flat.views_of(x)
    for gi, group, _ in flat.segments(groups):
        idx = flat.layout.group_params(gi)
        params = [flat.layout.params[j] for j in idx]
        lr, wd = group["lr"], decoupled_decay(group)
        if wd > 0:
            torch._foreach_add_(params, params, alpha=-lr * wd)
        torch._foreach_add_(params, [views[j] for j in idx], alpha=-lr)


def frozen_adam_update_(
    flat: FlatState,
    groups: Groups,
    d: Denominator,
    ok: torch.Tensor | None,
    x: torch.Tensor | SignRuns,
    preconditioned: bool,
) -> None:
    """1-bit Adam's compression-phase update from the exchanged ``x``, only where the
    verdict ``ok`` (on the device; ``None``: always) is true: ``m = x * d`` and
    ``p -= lr * (x + wd * p)`` where the exchange was ``preconditioned``, else ``m = x`` and
    ``p -= lr * (x / d + wd * p)`` (``d = sqrt(v) + eps``, frozen, from ``denominator``; ``x``
    may be ``m`` itself, or the exchange's [`SignRuns`][lightning_onebit.kernels.runs.SignRuns]);
    [`frozen_adam_update`][lightning_onebit.kernels.updates.frozen_adam_update] (one sweep on the
    CPU too, the floats of ``decoupled_update_``)."""
    layout = flat.layout
    of = layout.group_of
    frozen_adam_update(
        ok,
        x,
        flat.states["exp_avg"],
        d,
        layout.params,
        layout.offsets,
        [groups[of[j]]["lr"] for j in range(len(layout.params))],
        [decoupled_decay(groups[of[j]]) for j in range(len(layout.params))],
        preconditioned,
    )


def adam_step_(
    flat: FlatState,
    groups: Groups,
    bias: BiasCorrection | None,
    grads: torch.Tensor | list[torch.Tensor | None],
    update_variance: bool = True,
    ok: torch.Tensor | None = None,
) -> None:
    """Adam's step from ``grads`` (the flat gradient buffer, or one gradient per parameter of
    the layout, ``None``: zeros, each read where it lies), one fused sweep
    ([`adam_update`][lightning_onebit.kernels.updates.adam_update]): ``m = beta1 m + (1 - beta1)
    g``; ``v = beta2 v + (1 - beta2) g**2`` if ``update_variance``; ``p -= lr * (m / (sqrt(v) + eps)
    + weight_decay * p)``. With ``bias`` (``bias_correction``; its counts include this step), as
    torch's Adam/AdamW: ``m / (1 - beta1**t)`` over ``sqrt(v / (1 - beta2**k)) + eps``, folded into
    the kernel's per-parameter ``lr``, ``eps`` and ``weight_decay``. ``ok``: the step's verdict on
    the device (nothing is written where it is false)."""
    layout = flat.layout

    def hparams(gi: int, j: int | None = None) -> tuple[float, ...]:
        group = groups[gi]
        lr, eps, wd = group["lr"], group["eps"], decoupled_decay(group)
        if bias is not None:
            bc1, bc2 = bias.of(gi, j)
            lr_c = lr * math.sqrt(bc2) / bc1
            lr, eps, wd = lr_c, eps * math.sqrt(bc2), (wd * lr / lr_c if lr_c else wd)
        return (lr, *group["betas"], eps, wd)

    if bias is not None and bias.per_param:  # each parameter's own steps
        per_param = [hparams(gi, j) for j, gi in enumerate(layout.group_of)]
    else:
        hp = [hparams(gi) for gi in range(len(groups))]
        per_param = [hp[gi] for gi in layout.group_of]
    adam_update(
        grads,
        flat.states["exp_avg"],
        flat.states["exp_avg_sq"],
        layout.params,
        layout.offsets,
        *(list(col) for col in zip(*per_param, strict=True)),
        update_variance=update_variance,
        ok=ok,
    )


def any_weight_decay(flat: FlatState, groups: Groups) -> bool:
    """Whether some param group has a decoupled weight decay."""
    return any(decoupled_decay(group) > 0 for _, group, _ in flat.segments(groups))


def update_norm_cap(
    factor: torch.Tensor,
    p_norm: torch.Tensor,
    u_norm: torch.Tensor,
    ref: torch.Tensor,
    cap: float,
    ok: torch.Tensor | None,
) -> torch.Tensor:
    """1-bit LAMB's factors bounded by the norms of each step's update: per layer ``r = p_norm /
    u_norm`` (LAMB's trust ratio of this update), ``ref`` (written) set to ``r`` where it is
    still 0 (the first compression step, or a layer whose norms were 0 so far), and ``factor``
    at most ``cap * r / ref``: no layer's step ``factor * ||u||`` grows past ``cap`` times its
    size relative to ``||p||`` at the reference.

    Args:
        factor: per-layer factors (the fresh-variance factors, clipped).
        p_norm, u_norm: per-layer norms of the parameters and of their updates.
        ref: per-layer reference ratios (0: not yet set); updated in place.
        cap: the largest growth of a step against the reference (``factor_max``).
        ok: the step's NaN/Inf verdict on the device (``None``: finite).

    Returns:
        The bounded factors (``factor`` where a norm is 0 or not finite, or the verdict is
        false; ``ref`` is then left as it was).
    """
    r = p_norm / u_norm
    defined = (p_norm > 0) & (u_norm > 0) & torch.isfinite(r)
    if ok is not None:
        defined = defined & ok
    ref.copy_(torch.where(defined & (ref <= 0), r, ref))
    return torch.where(defined, torch.minimum(factor, cap * r / ref), factor)
