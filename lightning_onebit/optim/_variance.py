"""The variance that preconditions the 1-bit steps: Adam's bias corrections, the variance floor,
and what an optimizer says about a variance too young or too small (warnings, the divergence
hint). Functions of a [`OneBitOptimizer`][lightning_onebit.optim.OneBitOptimizer] and its flat
buffers."""

from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_onebit.optim._nograd import any_missed_steps, missed_steps

if TYPE_CHECKING:
    from lightning_onebit.optim._base import OneBitOptimizer
    from lightning_onebit.optim._flat import FlatState

__all__ = [
    "BiasCorrection",
    "bias_correction",
    "divergence_hint",
    "floor_variance_",
    "fold_bias_correction_",
    "variance_sample",
    "warn_if_variance_is_young",
]


#: the optimizers warn_if_variance_is_young has warned (once per run)
_WARNED_YOUNG: weakref.WeakSet[OneBitOptimizer] = weakref.WeakSet()


@dataclass(frozen=True)
class BiasCorrection:
    """Adam's bias corrections ``(1 - beta1**t, 1 - beta2**k)`` at one step: per param group,
    ``t`` steps of momentum and ``k`` variance updates since the group joined (1 for a variance
    that never saw a gradient: nothing to correct); per parameter where some parameter missed
    steps for want of a gradient (torch's Adam counts each parameter's own steps).

    Attributes:
        groups: per param group, ``(1 - beta1**t, 1 - beta2**k)``.
        params: per parameter of the layout, the same less the steps it missed; ``None`` where
            no parameter missed any (every parameter has its group's).
    """

    groups: tuple[tuple[float, float], ...]
    params: tuple[tuple[float, float], ...] | None

    def of(self, gi: int, j: int | None = None) -> tuple[float, float]:
        """Group ``gi``'s corrections, or its parameter ``j``'s (layout index) where they differ."""
        return self.groups[gi] if j is None or self.params is None else self.params[j]

    @property
    def per_param(self) -> bool:
        """Whether some parameter has corrections of its own."""
        return self.params is not None


def bias_correction(opt: OneBitOptimizer) -> BiasCorrection:
    """``opt``'s `BiasCorrection` now, from
    its step and variance-update counts, each group's ``betas`` and ``joined_at``, and each
    parameter's missed steps: the value the algorithm blocks take."""

    def corrections(gi: int, missed: tuple[int, int] = (0, 0)) -> tuple[float, float]:
        group = opt.param_groups[gi]
        beta1, beta2 = group["betas"]
        t0, k0 = group.get("joined_at", (0, 0))
        t, k = opt.step_count - t0 - missed[0], opt.variance_updates - k0 - missed[1]
        return 1.0 - beta1 ** max(t, 1), 1.0 - beta2 ** max(k, 1)

    groups = tuple(corrections(gi) for gi in range(len(opt.param_groups)))
    params = None
    if any_missed_steps(opt):
        of = opt.flat.layout.group_of
        params = tuple(corrections(of[j], missed_steps(opt, j)) for j in range(len(of)))
    return BiasCorrection(groups, params)


def fold_bias_correction_(
    flat: FlatState, groups: list[dict[str, Any]], bias: BiasCorrection
) -> None:
    """At the switch, with ``bias_correction``: ``m /= 1 - beta1**t``, ``v /= 1 - beta2**k``
    (per parameter where some missed steps), so the compression phase runs unchanged."""
    m, v = flat.states["exp_avg"], flat.states["exp_avg_sq"]
    if bias.per_param:
        of = flat.layout.group_of
        for j, (mj, vj) in enumerate(
            zip(flat.views["exp_avg"], flat.views["exp_avg_sq"], strict=True)
        ):
            bc1, bc2 = bias.of(of[j], j)
            mj.div_(bc1)
            vj.div_(bc2)
        return
    for gi, _, s in flat.segments(groups):
        bc1, bc2 = bias.of(gi)
        m[s].div_(bc1)
        v[s].div_(bc2)


def floor_variance_(
    flat: FlatState,
    groups: list[dict[str, Any]],
    f: float,
    *,
    to_mean: bool = False,
    names: dict[Any, str] | None = None,
    ok: torch.Tensor | None = None,
) -> dict[str, int]:
    """Raise each coordinate's variance to at least ``f**2 * max(mean_k, mean_g)``,
    ``f = variance_floor``, ``mean_k`` the mean variance of its tensor, ``mean_g`` that of
    its parameter group: a coordinate counts as degenerate when its gradient RMS is below
    ``f`` times its own tensor's (a dead unit, an unseen embedding row, the key part of an
    attention bias) or its group's (a conv bias in front of BatchNorm, whose gradient is
    rounding noise). Measured at the switch (tensor RMS / group RMS): conv biases before
    BatchNorm 2e-6 and 2e-4, BERT's key biases 3e-8 and 1e-7; the smallest ordinary tensors
    of those models 0.08 and 0.55, so ``f = 0.01`` separates them with room on both sides.

    Why: 1 bit cannot send a zero. Every coordinate of an exchange receives ``+-scale``,
    error feedback keeps its *sum* right, and the update divides by ``sqrt(v) + eps``: with
    ``v ~ 0`` a coordinate moves by ``lr * scale / eps`` per step (DeepSpeed's arithmetic:
    the run explodes one step after the switch), and with ``preconditioned_exchange`` its
    ``m / (sqrt(v) + eps)`` would blow up the exchange's scale for everyone. A floored
    coordinate only ever takes smaller steps than without the floor. ``variance_floor=0``
    is DeepSpeed's arithmetic.

    Args:
        flat: the flat buffers (``exp_avg_sq``; each tensor's floor is kept in its
            ``variance_floor`` view where there is one, 0/1 Adam's).
        groups: the param groups.
        f: ``variance_floor`` (``<= 0``: nothing changes).
        to_mean: raise a caught coordinate to ``max(mean_k, mean_g)`` itself, not to ``f**2`` of
            it (``FLOOR_TO_MEAN``, 1-bit LAMB's; see [`OneBitLamb`][lightning_onebit.optim.OneBitLamb]).
        names: parameter -> name: count the raised coordinates per parameter (a host read).
        ok: the step's verdict on the device; where it is false nothing changes.

    Returns:
        With ``names``, the parameters some of whose coordinates were raised, by name, with
        their counts; else ``{}``.
    """
    f2 = f**2
    if f2 <= 0:
        return {}
    v, views = flat.states["exp_avg_sq"], flat.views["exp_avg_sq"]
    floors = flat.views.get("variance_floor")  # each tensor's floor, if kept (0/1 Adam)
    counts: list[torch.Tensor] = []
    counted: list[int] = []
    for gi, _, s in flat.segments(groups):
        # tensors, not Python floats: no host synchronisation on 0/1 Adam's variance steps
        group_mean = v[s].mean(dtype=torch.float64)
        for j in flat.layout.group_params(gi):
            mean = torch.maximum(views[j].mean(dtype=torch.float64), group_mean)
            floor = (mean * f2).float()
            if floors is not None:
                kept = floor if ok is None else torch.where(ok, floor, floors[j])
                floors[j].copy_(kept.reshape(floors[j].shape))
            if ok is not None:  # a dropped step: v as it was, floor -inf changes nothing
                floor = torch.where(ok, floor, -math.inf).reshape(())
            if names is not None:
                counts.append((views[j] <= floor).sum())
                counted.append(j)
            if to_mean:
                views[j].masked_fill_(views[j] <= floor, mean.float())
            else:
                torch.clamp_min_(views[j], floor)
    if not counts:
        return {}
    n = torch.stack(counts).tolist()
    return {
        flat.layout.name(j, groups, names or {}): k
        for j, k in zip(counted, n, strict=True)
        if k > 0
    }


def warn_if_variance_is_young(opt: OneBitOptimizer, stacklevel: int = 3) -> None:
    """The variance has no bias correction (as in DeepSpeed): after ``k`` variance updates
    it holds ``1 - beta2**k`` of its steady-state value, and preconditioning with that, every
    step is ``1 / sqrt(1 - beta2**k)`` times larger than Adam's. Say so when that is above
    ~1.4x (once per run; ``stacklevel`` as ``warnings.warn``'s, counted from here)."""
    if opt.bias_correction or opt in _WARNED_YOUNG:
        return
    t = opt.variance_updates
    young = [g["betas"][1] for g in opt.param_groups if 1.0 - g["betas"][1] ** max(t, 1) < 0.5]
    if not young or (dist.is_available() and dist.is_initialized() and dist.get_rank() > 0):
        return
    _WARNED_YOUNG.add(opt)
    b2 = max(young)
    held = 1.0 - b2 ** max(t, 1)
    need = math.ceil(math.log(0.5) / math.log(b2))
    warnings.warn(
        f"{type(opt).__name__}: the 1-bit steps are preconditioned by a variance of {t} "
        f"update(s) with beta2={b2}, which holds {held * 100:.2g}% of its steady-state value (no bias "
        f"correction): every such step is about {1 / math.sqrt(held):.1f}x larger than "
        f"Adam's. Pass bias_correction=True (OneBitStrategy does when it converts a torch "
        f"Adam/AdamW), warm up for at least {need} variance updates, or lower beta2 (e.g. "
        "betas=(0.9, 0.95) for short runs)",
        RuntimeWarning,
        stacklevel=stacklevel,
    )


def divergence_hint(opt: OneBitOptimizer) -> str:
    """What to change after a divergence: the causes this optimizer can see in its own
    state (a variance ~0 that 1-bit steps divide by; a young uncorrected variance), else the
    usual ones."""
    hints = []
    v = opt.flat.states.get("exp_avg_sq")
    if v is not None and opt.variance_floor <= 0:
        views = opt.flat.views["exp_avg_sq"]
        tiny = {  # below 1e-4 (in RMS) of the tensor's or the group's: what the floor catches
            opt.flat.layout.name(j, opt.param_groups, opt.param_names): int(n)
            for gi, _, s in opt.flat.segments(opt.param_groups)
            for j in opt.flat.layout.group_params(gi)
            if (n := (views[j] <= 1e-8 * max(float(views[j].mean()), float(v[s].mean()))).sum()) > 0
        }
        if tiny:
            shown = ", ".join(f"{k}: {n}" for k, n in list(tiny.items())[:4])
            hints.append(
                f"{sum(tiny.values())} coordinates have a variance ~0 ({shown}), which 1-bit "
                "steps divide by (lr * scale / eps): pass variance_floor=0.01 (the default)"
            )
    if not opt.bias_correction:
        b2 = max(g["betas"][1] for g in opt.param_groups)
        held = 1.0 - b2 ** max(opt.variance_updates, 1)
        if held < 0.5:
            hints.append(
                f"the variance preconditioning the 1-bit steps holds {held * 100:.2g}% of its steady "
                f"state (no bias correction; {opt.variance_updates} updates, beta2={b2}): "
                "pass bias_correction=True or lower beta2"
            )
    hints.append("lower the learning rate or check the data")
    return "; ".join(hints)


def variance_sample(opt: OneBitOptimizer, stride: int) -> torch.Tensor | None:
    """``OneBitOptimizer.variance_as_frozen``: a copy of every ``stride``-th coordinate of the
    flat second moment as the switch would keep it now: divided by its group's bias correction
    ``1 - beta2**k`` where the optimizer folds that in at the switch (``bias_correction``; a
    parameter that missed steps is corrected by its group's count here), as stored otherwise.

    The adaptive switch compares two of these: in a young run the stored moment keeps growing
    as its average fills in (by more than 5% per 50 updates until about 700 updates at
    ``beta2=0.999``, whatever the gradients do), which says nothing about whether the
    preconditioner the switch would freeze has settled.
    """
    v = opt.variance
    if v is None:
        return None
    if stride < 1:
        raise ValueError(f"stride must be an int >= 1, got {stride!r}")
    out = v[::stride].clone()
    if opt.bias_correction and not opt.phases.switched:
        bias = bias_correction(opt)
        for gi, _, s in opt.flat.segments(opt.param_groups):
            # the sampled coordinates i * stride in [s.start, s.stop)
            lo, hi = -(-s.start // stride), -(-s.stop // stride)
            out[lo:hi].div_(bias.of(gi)[1])
    return out
