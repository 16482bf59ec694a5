"""The building blocks the algorithms' ``_step`` is written in: per-group slices of the flat
buffers, gathering gradients and parameters, the two averages (full precision and 1-bit), Adam's
direction and step, and writing back into the parameters."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from lightning_onebit.comm import (
    NonFiniteError,
    average_bytes,
    fp32_allreduce_bytes,
    hierarchical_average,
    start_average,
)
from lightning_onebit.kernels import adam_update, frozen_adam_update
from lightning_onebit.optim._variance import bias_corrections

__all__ = [
    "RESCALE_BETA",
    "RESCALE_INTERVAL",
    "RESCALE_REFERENCE_UPDATES",
    "FlatOps",
    "decoupled_decay",
]

#: ``rescale_variance``: the running mean square of each tensor's gradients keeps this much of
#: its last value per step (a horizon of ~10 steps); the ranks all-reduce it every
#: ``RESCALE_INTERVAL`` steps, and its value after ``RESCALE_REFERENCE_UPDATES`` of them is the
#: scale the frozen variance stands for
RESCALE_BETA = 0.9
RESCALE_INTERVAL = 10
RESCALE_REFERENCE_UPDATES = 1


def decoupled_decay(group: dict[str, Any]) -> float:
    """The group's decoupled weight decay (AdamW's, ``p -= lr * wd * p``): its
    ``weight_decay``, or 0 where ``decoupled_weight_decay=False`` makes it torch Adam's L2
    term, which :meth:`FlatOps._gather_grads` adds to the gradient instead."""
    return group["weight_decay"] if group.get("decoupled_weight_decay", True) else 0.0


class FlatOps:
    """``OneBitOptimizer``'s arithmetic on its flat buffers (see ``_base.py``)."""

    def _segments(self) -> Iterator[tuple[int, dict[str, Any], slice]]:
        """(group index, group, slice of the flat buffers) for every non-empty group."""
        for gi, (group, seg) in enumerate(
            zip(self.param_groups, self._layout.segments, strict=True)
        ):
            if seg.stop > seg.start:
                yield gi, group, seg

    def _segments_in(self, s: slice) -> Iterator[tuple[int, dict[str, Any], slice]]:
        """(group index, group, sub-slice) for every group that intersects the flat slice ``s``."""
        for gi, group, seg in self._segments():
            lo, hi = max(seg.start, s.start), min(seg.stop, s.stop)
            if lo < hi:
                yield gi, group, slice(lo, hi)

    def _gather_grads(self, only: list[int] | None = None) -> torch.Tensor:
        """Copy the gradients into the flat fp32 gradient buffer (zeros where ``.grad`` is None):
        those of the parameters ``only`` (indices into the layout), or every one not copied yet
        this step. One multi-tensor copy (a launch per parameter would cost more than the copy
        on a GPU), then each group's ``maximize`` and torch Adam's L2 term where set."""
        params, views = self._layout.params, self._views["grad"]
        groups, of = self.param_groups, self._layout.group_of
        dst, src, zero, adjust = [], [], [], []
        for j in range(len(params)) if only is None else only:
            if only is None and j in self._skip_gather:
                continue
            g = params[j].grad
            if g is None:
                zero.append(views[j])
                continue
            if g.is_sparse:
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients "
                    "(use a dense embedding: nn.Embedding(..., sparse=False))"
                )
            dst.append(views[j])
            src.append(g)
            group = groups[of[j]]
            if group.get("maximize", False) or not group.get("decoupled_weight_decay", True):
                adjust.append(j)
        if zero:
            torch._foreach_zero_(zero)
        if dst:
            torch._foreach_copy_(dst, src)
        for j in adjust:
            group, view = groups[of[j]], views[j]
            if group.get("maximize", False):  # (as torch's Adam: before the L2 term)
                view.neg_()
            if not group.get("decoupled_weight_decay", True) and group["weight_decay"] > 0:
                view.add_(params[j], alpha=group["weight_decay"])  # torch Adam's L2 term
        return self._grad

    def _gather_params(self, s: slice | None = None) -> torch.Tensor:
        """Copy the parameters (those starting in the flat slice ``s``, default all) into a flat
        fp32 buffer (for weight decay and norms)."""
        views, offsets = self._views["param"], self._layout.offsets
        for j, p in enumerate(self._layout.params):
            if s is None or s.start <= offsets[j] < s.stop:
                views[j].copy_(p)
        return self._param_flat

    def _average_(self, flat: torch.Tensor) -> torch.Tensor | None:
        """Full-precision average over the ranks (in ``average_dtype``), in place, unless the
        caller already averaged.

        The bytes of this allreduce count in ``comm_stats`` either way: the algorithm needs
        them, whether this optimizer or DDP sends them. Raises NonFiniteError (the same on every
        rank: the values are averaged) if a value is not finite; or, with device verdicts (CUDA,
        see ``DEVICE_VERDICT``), returns that verdict as a bool tensor on the device, for the
        step's update to take. ``None`` otherwise.
        """
        w, nodes = self.world_size, self.node_groups()
        if w > 1 and self.average_warmup_grads:
            if self._overlap is not None and flat is self._grad:
                self._overlap.all_reduce()  # per bucket, some started during backward
            elif nodes is not None:
                hierarchical_average(flat, self.average_dtype, nodes)
            else:
                start_average(flat, self.average_dtype, self.process_group)()
        elif w > 1 and flat is self._grad:
            self._average_uncovered_()
        if nodes is not None:
            intra, inter = average_bytes(flat.numel(), self.average_dtype, nodes)
            self.counters.add(intra + inter, inter)
        else:
            sent = fp32_allreduce_bytes(flat.numel(), w) * self.average_dtype.itemsize // 4
            self.counters.add_ring(sent, w, self.topology.node_size(w))
        if self._device_verdicts:  # averaged: the same verdict on every rank
            ok = self._finite_on_device(flat)
            return self.verdict.keep(ok, ok, "average")
        if not self._finite(flat):
            raise NonFiniteError(
                f"the averaged gradient has non-finite values (NaN/Inf) at step {self.step_count}"
            )
        return None

    def _average_uncovered_(self) -> None:
        """``average_warmup_grads=False``: the caller (DDP) averaged the gradients of the
        parameters it knows, :attr:`caller_averaged`. DDP knows those that required grad when it
        was built; one made trainable later (e.g. the backbone that Lightning's
        ``BackboneFinetuning`` unfreezes mid-run) keeps its local gradient, and the ranks would
        drift apart silently (as they do under plain DDP). Those are averaged here, in one
        all_reduce."""
        covered = self.caller_averaged
        if covered is None:
            return
        views = self._views["grad"]
        idx = [j for j, p in enumerate(self._layout.params) if id(p) not in covered]
        if not idx:
            return
        buf = torch.cat([views[j].reshape(-1) for j in idx])
        nodes = self.node_groups()
        if nodes is not None:
            hierarchical_average(buf, self.average_dtype, nodes)
        else:
            start_average(buf, self.average_dtype, self.process_group)()
        for j, piece in zip(idx, buf.split([views[j].numel() for j in idx]), strict=True):
            views[j].copy_(piece.view_as(views[j]))

    @staticmethod
    def _finite(flat: torch.Tensor) -> bool:
        """Whether every value is finite: one read-only sweep, no temporary (min and max
        propagate NaN; +Inf is the max, -Inf the min). A float64 sum would be as exact but
        materialises a float64 copy of the buffer."""
        return bool(FlatOps._finite_on_device(flat))

    @staticmethod
    def _finite_on_device(flat: torch.Tensor) -> torch.Tensor:
        """:meth:`_finite` as a one-element bool tensor on ``flat``'s device (no host read)."""
        if flat.numel() == 0:
            return torch.ones(1, dtype=torch.bool, device=flat.device)
        lo, hi = torch.aminmax(flat)
        return (torch.isfinite(lo) & torch.isfinite(hi)).reshape(1)

    def _compressed_average_(
        self,
        source: torch.Tensor | Callable[[slice], torch.Tensor],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Error-compensated 1-bit average over the ranks into ``out`` (W = 1: compression only).

        ``source`` is the flat input (``out`` defaults to it: in place) or a function computing
        it for a flat slice, so that with :meth:`overlap_with_backward` only the buckets not
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
        ex = self._exchange
        try:
            ex.finish((lambda lo, hi: source(slice(lo, hi))) if callable(source) else source, out)
        finally:
            ns = self.topology.node_size(self.world_size)
            self.counters.add(ex.bytes_sent, ex.inter_node_bytes(ns))
        return self.verdict.take(ex)

    def _apply_exp_avg_mask_(self, flat: torch.Tensor) -> None:
        """Multiply by each group's ``exp_avg_mask`` (1-bit signs cannot encode exact zeros)."""
        views = None
        for gi, group, _ in self._segments():
            mask = group.get("exp_avg_mask")
            if mask is None:
                continue
            if mask.device != flat.device or mask.dtype != flat.dtype:
                mask = group["exp_avg_mask"] = mask.to(device=flat.device, dtype=flat.dtype)
            views = views if views is not None else self._layout.views(flat)
            for j in self._layout.group_params(gi):
                views[j].mul_(mask)

    def _adam_direction(self, out: torch.Tensor) -> torch.Tensor:
        """``out = exp_avg / (sqrt(exp_avg_sq) + eps) + weight_decay * p`` (decoupled decay);
        with ``bias_correction`` the moments are bias-corrected first."""
        m, v = self._flat["exp_avg"], self._flat["exp_avg_sq"]
        p = self._gather_params() if self._any_weight_decay() else None
        for gi, group, s in self._segments():
            eps, scale = group["eps"], 1.0
            if self.bias_correction:  # m/bc1 / (sqrt(v/bc2) + eps)
                bc1, bc2 = bias_corrections(self, gi)
                eps, scale = eps * math.sqrt(bc2), math.sqrt(bc2) / bc1
            torch.sqrt(v[s], out=out[s]).add_(eps)
            torch.div(m[s], out[s], out=out[s])
            if scale != 1.0:
                out[s].mul_(scale)
            if decoupled_decay(group) > 0:
                out[s].add_(p[s], alpha=decoupled_decay(group))
        return out

    def _frozen_denominator(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``sqrt(exp_avg_sq) + eps`` (and its per-parameter views), computed once while the
        variance stays frozen: two sweeps fewer per step. Dropped when the layout or the state
        is rebuilt (``_prepare``, ``load_state_dict``), eps changes, or ``rescale_variance``
        moved a tensor's scale (then ``sqrt(v * r_j) + eps``, see :meth:`_rescale_variance_`)."""
        eps = [group["eps"] for group in self.param_groups]
        cache = self._denominator
        if cache is None or cache[2] != eps:
            v = self._flat["exp_avg_sq"]
            d = torch.empty_like(v)
            torch.sqrt(v, out=d)
            r = self._variance_scales()
            if r is not None:  # sqrt(r_j) on every coordinate of tensor j, in one sweep
                d.mul_(torch.repeat_interleave(r.sqrt(), self._layout.sizes, output_size=d.numel()))
            for _, group, s in self._segments():
                d[s].add_(group["eps"])
            cache = self._denominator = (d, self._layout.views(d), eps)
        return cache[0], cache[1]

    # ------------------------------------------------------------------ rescale_variance

    def _variance_scales(self) -> torch.Tensor | None:
        """``r_j = max(1, G_j / G_ref_j)`` per tensor (``G``: the running mean square of the
        tensor's local gradients, ``G_ref`` its value at the start of the frozen phase), or
        ``None`` while nothing rescales (``rescale_variance`` off, or no reference yet)."""
        if not self.rescale_variance or self.grad_sq_updates < self.rescale_reference_updates:
            return None
        avg, ref = self._scalars["grad_sq_avg"], self._scalars["grad_sq_ref"]
        now = avg / self.grad_sq_weight  # bias-corrected
        return torch.where(ref > 0, now / ref, 1.0).clamp_min_(1.0)

    def _rescale_variance_(
        self, g: torch.Tensor | None, reduce: bool, ok: torch.Tensor | None = None
    ) -> None:
        """``rescale_variance``: keep the frozen variance at least as large as each tensor's
        current gradient scale (call at the end of every step of the frozen phase).

        The variance froze at the switch, but gradients keep changing: where a tensor's
        gradients grow (attention and feed-forward layers of transformers, whose gradient RMS
        can double in the steps after the warmup), ``m / sqrt(v)`` grows with them, and
        with it the exchange's scale and every coordinate's 1-bit step, several times Adam's,
        whose variance follows the gradients. So per tensor ``j`` the ranks track ``G_j``, a
        running mean (a factor ``RESCALE_BETA`` per step, bias-corrected) of the mean square
        of their *local* gradients: each rank sums ``g**2`` per tensor, and every
        ``rescale_interval`` (10) steps, on a step that communicates anyway (``reduce``: every
        step of 1-bit Adam, 0/1 Adam's sync steps), the ranks all-reduce the sums' means, one
        float per tensor. Its first value (``rescale_reference_updates`` = 1 reduce: the first
        10 frozen steps) is the reference ``G_ref_j``, the scale the frozen variance stands for
        (measured on the same local gradients, so the ranks' own noise cancels in the ratio);
        from then on tensor ``j`` is preconditioned by ``v * r_j``, ``r_j = max(1, G_j /
        G_ref_j)``. Only ever larger: a step is never larger than the frozen variance makes it
        (shrinking gradients keep the frozen, larger variance, as Adam's slow ``beta2 = 0.999``
        average nearly would).

        ``g``: this step's local gradient (flat), or ``None`` for a step that has none to
        count (a rank's skipped local step: it counts as zeros, so that every rank counts the
        same steps and reduces on the same one). ``ok``: the step's verdict on the device (see
        :meth:`_compressed_average_`): a dropped step adds zeros, and its count is taken back
        when the host learns of it; the reduce then waits for the next step's start.
        """
        if not self.rescale_variance:
            return
        total = self._scalars["grad_sq_sum"]
        if g is not None:  # per-tensor sums of g**2, one fused kernel over the views
            sq = torch.stack(torch._foreach_norm(self._views["grad"])).square_()
            total.add_(sq if ok is None else torch.where(ok, sq, 0.0))
        self.grad_sq_steps += 1
        due = reduce and self.grad_sq_steps >= self.rescale_interval
        if ok is not None:  # (a dropped step's count is taken back when the host learns it)
            self._rescale_due = due  # the reduce is at the next step's start
        elif due:
            self._rescale_reduce_()

    def _rescale_reduce_if_due(self) -> None:
        """``rescale_variance`` with the verdict on the device: the reduce that
        :meth:`_rescale_variance_` leaves to the start of the next step, when the host knows
        whether the step that made it due counted (the same values, one step later on the
        wire)."""
        if self._rescale_due:
            self._rescale_due = False
            self._rescale_reduce_()

    def _rescale_reduce_(self) -> None:
        """All-reduce the summed mean squares into their running mean (see
        :meth:`_rescale_variance_`)."""
        total = self._scalars["grad_sq_sum"]
        mean = total / (self._layout.sizes.clamp_min(1) * self.grad_sq_steps)
        w = self.world_size
        if w > 1:
            dist.all_reduce(mean, group=self.process_group)
            mean.div_(w)
            sent = fp32_allreduce_bytes(mean.numel(), w)  # (one float per tensor: no ring)
            self.counters.add(sent, sent if self.topology.node_size(w) < w else 0)
        keep = RESCALE_BETA**self.grad_sq_steps  # the old mean's weight after these steps
        total.zero_()
        self.grad_sq_steps = 0
        self.grad_sq_updates += 1
        self.grad_sq_weight = 1.0 - (1.0 - self.grad_sq_weight) * keep
        avg = self._scalars["grad_sq_avg"]
        avg.mul_(keep).add_(mean, alpha=1.0 - keep)
        if self.grad_sq_updates == self.rescale_reference_updates:
            self._scalars["grad_sq_ref"].copy_(avg / self.grad_sq_weight)
        if self.grad_sq_updates >= self.rescale_reference_updates:
            self._denominator = None  # the next step is preconditioned by v * r

    def _decoupled_update_(self, x: torch.Tensor, frozen_denominator: bool = False) -> None:
        """``p -= lr * (x + weight_decay * p)`` for every parameter (``x``: a flat direction), or
        with ``frozen_denominator`` ``p -= lr * (x / (sqrt(v) + eps) + weight_decay * p)`` (the
        variance frozen). The decay is subtracted, ``p += -lr * wd * p``, one rounding of the
        result: the factor ``p * float32(1 - lr * wd)`` would carry the same rounding error
        into every step (it decays 1.5% too much at ``lr * wd = 1e-6``, 17% at ``1e-7``)."""
        views = self._views_of(x)
        denom = self._frozen_denominator()[1] if frozen_denominator else None
        for gi, group, _ in self._segments():
            idx = self._layout.group_params(gi)
            params = [self._layout.params[j] for j in idx]
            lr, wd = group["lr"], decoupled_decay(group)
            if wd > 0:
                torch._foreach_add_(params, params, alpha=-lr * wd)
            xs = [views[j] for j in idx]
            if denom is None:
                torch._foreach_add_(params, xs, alpha=-lr)
            else:
                torch._foreach_addcdiv_(params, xs, [denom[j] for j in idx], value=-lr)

    def _frozen_adam_update_(self, ok: torch.Tensor, x: torch.Tensor) -> None:
        """1-bit Adam's compression-phase update from the exchanged ``x``, only where the
        verdict ``ok`` (on the device) is true: ``m = x * d`` and ``p -= lr * (x + wd * p)``
        with ``preconditioned_exchange``, else ``m = x`` and ``p -= lr * (x / d + wd * p)``
        (``d = sqrt(v) + eps``, frozen); :func:`~lightning_onebit.kernels.frozen_adam_update`."""
        layout, groups = self._layout, self.param_groups
        of = layout.group_of
        frozen_adam_update(
            ok,
            x,
            self._flat["exp_avg"],
            self._frozen_denominator()[0],
            layout.params,
            layout.offsets,
            [groups[of[j]]["lr"] for j in range(len(layout.params))],
            [decoupled_decay(groups[of[j]]) for j in range(len(layout.params))],
            self.preconditioned_exchange,
        )

    def _adam_step_(self, update_variance: bool = True, ok: torch.Tensor | None = None) -> None:
        """Adam's step from the flat gradient buffer, one fused sweep
        (:func:`~lightning_onebit.kernels.adam_update`): ``m = beta1 m + (1 - beta1) g``;
        ``v = beta2 v + (1 - beta2) g**2`` if ``update_variance``;
        ``p -= lr * (m / (sqrt(v) + eps) + weight_decay * p)``. With ``bias_correction``, as
        torch's Adam/AdamW: ``m / (1 - beta1**t)`` over ``sqrt(v / (1 - beta2**k)) + eps``,
        folded into the kernel's per-parameter ``lr``, ``eps`` and ``weight_decay``. ``ok``: the
        step's verdict on the device (nothing is written where it is false)."""
        layout, groups = self._layout, self.param_groups
        if update_variance:
            self.variance_updates += 1

        def hparams(gi: int, j: int | None = None) -> tuple[float, ...]:
            group = groups[gi]
            lr, eps, wd = group["lr"], group["eps"], decoupled_decay(group)
            if self.bias_correction:
                bc1, bc2 = bias_corrections(self, gi, j)
                lr_c = lr * math.sqrt(bc2) / bc1
                lr, eps, wd = lr_c, eps * math.sqrt(bc2), (wd * lr / lr_c if lr_c else wd)
            return (lr, *group["betas"], eps, wd)

        if self.bias_correction and self._any_missed_steps():  # each parameter's own steps
            per_param = [hparams(gi, j) for j, gi in enumerate(layout.group_of)]
        else:
            hp = [hparams(gi) for gi in range(len(groups))]
            per_param = [hp[gi] for gi in layout.group_of]
        adam_update(
            self._grad,
            self._flat["exp_avg"],
            self._flat["exp_avg_sq"],
            layout.params,
            layout.offsets,
            *(list(col) for col in zip(*per_param, strict=True)),
            update_variance=update_variance,
            ok=ok,
        )

    def _any_weight_decay(self) -> bool:
        return any(decoupled_decay(group) > 0 for _, group, _ in self._segments())

    def _add_to_params_(self, flat: torch.Tensor, alpha: float | list[float]) -> None:
        """``p += alpha * flat`` for every parameter; ``alpha`` may be one value per group."""
        views = self._views_of(flat)
        for gi, _, _ in self._segments():
            a = alpha[gi] if isinstance(alpha, list) else alpha
            idx = self._layout.group_params(gi)
            torch._foreach_add_(
                [self._layout.params[j] for j in idx], [views[j] for j in idx], alpha=a
            )

    def _copy_to_params_(self, flat: torch.Tensor) -> None:
        """``p = flat`` (cast to each parameter's dtype) for every parameter."""
        torch._foreach_copy_(self._layout.params, self._views_of(flat))

    def _views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        for name, buf in (*self._flat.items(), *self._work.items()):
            if buf is flat:
                return self._views[name]
        return self._layout.views(flat)

    def _lrs(self) -> list[float]:
        return [group["lr"] for group in self.param_groups]
