"""Parameters without a gradient in a step: kept out of it, as torch's Adam skips them, while
the step itself runs unchanged over the whole flat layout (a missing gradient counts as zeros
there), so every rank runs the same collectives.

A step keeps out the parameters that have no gradient on any rank. A rank knows that of its own
parameters without a gradient in one process, and where DDP produced the gradients
(``opt.caller_averaged``: DDP leaves ``.grad`` ``None`` exactly where no rank used a parameter,
``find_unused_parameters=True``). Elsewhere (plain ``torch.distributed``, ``W > 1``) the ranks
agree on it in the step itself: one ``all_reduce`` (``MAX``) of one byte per parameter (whether
this rank has its gradient), started before the step's own collectives and waited for after
them, so that its latency overlaps theirs; its bytes count in ``comm_stats``. (DDP's
``find_unused_parameters`` all-reduces the same kind of map every step.) Meanwhile each rank
saves what its own parameters without a gradient hold, and puts back those no rank had a
gradient for; a parameter some rank used is averaged with the others' zeros, as DDP averages
it. On 0/1 Adam's sync steps after local steps a parameter also counts as used where some rank
has local steps of it to synchronise (``HeldParams.hold``'s ``unsynced``; then every parameter is agreed on,
DDP's too): its accumulated steps are exchanged, and the ranks end the sync step together.

The steps a kept-out parameter misses are counted (its bias correction counts its own steps, as
torch's Adam's): at once where the step's verdict is known on the host; a step whose verdict
stays on the device (CUDA) is counted when the host learns that it went through, and not at all
if it was dropped (``HeldParams.count_missed``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_onebit.kernels import on_device

if TYPE_CHECKING:
    from lightning_onebit.optim._base import OneBitOptimizer

__all__ = ["HeldParams", "any_missed_steps", "missed_steps", "params_without_grad"]


def params_without_grad(opt: OneBitOptimizer) -> list[int]:
    """The parameters (layout indices) that have no gradient on this rank this step (``.grad``
    is ``None``): those the step may keep out (``HeldParams.hold`` decides which, asking the
    other ranks where this rank cannot know)."""
    return [j for j, p in enumerate(opt.flat.layout.params) if p.grad is None]


def _asked_params(opt: OneBitOptimizer, syncs_local_steps: bool) -> list[int]:
    """The parameters (layout indices) whose use on the other ranks this step must know: all
    of them where the step synchronises local steps (0/1 Adam's, which may have moved a
    parameter without a gradient now); else, where ``W > 1``, those whose gradients DDP did
    not produce (all of them under plain ``torch.distributed``)."""
    params = opt.flat.layout.params
    if syncs_local_steps:
        return list(range(len(params)))
    if opt.world_size == 1:
        return []
    covered = opt.caller_averaged or frozenset()
    return [j for j, p in enumerate(params) if id(p) not in covered]


def missed_steps(opt: OneBitOptimizer, j: int) -> tuple[int, int]:
    """``(steps, variance updates)`` that parameter ``j`` (layout index) missed for want of a
    gradient (see ``HeldParams``)."""
    return opt.state[opt.flat.layout.params[j]].get("steps_without_grad", (0, 0))


def any_missed_steps(opt: OneBitOptimizer) -> bool:
    """Whether some parameter missed steps (its bias correction then counts its own)."""
    return any("steps_without_grad" in opt.state[p] for p in opt.flat.layout.params)


def _count(opt: OneBitOptimizer, missed: list[tuple[torch.Tensor, int]]) -> None:
    """One more step missed by each parameter of ``missed``, with its variance updates."""
    for p, k in missed:
        state = opt.state[p]
        t0, k0 = state.get("steps_without_grad", (0, 0))
        state["steps_without_grad"] = (t0 + 1, k0 + k)


class _Agreement:
    """Which parameters some rank has a gradient (or earlier local steps) for: this rank's
    flags, all-reduced (``MAX``) over the ranks where ``W > 1``, in flight (``unsynced``: see
    ``HeldParams.hold``)."""

    def __init__(
        self,
        opt: OneBitOptimizer,
        ask: list[int],
        unsynced: Callable[[list[int]], torch.Tensor] | None,
    ) -> None:
        params, device = opt.flat.layout.params, opt.flat.layout.device
        used = [int(params[j].grad is not None) for j in ask]
        if device.type == "cuda":  # from pinned memory: no host synchronisation
            self.flags = on_device(used, torch.uint8, device)
        else:
            self.flags = torch.tensor(used, dtype=torch.uint8)
        if unsynced is not None:
            # without a gradient here, a parameter with local steps to synchronise counts as
            # used (read from the accumulator only where it decides: on the device)
            missing = [i for i, u in enumerate(used) if not u]
            if missing:
                moved = unsynced([ask[i] for i in missing]).to(torch.uint8)
                self.flags[torch.tensor(missing, device=self.flags.device)] = moved
        self.wait: Callable[[], Any] = lambda: None
        w = opt.world_size
        if w > 1:
            work = dist.all_reduce(
                self.flags, op=dist.ReduceOp.MAX, group=opt.process_group, async_op=True
            )
            self.wait = work.wait
            opt.counters.add_ring(2 * (w - 1) * len(ask) // w, w, opt.topology.node_size(w))
        self.position = {j: i for i, j in enumerate(ask)}

    def unused(self, idx: list[int]) -> list[bool]:
        """Whether no rank had anything of each of the parameters ``idx`` (this rank has no
        gradient for them); read on the host only where one of them was asked about."""
        self.wait()
        if not any(j in self.position for j in idx):
            return [True] * len(idx)
        used = self.flags.tolist()
        return [j not in self.position or not used[self.position[j]] for j in idx]


class HeldParams:
    """The parameters a step keeps out of it and what they held before it.

    Interface: ``hold`` (before the step), ``release`` (after it, or at the phase
    switch, before the state changes meaning), ``count_missed`` (when the host learns the verdict
    of a step whose verdict stayed on the device).
    """

    def __init__(self) -> None:
        #: ``(indices, states, values, error buffers, variance updates)`` while held
        self.saved: tuple[Any, ...] | None = None
        #: the ranks' agreement on which parameters no rank used, while in flight
        self.agreement: _Agreement | None = None
        #: the missed steps of a step whose verdict is still on the device, to count when it
        #: turns out to have gone through: ``(parameter, variance updates)`` each
        self.uncounted: list[tuple[torch.Tensor, int]] | None = None

    def hold(
        self,
        opt: OneBitOptimizer,
        idx: list[int],
        unsynced: Callable[[list[int]], torch.Tensor] | None = None,
    ) -> None:
        """Keep out of this step those of the parameters ``idx`` (without a gradient on this
        rank) that no rank has a gradient for: where this rank cannot know which, the ranks'
        agreement starts here (see the module docstring) and ``release`` takes it. Their
        values, their state and their part of the exchange's error buffers are saved now and
        put back by ``release``. Their exchanged values are sent (1 bit cannot send a zero)
        and dropped; their error buffers then do not remember them.

        ``unsynced``: on a step that synchronises local steps (0/1 Adam's), per parameter of
        a list of layout indices, whether this rank has local steps of it to synchronise (a
        bool tensor on its device); ``None`` on other steps."""
        ask = _asked_params(opt, unsynced is not None)
        if ask:
            self.agreement = _Agreement(opt, ask, unsynced)
        if not idx:
            return
        flat = opt.flat
        views, layout, ex = flat.views, flat.layout, flat.exchange
        saved = {
            name: [views[name][j].clone() for j in idx] for name in (*flat.states, *flat.scalars)
        }
        values = [layout.params[j].detach().clone() for j in idx]
        errors = [
            [e.clone() for e in ex.error_views(lo, lo + layout.params[j].numel())]
            for j, lo in ((j, layout.offsets[j]) for j in idx)
        ]
        self.saved = (idx, saved, values, errors, opt.variance_updates)

    def release(self, opt: OneBitOptimizer, count: bool = True) -> None:
        """Put back what ``hold`` saved of the parameters no rank had a gradient for (the
        others took part in the step with zeros); with ``count``, the step counts as one they
        missed (their bias correction counts their own steps, as torch's Adam's), once its
        verdict is known on the host (``count_missed``)."""
        agreement, self.agreement = self.agreement, None
        held, self.saved = self.saved, None
        if held is None:
            if agreement is not None:
                agreement.wait()
            return
        idx, saved, values, errors, variance_updates = held
        kept = [True] * len(idx) if agreement is None else agreement.unused(idx)
        views, layout, ex = opt.flat.views, opt.flat.layout, opt.flat.exchange
        for name, before in saved.items():
            for j, v, k in zip(idx, before, kept, strict=True):
                if k:
                    views[name][j].copy_(v)
        for j, v, errs, k in zip(idx, values, errors, kept, strict=True):
            if not k:
                continue
            layout.params[j].copy_(v)
            lo = layout.offsets[j]
            for e, before in zip(ex.error_views(lo, lo + v.numel()), errs, strict=True):
                e.copy_(before)
        if not count:
            return
        k = opt.variance_updates - variance_updates
        missed = [(layout.params[j], k) for j, keep in zip(idx, kept, strict=True) if keep]
        if opt.verdict.on_device:  # counted when the host learns the step went through
            self.uncounted = missed
        else:
            _count(opt, missed)

    def count_missed(self, opt: OneBitOptimizer, kept: bool | None) -> None:
        """The host learnt the verdict of the last step (see
        ``apply_last_step``): ``kept`` (it went
        through) counts the steps its held parameters missed; ``False`` (dropped) or ``None``
        (no verdict was waiting: a loaded state replaced that step's) forgets them."""
        missed, self.uncounted = self.uncounted, None
        if missed and kept:
            _count(opt, missed)
