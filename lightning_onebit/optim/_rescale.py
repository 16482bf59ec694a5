"""``rescale_variance``: the frozen variance follows, per tensor, what Adam's variance would do
with the compression phase's gradients. ``VarianceRescale`` holds its counters and
declares its per-tensor states (which live in the flat buffers' scalars); its blocks take the
flat state and the param groups."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from lightning_onebit.comm import fp32_allreduce_bytes
from lightning_onebit.optim._counters import CommCounters
from lightning_onebit.optim._flat import FlatState
from lightning_onebit.optim._topology import Topology

__all__ = [
    "RESCALE_BETA",
    "RESCALE_INTERVAL",
    "RESCALE_MIN_BETA2",
    "RESCALE_STATES",
    "VarianceRescale",
]

#: The warmup's running mean square of the averaged gradients keeps this much of its last value
#: per update (a horizon of about 10 steps, that of the first all-reduce after the switch); the
#: ranks all-reduce their local mean squares every ``RESCALE_INTERVAL`` steps.
RESCALE_BETA = 0.9
RESCALE_INTERVAL = 10
#: The slowest ``beta2`` its average of each tensor's mean square takes: a horizon of at least
#: 100 steps (see ``VarianceRescale``).
RESCALE_MIN_BETA2 = 0.99

#: The per-tensor states and their values before anything is measured: this rank's sum of
#: ``g**2`` since the last all-reduce, the warmup's running mean square of the averaged
#: gradients, the factor that turns the local gradients' mean square into the variance's units,
#: and the ratio ``r`` of Adam's variance now to the frozen one.
RESCALE_STATES = {
    "grad_sq_sum": 0.0,
    "grad_sq_recent": 0.0,
    "grad_sq_scale": 0.0,
    "grad_sq_ratio": 1.0,
}

#: The checkpoint's keys for the counters (the ``"onebit"`` entry of the state dict).
_KEYS = {
    "weight": "grad_sq_weight",
    "count": "grad_sq_count",
    "updates": "grad_sq_updates",
    "steps": "grad_sq_steps",
    "due": "_rescale_due",
}


def _sums_of_squares(flat: FlatState, xs: list[torch.Tensor | None]) -> torch.Tensor:
    """Per tensor of the layout, the sum of its values squared (one fused kernel over the
    tensors; ``None``: a missing gradient, zeros)."""
    none = flat.states["exp_avg"][:0]  # the norm of no values: +0.0, as of zeros
    sq = torch.stack(torch._foreach_norm([none if x is None else x for x in xs]))
    return sq.square_()


class VarianceRescale:
    """``rescale_variance``'s state: let the frozen variance follow, per tensor, what Adam's
    variance would do with the gradients of the frozen phase.

    The variance froze at the switch, but the gradients go on changing: where a tensor's
    gradients grow (attention and feed-forward layers of transformers, whose gradient RMS
    can double in the steps after the warmup) ``m / sqrt(v)`` grows with them, and with it
    every coordinate's 1-bit step; where they shrink, Adam's variance would shrink and its
    steps stay the same size, while the frozen one's shrink. Adam's variance of tensor ``j``,
    averaged over the tensor, is ``A_j``: a ``beta2`` average of the averaged gradients' mean
    square. After the switch only local gradients are seen, whose mean square is larger by
    their noise; so each rank sums its local ``g**2`` per tensor, and every ``interval`` (10)
    steps, on a step that communicates anyway (every step of 1-bit Adam, 0/1 Adam's sync
    steps), the ranks all-reduce the sums' means, one float per tensor. The first of these (the
    first 10 frozen steps) sets the local to averaged ratio ``c_j`` (that mean over the
    warmup's recent averaged mean square, see ``warmup_``);
    each one feeds ``A_j`` the mean divided by ``c_j``, weighted as that many of Adam's
    ``beta2`` steps, and tensor ``j`` is preconditioned by ``v * r_j``,
    ``r_j = A_j(now) / A_j(switch)`` (both bias-corrected).

    ``A_j`` averages over ``1 / (1 - beta2)`` steps, but never fewer than
    ``1 / (1 - RESCALE_MIN_BETA2)`` = 100: one factor scales every coordinate of the tensor,
    and its mean square is carried by its largest coordinates, which spike. Over a short
    ``beta2`` such as 0.95 the factor would follow a spike up and back down within tens of
    steps, and as it fades enlarge the steps of every coordinate whose own variance did not
    move.

    Interface: ``warmup_`` (every
    warmup step that updates the variance), ``at_switch_``,
    ``accumulate_`` (every frozen
    step), ``reduce_`` (where ``due``
    at the next step's start), ``scales``,
    and the checkpoint's ``state_dict`` /
    ``load_state_dict``. A dropped
    step puts its copy back (``copy.copy``: the counters are host numbers).

    Args:
        enabled: whether ``rescale_variance`` is on (off: every block is a no-op and
            ``states`` is empty).
        topology: the optimizer's process group (the all-reduce's).
        counters: the optimizer's byte counters (the all-reduce's bytes count there).
    """

    def __init__(self, enabled: bool, topology: Topology, counters: CommCounters) -> None:
        self.enabled = bool(enabled)
        self.topology, self.counters = topology, counters
        #: steps between all-reduces (tunable)
        self.interval = RESCALE_INTERVAL
        #: the warmup's running mean square less its initial zeros' weight (its bias correction)
        self.weight = 0.0
        #: the gradients Adam's variance would have averaged by now
        self.count = 0
        #: all-reduces since the switch
        self.updates = 0
        #: steps summed into ``grad_sq_sum`` since the last all-reduce
        self.steps = 0
        #: with a verdict on the device: an all-reduce waiting for the next step's start
        self.due = False

    @property
    def states(self) -> dict[str, float]:
        """The per-tensor states (name: initial value) the flat buffers hold for it."""
        return RESCALE_STATES if self.enabled else {}

    def state_dict(self) -> dict[str, Any]:
        """The counters, under the checkpoint's keys (empty where off)."""
        if not self.enabled:
            return {}
        return {key: copy.deepcopy(getattr(self, name)) for name, key in _KEYS.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters of a ``state_dict``
        (keys missing from ``state`` keep their values)."""
        if not self.enabled:
            return
        for name, key in _KEYS.items():
            if key in state:
                setattr(self, name, copy.deepcopy(state[key]))

    def scales(self, flat: FlatState) -> torch.Tensor | None:
        """``r_j`` per tensor, the factor on its frozen variance, or ``None`` while nothing
        rescales (off, or no all-reduce since the switch)."""
        if not self.enabled or self.updates == 0:
            return None
        return flat.scalars["grad_sq_ratio"]

    def warmup_(
        self,
        flat: FlatState,
        grads: list[torch.Tensor | None],
        ok: torch.Tensor | None = None,
    ) -> None:
        """Before the switch: the running mean square (a factor ``RESCALE_BETA`` per update, the
        horizon of the reference that follows the switch) of the averaged gradients the
        variance was just updated with, ``grads`` (one per parameter of the layout, ``None``:
        zeros). Call on every step that updates the variance; ``ok``: the step's verdict on
        the device (nothing changes where it is false; the host takes its weight back when it
        learns of it)."""
        if not self.enabled:
            return
        ms = _sums_of_squares(flat, grads) / flat.layout.sizes.clamp_min(1)
        recent = flat.scalars["grad_sq_recent"]
        new = torch.lerp(recent, ms, 1.0 - RESCALE_BETA)
        recent.copy_(new if ok is None else torch.where(ok, new, recent))
        self.weight = 1.0 - (1.0 - self.weight) * RESCALE_BETA

    def at_switch_(self, flat: FlatState, bias_corrections: list[float], updates: int) -> None:
        """At the switch, before the variance is folded and floored: per tensor, the mean
        ``A_j`` of Adam's bias-corrected variance, and ``grad_sq_scale`` = the averaged
        gradients' recent mean square (the warmup's, else ``A_j``) over ``A_j`` (0 where
        ``A_j`` is 0: that tensor is not rescaled).

        Args:
            flat: the flat state (its ``exp_avg_sq`` as the warmup left it).
            bias_corrections: per tensor of the layout, its variance's ``1 - beta2**k``.
            updates: the variance updates so far (where Adam's count starts).
        """
        if not self.enabled:
            return
        v = flat.views["exp_avg_sq"]
        sizes = flat.layout.sizes.clamp_min(1)
        mean_v = torch.stack(torch._foreach_norm(v, 1)) / sizes
        a = mean_v / torch.tensor(bias_corrections, dtype=torch.float64).to(mean_v)
        recent = flat.scalars["grad_sq_recent"]
        glob = recent / self.weight if self.weight > 0 else a
        flat.scalars["grad_sq_scale"].copy_(torch.where(a > 0, glob / a, 0.0))
        flat.scalars["grad_sq_ratio"].fill_(1.0)
        self.count = updates
        self.updates = self.steps = 0
        flat.scalars["grad_sq_sum"].zero_()

    def accumulate_(
        self,
        flat: FlatState,
        groups: list[dict[str, Any]],
        grads: list[torch.Tensor | None] | None,
        reduce: bool,
        ok: torch.Tensor | None = None,
    ) -> None:
        """A frozen step's gradients (call at the end of every step of the compression phase).

        Args:
            flat: the flat state.
            groups: the optimizer's param groups (their ``betas``).
            grads: this step's local gradients, one per parameter of the layout (the views of
                the flat gradient buffer, or the parameters' own, ``None`` for zeros), or
                ``None`` for a step that has none to count (a rank's skipped local step: it
                counts as zeros, so that every rank counts the same steps and reduces on the
                same one).
            reduce: whether this step communicates anyway (the all-reduce may happen on it).
            ok: the step's verdict on the device: a dropped step adds zeros, and its count is
                taken back when the host learns of it; the all-reduce then waits for the next
                step's start (``due``).
        """
        if not self.enabled:
            return
        total = flat.scalars["grad_sq_sum"]
        if grads is not None:
            sq = _sums_of_squares(flat, grads)
            total.add_(sq if ok is None else torch.where(ok, sq, 0.0))
        self.steps += 1
        due = reduce and self.steps >= self.interval
        if ok is not None:  # a dropped step's count is taken back when the host learns it
            self.due = due
        elif due:
            self.reduce_(flat, groups)

    def reduce_(self, flat: FlatState, groups: list[dict[str, Any]]) -> None:
        """All-reduce the summed mean squares and feed them to Adam's variance's mean (with a
        verdict on the device: at the start of the step after the one that made it ``due``,
        when the host knows whether that step counted; the same values, one step later)."""
        self.due = False
        total, n = flat.scalars["grad_sq_sum"], self.steps
        layout = flat.layout
        mean = total / (layout.sizes.clamp_min(1) * n)
        w = self.topology.world_size()
        if w > 1:
            dist.all_reduce(mean, group=self.topology.process_group)
            mean.div_(w)
            sent = fp32_allreduce_bytes(mean.numel(), w)  # one float per tensor: no ring
            self.counters.add(sent, sent if self.topology.node_size(w) < w else 0)
        total.zero_()
        self.steps = 0
        scale, ratio = flat.scalars["grad_sq_scale"], flat.scalars["grad_sq_ratio"]
        if self.updates == 0:  # the first frozen steps: c_j, local over averaged
            scale.copy_(torch.where(mean > 0, scale / mean, 0.0))
        fed = torch.where(scale > 0, mean * scale, 1.0)  # A_j's new mean square over A_j(switch)
        # r = A(now) / A(switch), A bias-corrected: the weights of a beta2 average (at least
        # RESCALE_MIN_BETA2) after k and k + n updates, per group. A group's tensors are
        # consecutive in the layout (it is built group by group): a slice, and the weights reach
        # the device as kernel arguments, with no host-to-device copy.
        k = self.count
        for gi, group in enumerate(groups):
            idx = layout.group_params(gi)
            if not idx:
                continue
            beta2 = max(group["betas"][1], RESCALE_MIN_BETA2)
            keep, before, after = beta2**n, 1.0 - beta2**k, 1.0 - beta2 ** (k + n)
            s = slice(idx[0], idx[-1] + 1)
            ratio[s].mul_(keep * before / after).add_(fed[s], alpha=(1.0 - keep) / after)
        self.count = k + n
        self.updates += 1  # the next steps are preconditioned by v * r
