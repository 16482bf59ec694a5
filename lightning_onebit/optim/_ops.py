"""The building blocks the algorithms' ``_step`` is written in. The arithmetic ones (Adam's
direction and step, the frozen variance's denominator, the decoupled and frozen updates) take
the flat buffers, the param groups and explicit values, like torch's functional ``adam()``; the
two averages (full precision and 1-bit) and the NaN/Inf checks are the optimizer's exchanges and
take it: they use its public attributes and composed objects (``flat``, ``verdict``,
``counters``, ``topology``, ``overlap``), nothing else of it."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lightning_onebit.comm import (
    NonFiniteError,
    average_bytes,
    fp32_allreduce_bytes,
    hierarchical_average,
    start_average,
)
from lightning_onebit.kernels import (
    Denominator,
    ExchangeSource,
    SignRuns,
    TensorSource,
    adam_update,
    frozen_adam_update,
    reads_sign_runs,
)

if TYPE_CHECKING:
    from lightning_onebit.optim._base import OneBitOptimizer
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
    "averaged_grads",
    "compressed_average",
    "compressed_average_into",
    "decoupled_decay",
    "decoupled_update_",
    "denominator",
    "denominator_into",
    "finite",
    "finite_on_device",
    "fp32_param",
    "frozen_adam_update_",
]


def decoupled_decay(group: dict[str, Any]) -> float:
    """The group's decoupled weight decay (AdamW's, ``p -= lr * wd * p``): its
    ``weight_decay``, or 0 where ``decoupled_weight_decay=False`` makes it torch Adam's L2
    term, which ``FlatState.gather_grads`` adds to the gradient instead."""
    return group["weight_decay"] if group.get("decoupled_weight_decay", True) else 0.0


def averaged_grads(
    opt: OneBitOptimizer,
) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
    """The step's gradients averaged over the ranks (in ``average_dtype``), one per parameter
    of the layout (``None``: zeros), and the average's verdict.

    Where this optimizer averages them (``average_warmup_grads``, ``W > 1``) they are the
    views of the flat gradient buffer: they are gathered there (with the overlap, bucket by
    bucket during backward) because the collective needs one contiguous buffer, and averaging
    the gradients in pieces of any other size would sum a value in another order at ``W >= 3``
    (a ring all-reduce's order depends on where the value lies in the buffer), so it would
    change the numbers. Otherwise (``W = 1``, or the caller, DDP, averaged them) each is read
    where autograd left it (``FlatState.grads``; on a GPU too, unless ``rescale_variance``
    takes their norms): no flat copy is made; the few the caller did not average
    (``caller_averaged``) are averaged here, in a buffer of their own for this step.

    The bytes of the average count in ``comm_stats`` either way: the algorithm needs them,
    whether this optimizer or DDP sends them.

    Returns:
        The gradients, and ``None`` or, with device verdicts (CUDA, see ``DEVICE_VERDICT``),
        whether every averaged value is finite as a bool tensor on the device (the same on
        every rank), for the step's update to take.

    Raises:
        NonFiniteError: (host verdicts) an averaged value is not finite, the same on every
            rank.
    """
    flat, w, nodes = opt.flat, opt.world_size, opt.node_groups()
    layout = flat.layout
    if w > 1 and opt.average_warmup_grads:
        buf = flat.gather_grads(opt.param_groups)
        if opt.overlap is not None:
            opt.overlap.all_reduce()  # per bucket, some started during backward
        elif nodes is not None:
            hierarchical_average(buf, opt.average_dtype, nodes)
        else:
            start_average(buf, opt.average_dtype, opt.process_group)()
        grads: list[torch.Tensor | None] = list(flat.views["grad"])
        checked: list[torch.Tensor | None] = [buf]  # (one sweep of the whole buffer)
    else:
        idx = list(range(len(layout.params)))
        grads = flat.grads(opt.param_groups, idx, on_gpu=not opt.rescale.enabled)
        if w > 1:
            _average_uncovered_(opt, grads)
        checked = grads
    if nodes is not None:
        intra, inter = average_bytes(layout.numel, opt.average_dtype, nodes)
        opt.counters.add(intra + inter, inter)
    else:
        sent = fp32_allreduce_bytes(layout.numel, w) * opt.average_dtype.itemsize // 4
        opt.counters.add_ring(sent, w, opt.topology.node_size(w))
    if opt.verdict.uses_device(layout.device):  # averaged: the same verdict on every rank
        ok = all_finite_on_device(checked, layout.device)
        return grads, opt.verdict.hold_on_device(ok, ok, "average")
    if not bool(all_finite_on_device(checked, layout.device)):
        raise NonFiniteError(
            f"the averaged gradient has non-finite values (NaN/Inf) at step {opt.step_count}"
        )
    return grads, None


def _average_uncovered_(opt: OneBitOptimizer, grads: list[torch.Tensor | None]) -> None:
    """``average_warmup_grads=False``: the caller (DDP) averaged the gradients of the
    parameters it knows, ``caller_averaged``. DDP knows those that required grad when it
    was built; one made trainable later (e.g. the backbone that Lightning's
    ``BackboneFinetuning`` unfreezes mid-run) keeps its local gradient, and the ranks would
    drift apart silently (as they do under plain DDP). Those are averaged here, in one
    all_reduce of a buffer of their own; their entries of ``grads`` become its pieces (the
    parameters' ``.grad`` are left as they are)."""
    covered = opt.caller_averaged
    if covered is None:
        return
    params = opt.flat.layout.params
    idx = [j for j, p in enumerate(params) if id(p) not in covered]
    if not idx:
        return
    n = sum(params[j].numel() for j in idx)
    buf = torch.zeros(n, dtype=torch.float32, device=opt.flat.layout.device)
    pieces = buf.split([params[j].numel() for j in idx])
    have = [(pieces[k], grads[j].reshape(-1)) for k, j in enumerate(idx) if grads[j] is not None]
    if have:  # (none: every such gradient is missing, zeros on this rank)
        torch._foreach_copy_(*map(list, zip(*have, strict=True)))
    nodes = opt.node_groups()
    if nodes is not None:
        hierarchical_average(buf, opt.average_dtype, nodes)
    else:
        start_average(buf, opt.average_dtype, opt.process_group)()
    for k, j in enumerate(idx):
        grads[j] = pieces[k].view_as(params[j])


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


def compressed_average_into(
    opt: OneBitOptimizer, source_of: SourceOf | torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Error-compensated 1-bit average over the ranks into ``out`` (W = 1: compression only).

    ``source_of`` is the flat input (``out`` defaults to it: in place) or a function giving it
    (or a [kernels.ExchangeSource][lightning_onebit.kernels.ExchangeSource] of it) for a flat
    slice: called here for each range the exchange still needs (with
    ``overlap_with_backward``, the buckets not started during backward). Raises
    NonFiniteError on every rank, with ``out`` and the error buffers untouched, when any
    rank's input has a NaN/Inf; or, when the exchange keeps its verdict on the device (CUDA,
    see ``DEVICE_VERDICT``), returns it (a bool tensor): where it is false the error buffers
    are untouched and ``out`` is undefined, and the caller's update kernels must take it.
    ``None`` otherwise.
    """
    if out is None:
        if callable(source_of):
            raise TypeError("out is required when source_of is a function")
        out = source_of
    return _exchange(opt, source_of, out)[0]


def compressed_average(
    opt: OneBitOptimizer, source_of: SourceOf | torch.Tensor, out: torch.Tensor | str
) -> tuple[torch.Tensor | None, torch.Tensor | SignRuns]:
    """``compressed_average_into`` for an update kernel that reads
    [kernels.SignRuns][lightning_onebit.kernels.SignRuns]: returns ``(ok, x)``, ``x`` the
    average with each group's ``exp_avg_mask`` applied. Where the update kernels read the
    exchange's result where it lies (``kernels.reads_sign_runs``: the CPU with the compiled
    kernels, no mask, no verdict on the device) ``x`` is that (``out`` is not written: the
    kernel never writes the decoded values out and reads them back); otherwise ``out``,
    decoded. ``out`` may name a work buffer (``FlatState.work``), made only if the result is
    decoded into it."""
    ex = opt.flat.exchange
    masked = any(g.get("exp_avg_mask") is not None for g in opt.param_groups)
    if ex.returns_runs and not masked and not ex.device_verdict and reads_sign_runs(ex.device):
        return _exchange(opt, source_of, None)
    out = opt.flat.work[out] if isinstance(out, str) else out
    ok, _ = _exchange(opt, source_of, out)
    opt.flat.apply_mask_(opt.param_groups, out)
    return ok, out


def as_source(values: torch.Tensor | ExchangeSource) -> ExchangeSource:
    """An exchange's input as a source: a flat tensor as a
    [kernels.TensorSource][lightning_onebit.kernels.TensorSource], a source as it is."""
    return TensorSource(values) if isinstance(values, torch.Tensor) else values


def _exchange(
    opt: OneBitOptimizer, source_of: SourceOf | torch.Tensor, out: torch.Tensor | None
) -> tuple[torch.Tensor | None, SignRuns | None]:
    """The 1-bit average into ``out`` (``None``: its runs, undecoded), its bytes counted: the
    verdict and the runs. The inputs are computed here, one source per range the exchange still
    needs (values already computed as a
    [kernels.TensorSource][lightning_onebit.kernels.TensorSource]): the exchange calls nothing of
    the optimizer's."""
    ex = opt.flat.exchange
    ranges = [slice(lo, hi) for lo, hi in ex.pending()]
    if callable(source_of):
        sources = [as_source(source_of(s)) for s in ranges]
    else:
        sources = [TensorSource(source_of.reshape(-1)[s]) for s in ranges]
    try:
        runs = ex.finish(sources, out)
    finally:
        ns = opt.topology.node_size(opt.world_size)
        opt.counters.add(ex.bytes_sent, ex.inter_node_bytes(ns))
    return opt.verdict.from_exchange(ex), runs


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
