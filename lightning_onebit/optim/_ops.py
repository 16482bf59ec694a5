"""The building blocks the algorithms' ``_step`` is written in, functions of the optimizer: the
two averages (full precision and 1-bit), the NaN/Inf checks, Adam's direction and step, the
frozen variance's denominator and its rescaling, and the decoupled update. They use the
optimizer's public attributes and composed objects (``flat``, ``verdict``, ``counters``,
``topology``, ``overlap``), nothing else of it."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_onebit.comm import (
    NonFiniteError,
    average_bytes,
    fp32_allreduce_bytes,
    hierarchical_average,
    start_average,
)
from lightning_onebit.kernels import (
    ExchangeSource,
    SignRuns,
    adam_update,
    frozen_adam_update,
    native,
)
from lightning_onebit.optim._nograd import any_missed_steps
from lightning_onebit.optim._variance import bias_corrections

if TYPE_CHECKING:
    from lightning_onebit.optim._base import OneBitOptimizer

__all__ = [
    "RESCALE_BETA",
    "RESCALE_INTERVAL",
    "RESCALE_MIN_BETA2",
    "RESCALE_STATES",
    "adam_direction",
    "adam_step_",
    "any_weight_decay",
    "average_",
    "compressed_average",
    "compressed_average_",
    "decoupled_decay",
    "decoupled_update_",
    "denominator",
    "finite",
    "finite_on_device",
    "frozen_adam_update_",
    "init_rescale",
    "rescale_at_switch_",
    "rescale_reduce_",
    "rescale_reduce_if_due",
    "rescale_variance_",
    "rescale_warmup_",
    "variance_scales",
]

#: ``rescale_variance``: the warmup's running mean square of the averaged gradients keeps this
#: much of its last value per update (a horizon of ~10 steps, that of the first all-reduce
#: after the switch); the ranks all-reduce their local mean squares every ``RESCALE_INTERVAL``
#: steps
RESCALE_BETA = 0.9
RESCALE_INTERVAL = 10
#: ``rescale_variance``: the slowest ``beta2`` its average of each tensor's mean square takes
#: (a horizon of at least 100 steps, see :func:`rescale_variance_`)
RESCALE_MIN_BETA2 = 0.99


def decoupled_decay(group: dict[str, Any]) -> float:
    """The group's decoupled weight decay (AdamW's, ``p -= lr * wd * p``): its
    ``weight_decay``, or 0 where ``decoupled_weight_decay=False`` makes it torch Adam's L2
    term, which :meth:`FlatState.gather_grads` adds to the gradient instead."""
    return group["weight_decay"] if group.get("decoupled_weight_decay", True) else 0.0


def average_(opt: OneBitOptimizer, flat: torch.Tensor) -> torch.Tensor | None:
    """Full-precision average over the ranks (in ``average_dtype``), in place, unless the
    caller already averaged.

    The bytes of this allreduce count in ``comm_stats`` either way: the algorithm needs
    them, whether this optimizer or DDP sends them. Raises NonFiniteError (the same on every
    rank: the values are averaged) if a value is not finite; or, with device verdicts (CUDA,
    see ``DEVICE_VERDICT``), returns that verdict as a bool tensor on the device, for the
    step's update to take. ``None`` otherwise.
    """
    w, nodes = opt.world_size, opt.node_groups()
    if w > 1 and opt.average_warmup_grads:
        if opt.overlap is not None and flat is opt.flat.grad:
            opt.overlap.all_reduce()  # per bucket, some started during backward
        elif nodes is not None:
            hierarchical_average(flat, opt.average_dtype, nodes)
        else:
            start_average(flat, opt.average_dtype, opt.process_group)()
    elif w > 1 and flat is opt.flat.grad:
        average_uncovered_(opt)
    if nodes is not None:
        intra, inter = average_bytes(flat.numel(), opt.average_dtype, nodes)
        opt.counters.add(intra + inter, inter)
    else:
        sent = fp32_allreduce_bytes(flat.numel(), w) * opt.average_dtype.itemsize // 4
        opt.counters.add_ring(sent, w, opt.topology.node_size(w))
    if opt.verdict.uses_device(opt.flat.layout.device):  # averaged: the same verdict on every rank
        ok = finite_on_device(flat)
        return opt.verdict.keep(ok, ok, "average")
    if not finite(flat):
        raise NonFiniteError(
            f"the averaged gradient has non-finite values (NaN/Inf) at step {opt.step_count}"
        )
    return None


def average_uncovered_(opt: OneBitOptimizer) -> None:
    """``average_warmup_grads=False``: the caller (DDP) averaged the gradients of the
    parameters it knows, :attr:`caller_averaged`. DDP knows those that required grad when it
    was built; one made trainable later (e.g. the backbone that Lightning's
    ``BackboneFinetuning`` unfreezes mid-run) keeps its local gradient, and the ranks would
    drift apart silently (as they do under plain DDP). Those are averaged here, in one
    all_reduce."""
    covered = opt.caller_averaged
    if covered is None:
        return
    views = opt.flat.views["grad"]
    idx = [j for j, p in enumerate(opt.flat.layout.params) if id(p) not in covered]
    if not idx:
        return
    buf = torch.cat([views[j].reshape(-1) for j in idx])
    nodes = opt.node_groups()
    if nodes is not None:
        hierarchical_average(buf, opt.average_dtype, nodes)
    else:
        start_average(buf, opt.average_dtype, opt.process_group)()
    for j, piece in zip(idx, buf.split([views[j].numel() for j in idx]), strict=True):
        views[j].copy_(piece.view_as(views[j]))


def finite(flat: torch.Tensor) -> bool:
    """Whether every value is finite: one read-only sweep, no temporary (min and max
    propagate NaN; +Inf is the max, -Inf the min). A float64 sum would be as exact but
    materialises a float64 copy of the buffer."""
    return bool(finite_on_device(flat))


def finite_on_device(flat: torch.Tensor) -> torch.Tensor:
    """:func:`finite` as a one-element bool tensor on ``flat``'s device (no host read)."""
    if flat.numel() == 0:
        return torch.ones(1, dtype=torch.bool, device=flat.device)
    lo, hi = torch.aminmax(flat)
    return (torch.isfinite(lo) & torch.isfinite(hi)).reshape(1)


def compressed_average_(
    opt: OneBitOptimizer,
    source: torch.Tensor | Callable[[slice], torch.Tensor | ExchangeSource],
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Error-compensated 1-bit average over the ranks into ``out`` (W = 1: compression only).

    ``source`` is the flat input (``out`` defaults to it: in place) or a function computing
    it (or a :class:`~lightning_onebit.kernels.ExchangeSource` of it) for a flat slice, so that with :meth:`overlap_with_backward` only the buckets not
    started during backward are computed here. Raises NonFiniteError on every rank, with
    ``out`` and the error buffers untouched, when any rank's input has a NaN/Inf; or, when
    the exchange keeps its verdict on the device (CUDA, see ``DEVICE_VERDICT``), returns it
    (a bool tensor): where it is false the error buffers are untouched and ``out`` is
    undefined, and the caller's update kernels must take it. ``None`` otherwise.
    """
    if out is None:
        if callable(source):
            raise TypeError("out is required when source is a function")
        out = source
    return _exchange(opt, source, out, decode=True)[0]


def compressed_average(
    opt: OneBitOptimizer,
    source: Callable[[slice], torch.Tensor | ExchangeSource],
    out: torch.Tensor | str,
) -> tuple[torch.Tensor | None, torch.Tensor | SignRuns]:
    """:func:`compressed_average_` for an update kernel that reads
    :class:`~lightning_onebit.kernels.SignRuns`: returns ``(ok, x)``, ``x`` the average with
    each group's ``exp_avg_mask`` applied. On the CPU with the compiled kernels and no mask,
    ``x`` is the exchange's result where it lies (``out`` is not written: the kernel never
    writes the decoded values out and reads them back); otherwise (also with a verdict kept
    on the device, whose path reads ``x`` with torch ops) ``out``, decoded. ``out`` may name
    a work buffer (:attr:`FlatState.work`), made only if the result is decoded into it."""
    masked = any(g.get("exp_avg_mask") is not None for g in opt.param_groups)
    direct = (
        opt.flat.layout.device.type == "cpu"
        and native.use_native()
        and not masked
        and not opt.flat.exchange.device_verdict
    )
    target = (lambda: opt.flat.work[out]) if isinstance(out, str) else out
    ok, runs = _exchange(opt, source, target, decode=not direct)
    if runs is not None:
        return ok, runs
    out = opt.flat.work[out] if isinstance(out, str) else out
    opt.flat.apply_mask_(opt.param_groups, out)
    return ok, out


def _exchange(
    opt: OneBitOptimizer,
    source: torch.Tensor | Callable[[slice], torch.Tensor | ExchangeSource],
    out: torch.Tensor | Callable[[], torch.Tensor],
    decode: bool,
) -> tuple[torch.Tensor | None, SignRuns | None]:
    """The 1-bit average (``finish(..., decode=decode)``), its bytes counted; the verdict
    and the runs (``None``: decoded into ``out``)."""
    ex = opt.flat.exchange
    try:
        runs = ex.finish(
            (lambda lo, hi: source(slice(lo, hi))) if callable(source) else source,
            out,
            decode=decode,
        )
    finally:
        ns = opt.topology.node_size(opt.world_size)
        opt.counters.add(ex.bytes_sent, ex.inter_node_bytes(ns))
    return opt.verdict.take(ex), runs


def adam_direction(opt: OneBitOptimizer, out: torch.Tensor) -> torch.Tensor:
    """``out = exp_avg / (sqrt(exp_avg_sq) + eps) + weight_decay * p`` (decoupled decay);
    with ``bias_correction`` the moments are bias-corrected first, per group, or per parameter
    where some parameter missed steps for want of a gradient (each counts its own steps, as
    torch's Adam)."""
    m, v = opt.flat.states["exp_avg"], opt.flat.states["exp_avg_sq"]
    p = opt.flat.gather_params() if any_weight_decay(opt) else None
    layout, per_param = opt.flat.layout, opt.bias_correction and any_missed_steps(opt)
    for gi, group, seg in opt.flat.segments(opt.param_groups):
        if per_param:
            parts = [
                (j, slice(layout.offsets[j], layout.offsets[j] + layout.params[j].numel()))
                for j in layout.group_params(gi)
            ]
        else:
            parts = [(None, seg)]
        for j, s in parts:
            eps, scale = group["eps"], 1.0
            if opt.bias_correction:  # m/bc1 / (sqrt(v/bc2) + eps)
                bc1, bc2 = bias_corrections(opt, gi, j)
                eps, scale = eps * math.sqrt(bc2), math.sqrt(bc2) / bc1
            torch.sqrt(v[s], out=out[s]).add_(eps)
            torch.div(m[s], out[s], out=out[s])
            if scale != 1.0:
                out[s].mul_(scale)
        if decoupled_decay(group) > 0:
            out[seg].add_(p[seg], alpha=decoupled_decay(group))
    return out


def denominator(opt: OneBitOptimizer) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``sqrt(exp_avg_sq) + eps`` (and its per-parameter views), computed once while the
    variance stays frozen: two sweeps fewer per step. Dropped when the layout or the state
    is rebuilt (``_prepare``, ``load_state_dict``), eps changes, or ``rescale_variance``
    moved a tensor's scale (then ``sqrt(v * r_j) + eps``, see :func:`rescale_variance_`)."""
    eps = [group["eps"] for group in opt.param_groups]
    cache = opt.flat.denominator
    if cache is None or cache[2] != eps:
        v = opt.flat.states["exp_avg_sq"]
        if cache is None:  # (dropped at every rebuild of the layout)
            d = torch.empty_like(v)
            views = opt.flat.layout.views(d)
        else:  # out of date (FlatState.stale_denominator, another eps): recomputed in place
            d, views = cache[0], cache[1]
        torch.sqrt(v, out=d)
        r = variance_scales(opt)
        if r is not None:  # tensor j times sqrt(r_j): a float32 multiply per value, no host read
            for dj, sj in zip(views, r.sqrt().unbind(), strict=True):
                dj.mul_(sj)
        for _, group, s in opt.flat.segments(opt.param_groups):
            d[s].add_(group["eps"])
        cache = opt.flat.denominator = (d, views, eps)
    return cache[0], cache[1]


# ------------------------------------------------------------------ rescale_variance

#: ``rescale_variance``'s per-tensor states and their values before anything is measured:
#: this rank's sum of ``g**2`` since the last all-reduce, the warmup's running mean square of
#: the averaged gradients, the factor that turns the local gradients' mean square into the
#: variance's units, and the ratio ``r`` of Adam's variance now to the frozen one
RESCALE_STATES = {
    "grad_sq_sum": 0.0,
    "grad_sq_recent": 0.0,
    "grad_sq_scale": 0.0,
    "grad_sq_ratio": 1.0,
}


def init_rescale(opt: OneBitOptimizer) -> None:
    """Give ``opt`` the counters of ``rescale_variance`` (and, where it is on, its per-tensor
    states and checkpointed counters): ``grad_sq_weight`` (the warmup's running mean square
    less its initial zeros' weight, for the bias correction), ``grad_sq_count`` (the gradients
    Adam's variance would have averaged by now), ``grad_sq_updates`` (all-reduces since the
    switch), ``grad_sq_steps`` (steps summed into ``grad_sq_sum`` since the last one) and
    ``_rescale_due`` (with device verdicts: a reduce waiting for the next step's start)."""
    if opt.rescale_variance:
        opt._scalar_states = {**opt._scalar_states, **RESCALE_STATES}
        opt._checkpoint_attrs = (
            *opt._checkpoint_attrs,
            "grad_sq_weight",
            "grad_sq_count",
            "grad_sq_updates",
            "grad_sq_steps",
            "_rescale_due",
        )
    opt.grad_sq_weight = 0.0
    opt.grad_sq_count = 0
    opt.grad_sq_updates = 0
    opt.grad_sq_steps = 0
    opt._rescale_due = False


def variance_scales(opt: OneBitOptimizer) -> torch.Tensor | None:
    """``r_j`` per tensor, the factor on its frozen variance (see :func:`rescale_variance_`),
    or ``None`` while nothing rescales (``rescale_variance`` off, or no all-reduce since the
    switch)."""
    if not opt.rescale_variance or opt.grad_sq_updates == 0:
        return None
    return opt.flat.scalars["grad_sq_ratio"]


def _sums_of_squares(opt: OneBitOptimizer, xs: list[torch.Tensor | None]) -> torch.Tensor:
    """Per tensor of the layout, the sum of its values squared (one fused kernel over the
    tensors; ``None``: a missing gradient, zeros)."""
    none = opt.flat.states["exp_avg"][:0]  # (the norm of no values: +0.0, as of zeros)
    sq = torch.stack(torch._foreach_norm([none if x is None else x for x in xs]))
    return sq.square_()


def rescale_warmup_(opt: OneBitOptimizer, ok: torch.Tensor | None = None) -> None:
    """``rescale_variance`` before the switch: the running mean square (a factor
    ``RESCALE_BETA`` per update, the horizon of the reference that follows the switch) of the
    averaged gradients the variance was just updated with (the flat gradient buffer). Call on
    every step that updates the variance; ``ok``: the step's verdict on the device (nothing
    changes where it is false; the host takes its weight back when it learns of it)."""
    if not opt.rescale_variance:
        return
    ms = _sums_of_squares(opt, opt.flat.views["grad"]) / opt.flat.layout.sizes.clamp_min(1)
    recent = opt.flat.scalars["grad_sq_recent"]
    new = torch.lerp(recent, ms, 1.0 - RESCALE_BETA)
    recent.copy_(new if ok is None else torch.where(ok, new, recent))
    opt.grad_sq_weight = 1.0 - (1.0 - opt.grad_sq_weight) * RESCALE_BETA


def rescale_at_switch_(opt: OneBitOptimizer) -> None:
    """``rescale_variance`` at the switch, before the variance is folded and floored: per
    tensor, the mean ``A_j`` of Adam's bias-corrected variance, and ``grad_sq_scale`` = the
    averaged gradients' recent mean square (the warmup's, else ``A_j``) over ``A_j`` (0 where
    ``A_j`` is 0: that tensor is not rescaled)."""
    if not opt.rescale_variance:
        return
    v = opt.flat.views["exp_avg_sq"]
    sizes = opt.flat.layout.sizes.clamp_min(1)
    bc2 = [bias_corrections(opt, gi, j)[1] for j, gi in enumerate(opt.flat.layout.group_of)]
    mean_v = torch.stack(torch._foreach_norm(v, 1)) / sizes
    a = mean_v / torch.tensor(bc2, dtype=torch.float64).to(mean_v)
    recent = opt.flat.scalars["grad_sq_recent"]
    glob = recent / opt.grad_sq_weight if opt.grad_sq_weight > 0 else a
    opt.flat.scalars["grad_sq_scale"].copy_(torch.where(a > 0, glob / a, 0.0))
    opt.flat.scalars["grad_sq_ratio"].fill_(1.0)
    opt.grad_sq_count = opt.variance_updates
    opt.grad_sq_updates = opt.grad_sq_steps = 0
    opt.flat.scalars["grad_sq_sum"].zero_()


def rescale_variance_(
    opt: OneBitOptimizer,
    grads: list[torch.Tensor | None] | None,
    reduce: bool,
    ok: torch.Tensor | None = None,
) -> None:
    """``rescale_variance``: let the frozen variance follow, per tensor, what Adam's variance
    would do with the gradients of the frozen phase (call at the end of every step of it).

    The variance froze at the switch, but the gradients go on changing: where a tensor's
    gradients grow (attention and feed-forward layers of transformers, whose gradient RMS
    can double in the steps after the warmup) ``m / sqrt(v)`` grows with them, and with it
    every coordinate's 1-bit step; where they shrink, Adam's variance would shrink and its
    steps stay the same size, while the frozen one's shrink. Adam's variance of tensor ``j``,
    averaged over the tensor, is ``A_j``: a ``beta2`` average of the averaged gradients' mean
    square. After the switch only local gradients are seen, whose mean square is larger by
    their noise; so each rank sums its local ``g**2`` per tensor, and every
    ``rescale_interval`` (10) steps, on a step that communicates anyway (``reduce``: every
    step of 1-bit Adam, 0/1 Adam's sync steps), the ranks all-reduce the sums' means, one
    float per tensor. The first of these (the first 10 frozen steps) sets the local to
    averaged ratio ``c_j`` (that mean over the warmup's recent averaged mean square, see
    :func:`rescale_warmup_`); each one feeds ``A_j`` the mean divided by ``c_j``, weighted as
    that many of Adam's ``beta2`` steps, and tensor ``j`` is preconditioned by ``v * r_j``,
    ``r_j = A_j(now) / A_j(switch)`` (both bias-corrected).

    ``A_j`` averages over ``1 / (1 - beta2)`` steps, but never fewer than
    ``1 / (1 - RESCALE_MIN_BETA2)`` = 100: one factor scales every coordinate of the tensor,
    and its mean square is carried by its largest coordinates, which spike. Over a short
    ``beta2`` such as 0.95 the factor would follow a spike up and back down within tens of
    steps, and as it fades enlarge the steps of every coordinate whose own variance did not
    move.

    ``grads``: this step's local gradients, one per parameter of the layout (the views of the
    flat gradient buffer, or :meth:`FlatState.grads`: the parameters' own, ``None`` for zeros),
    or ``None`` for a step that has none to count (a rank's skipped local step: it counts as
    zeros, so that every rank counts the same steps and reduces on the same one). ``ok``: the
    step's verdict on the device (see :func:`compressed_average_`): a dropped step adds zeros,
    and its count is taken back when the host learns of it; the reduce then waits for the next
    step's start.
    """
    if not opt.rescale_variance:
        return
    total = opt.flat.scalars["grad_sq_sum"]
    if grads is not None:
        sq = _sums_of_squares(opt, grads)
        total.add_(sq if ok is None else torch.where(ok, sq, 0.0))
    opt.grad_sq_steps += 1
    due = reduce and opt.grad_sq_steps >= opt.rescale_interval
    if ok is not None:  # (a dropped step's count is taken back when the host learns it)
        opt._rescale_due = due  # the reduce is at the next step's start
    elif due:
        rescale_reduce_(opt)


def rescale_reduce_if_due(opt: OneBitOptimizer) -> None:
    """``rescale_variance`` with the verdict on the device: the reduce that
    :func:`rescale_variance_` leaves to the start of the next step, when the host knows
    whether the step that made it due counted (the same values, one step later on the
    wire). Called at the start of every step."""
    if opt._rescale_due and opt.verdict.uses_device(opt.flat.layout.device):
        opt._rescale_due = False
        rescale_reduce_(opt)


def rescale_reduce_(opt: OneBitOptimizer) -> None:
    """All-reduce the summed mean squares and feed them to Adam's variance's mean (see
    :func:`rescale_variance_`)."""
    total, n = opt.flat.scalars["grad_sq_sum"], opt.grad_sq_steps
    mean = total / (opt.flat.layout.sizes.clamp_min(1) * n)
    w = opt.world_size
    if w > 1:
        dist.all_reduce(mean, group=opt.process_group)
        mean.div_(w)
        sent = fp32_allreduce_bytes(mean.numel(), w)  # (one float per tensor: no ring)
        opt.counters.add(sent, sent if opt.topology.node_size(w) < w else 0)
    total.zero_()
    opt.grad_sq_steps = 0
    scale, ratio = opt.flat.scalars["grad_sq_scale"], opt.flat.scalars["grad_sq_ratio"]
    if opt.grad_sq_updates == 0:  # the first frozen steps: c_j, local over averaged
        scale.copy_(torch.where(mean > 0, scale / mean, 0.0))
    fed = torch.where(scale > 0, mean * scale, 1.0)  # A_j's new mean square over A_j(switch)
    # r = A(now) / A(switch), A bias-corrected: the weights of a beta2 average (at least
    # RESCALE_MIN_BETA2) after k and k + n updates, per group. A group's tensors are
    # consecutive in the layout (it is built group by group): a slice, and the weights reach
    # the device as kernel arguments, with no host-to-device copy.
    k = opt.grad_sq_count
    for gi, group in enumerate(opt.param_groups):
        idx = opt.flat.layout.group_params(gi)
        if not idx:
            continue
        beta2 = max(group["betas"][1], RESCALE_MIN_BETA2)
        keep, before, after = beta2**n, 1.0 - beta2**k, 1.0 - beta2 ** (k + n)
        s = slice(idx[0], idx[-1] + 1)
        ratio[s].mul_(keep * before / after).add_(fed[s], alpha=(1.0 - keep) / after)
    opt.grad_sq_count = k + n
    opt.grad_sq_updates += 1
    opt.flat.stale_denominator()  # the next step is preconditioned by v * r


def decoupled_update_(
    opt: OneBitOptimizer, x: torch.Tensor, frozen_denominator: bool = False
) -> None:
    """``p -= lr * (x + weight_decay * p)`` for every parameter (``x``: a flat direction), or
    with ``frozen_denominator`` ``p -= lr * (x / (sqrt(v) + eps) + weight_decay * p)`` (the
    variance frozen). The decay is subtracted, ``p += -lr * wd * p``, one rounding of the
    result: the factor ``p * float32(1 - lr * wd)`` would carry the same rounding error
    into every step (it decays 1.5% too much at ``lr * wd = 1e-6``, 17% at ``1e-7``)."""
    views = opt.flat.views_of(x)
    denom = denominator(opt)[1] if frozen_denominator else None
    for gi, group, _ in opt.flat.segments(opt.param_groups):
        idx = opt.flat.layout.group_params(gi)
        params = [opt.flat.layout.params[j] for j in idx]
        lr, wd = group["lr"], decoupled_decay(group)
        if wd > 0:
            torch._foreach_add_(params, params, alpha=-lr * wd)
        xs = [views[j] for j in idx]
        if denom is None:
            torch._foreach_add_(params, xs, alpha=-lr)
        else:
            torch._foreach_addcdiv_(params, xs, [denom[j] for j in idx], value=-lr)


def frozen_adam_update_(
    opt: OneBitOptimizer, ok: torch.Tensor | None, x: torch.Tensor | SignRuns
) -> None:
    """1-bit Adam's compression-phase update from the exchanged ``x``, only where the
    verdict ``ok`` (on the device; ``None``: always) is true: ``m = x * d`` and
    ``p -= lr * (x + wd * p)`` with ``preconditioned_exchange``, else ``m = x`` and
    ``p -= lr * (x / d + wd * p)`` (``d = sqrt(v) + eps``, frozen; ``x`` may be ``m``
    itself, or the exchange's :class:`~lightning_onebit.kernels.SignRuns`);
    :func:`~lightning_onebit.kernels.frozen_adam_update` (one sweep on the CPU too,
    the floats of :func:`decoupled_update_`)."""
    layout, groups = opt.flat.layout, opt.param_groups
    of = layout.group_of
    frozen_adam_update(
        ok,
        x,
        opt.flat.states["exp_avg"],
        denominator(opt)[0],
        layout.params,
        layout.offsets,
        [groups[of[j]]["lr"] for j in range(len(layout.params))],
        [decoupled_decay(groups[of[j]]) for j in range(len(layout.params))],
        opt.preconditioned_exchange,
    )


def adam_step_(
    opt: OneBitOptimizer, update_variance: bool = True, ok: torch.Tensor | None = None
) -> None:
    """Adam's step from the flat gradient buffer, one fused sweep
    (:func:`~lightning_onebit.kernels.adam_update`): ``m = beta1 m + (1 - beta1) g``;
    ``v = beta2 v + (1 - beta2) g**2`` if ``update_variance``;
    ``p -= lr * (m / (sqrt(v) + eps) + weight_decay * p)``. With ``bias_correction``, as
    torch's Adam/AdamW: ``m / (1 - beta1**t)`` over ``sqrt(v / (1 - beta2**k)) + eps``,
    folded into the kernel's per-parameter ``lr``, ``eps`` and ``weight_decay``. ``ok``: the
    step's verdict on the device (nothing is written where it is false)."""
    layout, groups = opt.flat.layout, opt.param_groups
    if update_variance:
        opt.variance_updates += 1

    def hparams(gi: int, j: int | None = None) -> tuple[float, ...]:
        group = groups[gi]
        lr, eps, wd = group["lr"], group["eps"], decoupled_decay(group)
        if opt.bias_correction:
            bc1, bc2 = bias_corrections(opt, gi, j)
            lr_c = lr * math.sqrt(bc2) / bc1
            lr, eps, wd = lr_c, eps * math.sqrt(bc2), (wd * lr / lr_c if lr_c else wd)
        return (lr, *group["betas"], eps, wd)

    if opt.bias_correction and any_missed_steps(opt):  # each parameter's own steps
        per_param = [hparams(gi, j) for j, gi in enumerate(layout.group_of)]
    else:
        hp = [hparams(gi) for gi in range(len(groups))]
        per_param = [hp[gi] for gi in layout.group_of]
    adam_update(
        opt.flat.grad,
        opt.flat.states["exp_avg"],
        opt.flat.states["exp_avg_sq"],
        layout.params,
        layout.offsets,
        *(list(col) for col in zip(*per_param, strict=True)),
        update_variance=update_variance,
        ok=ok,
    )


def any_weight_decay(opt: OneBitOptimizer) -> bool:
    return any(decoupled_decay(group) > 0 for _, group, _ in opt.flat.segments(opt.param_groups))
