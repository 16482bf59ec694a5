"""Parameters without a gradient in a step: kept out of it, as torch's Adam skips them, while
the step itself runs unchanged over the whole flat layout (a missing gradient counts as zeros
there), so every rank runs the same collectives."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_onebit.optim._base import OneBitOptimizer

__all__ = ["HeldParams", "any_missed_steps", "missed_steps", "params_without_grad"]


def params_without_grad(opt: OneBitOptimizer) -> list[int]:
    """The parameters (layout indices) that have no gradient this step (``.grad`` is ``None``)
    on every rank, known without asking the other ranks: in one process, and where DDP produced
    the gradients (``opt.caller_averaged``), which leaves ``.grad`` ``None`` exactly where no
    rank used a parameter (``find_unused_parameters=True``; DDP refuses unused parameters
    otherwise). Elsewhere (plain ``torch.distributed``, a parameter DDP does not know) a missing
    gradient counts as zeros: a parameter that other ranks use is averaged with them, as DDP
    averages it."""
    params = opt.flat.layout.params
    idx = [j for j, p in enumerate(params) if p.grad is None]
    if not idx or opt.world_size == 1:
        return idx
    covered = opt.caller_averaged
    return [] if covered is None else [j for j in idx if id(params[j]) in covered]


def missed_steps(opt: OneBitOptimizer, j: int) -> tuple[int, int]:
    """``(steps, variance updates)`` that parameter ``j`` (layout index) missed for want of a
    gradient (see :class:`HeldParams`)."""
    return opt.state[opt.flat.layout.params[j]].get("steps_without_grad", (0, 0))


def any_missed_steps(opt: OneBitOptimizer) -> bool:
    """Whether some parameter missed steps (its bias correction then counts its own)."""
    return any("steps_without_grad" in opt.state[p] for p in opt.flat.layout.params)


class HeldParams:
    """The parameters a step keeps out of it and what they held before it.

    Interface: :meth:`hold` (before the step), :meth:`release` (after it, or at the phase
    switch, before the state changes meaning).
    """

    def __init__(self) -> None:
        #: ``(indices, states, values, error buffers, variance updates)`` while held
        self.saved: tuple[Any, ...] | None = None

    def hold(self, opt: OneBitOptimizer, idx: list[int]) -> None:
        """Keep the parameters ``idx`` (without a gradient on every rank) out of this step:
        their values, their state and their part of the exchange's error buffers are saved now
        and put back by :meth:`release`. Their exchanged values are sent (1 bit cannot send a
        zero) and dropped; their error buffers then do not remember them."""
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
        """Put back what :meth:`hold` saved; with ``count``, the step counts as one the held
        parameters missed (their bias correction counts their own steps, as torch's Adam's)."""
        held, self.saved = self.saved, None
        if held is None:
            return
        idx, saved, values, errors, variance_updates = held
        views, layout, ex = opt.flat.views, opt.flat.layout, opt.flat.exchange
        for name, kept in saved.items():
            for j, v in zip(idx, kept, strict=True):
                views[name][j].copy_(v)
        for j, v, errs in zip(idx, values, errors, strict=True):
            layout.params[j].copy_(v)
            lo = layout.offsets[j]
            for e, kept in zip(ex.error_views(lo, lo + v.numel()), errs, strict=True):
                e.copy_(kept)
            if count:
                state = opt.state[layout.params[j]]
                t, k = state.get("steps_without_grad", (0, 0))
                k += opt.variance_updates - variance_updates
                state["steps_without_grad"] = (t + 1, k)
