"""A compression phase that diverges, named while it happens.

Every ``DivergenceWatch.every`` steps of the compression phase, and once more at the end of a
fit (a blow-up within the last ``every`` steps is named too), one fused norm of every trainable
tensor (a read of the parameters, ``1/every`` of a step's sweeps) gives each tensor's RMS against
its RMS at the first step the watch saw; a tensor whose RMS grew more than ``growth`` times (or is
no longer finite) names the run as diverging. Healthy runs stay within a few times (a freshly
initialised bias grows most); a diverging 1-bit step, which the frozen variance no longer holds
back, multiplies some tensors' norms by orders of magnitude within tens of steps.

On CUDA the verdict stays on the device: its host copy is read at the next check, as the step's
NaN/Inf verdict is read one step later (no step waits for the GPU). The decision is taken from
parameters that are bitwise equal on every rank (the watch skips 0/1 Adam's local steps), so
every rank takes the same one.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from math import inf
from typing import Any

import torch

__all__ = ["DIVERGENCE_ACTIONS", "DivergenceError", "DivergenceWatch", "Growth"]

#: what a diverging run does: warn once, or stop with ``DivergenceError``
DIVERGENCE_ACTIONS = ("warn", "raise")


class DivergenceError(RuntimeError):
    """The compression phase diverged (``on_divergence="raise"``): raised on every rank, in the
    same step, naming the parameter that grew most and what to try."""


@dataclass(frozen=True)
class Growth:
    """What a check found: the tensor that grew most against its RMS when the watch began."""

    #: the tensor's index in the layout
    index: int
    #: its RMS now over its RMS then (``inf`` once not finite)
    ratio: float
    #: the optimizer step of the check, and of the reference
    step: int
    since: int


class DivergenceWatch:
    """Each tensor's RMS against its RMS at the start of the compression phase, every ``every``
    steps.

    Interface: ``check`` (after a compression step whose parameters are equal on every
    rank), ``respond`` (what a finding does), ``reset`` (a new layout or phase); the
    host reads each check's verdict at the next one (on the CPU at once).

    Args:
        growth: a tensor whose RMS grows beyond ``growth`` times its RMS at the reference step
            (or beyond ``growth`` times 1% of the largest tensor RMS then, for tensors that were
            ~0) counts as diverging.
        every: compression steps between checks.
    """

    def __init__(self, growth: float = 10.0, every: int = 16) -> None:
        self.growth = growth
        self.every = every
        self.named = False  # a warning was given (once per run)
        self.reset()

    def reset(self) -> None:
        """Forget the reference (a new layout, a new compression phase, a loaded checkpoint)."""
        self.reference: torch.Tensor | None = (
            None  # per tensor: its RMS, at least 1% of the largest
        )
        self._sqrt_numel: torch.Tensor | None = None
        self._host: torch.Tensor | None = None  # CUDA: the pinned copy of a check's result
        self.since = 0
        #: the last check's ``(step, device result, CUDA event or None)``, not read yet
        self.pending: tuple[int, torch.Tensor, Any] | None = None

    def check(self, params: list[torch.Tensor], step: int, now: bool = False) -> Growth | None:
        """After compression step ``step``: the last check's finding if it counts as diverging
        (``None`` otherwise, or when no check is due). ``now``: check whether due or not, and
        read the result at once (the end of a run, which a blow-up of the last ``every`` steps
        would otherwise leave unnamed)."""
        found = self._read_pending()
        if self.reference is not None and (step - self.since) % self.every and not now:
            return found
        norms = _norms(params)  # (T,) on the parameters' device
        if self.reference is None:
            numel = [max(p.numel(), 1) for p in params]
            self._sqrt_numel = torch.tensor(numel, dtype=torch.float32, device=norms.device).sqrt()
            rms = norms / self._sqrt_numel
            self.reference, self.since = torch.maximum(rms, 0.01 * rms.max()), step
            return found
        ratio = norms / self._sqrt_numel / self.reference
        # a NaN anywhere makes the max NaN: it counts as an infinite growth
        worst = torch.stack([ratio.max(), ratio.argmax().to(ratio.dtype)]).nan_to_num_(
            nan=inf, posinf=inf
        )
        if worst.is_cuda:  # read at the next check, without waiting
            if self._host is None:  # pinned once: allocating it could wait for the GPU
                self._host = torch.empty(2, dtype=worst.dtype, pin_memory=True)
            host = self._host
            host.copy_(worst, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(worst.device))
            self.pending = (step, host, event)
            return found or (self._read_pending() if now else None)
        self.pending = (step, worst, None)
        return found or self._read_pending()

    def respond(
        self, found: Growth, name: str, who: str, action: str, rank: int, hint: str
    ) -> None:
        """What ``on_divergence`` (``action``) does with a finding: ``"raise"``
        ``DivergenceError`` on every rank; ``"warn"`` once, on
        rank 0.

        Args:
            found: what ``check`` found.
            name: the name of the parameter that grew most.
            who: the optimizer and its phase, as the message begins (``"OneBitAdam: the
                compression phase"``).
            action: one of ``DIVERGENCE_ACTIONS``.
            rank: this rank (only rank 0 warns).
            hint: the switch's option, for the advice (``freeze_step``).
        """
        if self.named and action == "warn":
            return
        message = (
            f"{who} is diverging: {name} has {found.ratio:.3g}x its RMS of step {found.since} "
            f"at step {found.step} (more than divergence.growth={self.growth:g}x). Try a smaller "
            "learning rate (for a converted 1-bit LAMB, the strategy's lamb_lr) or a later "
            f"switch (a larger {hint}); resume from a checkpoint from before step "
            f"{found.since} to keep the run"
        )
        if action == "raise":
            raise DivergenceError(message + " (on_divergence='raise')")
        self.named = True
        if rank == 0:
            warnings.warn(
                message + " (on_divergence='raise' stops the run)", RuntimeWarning, stacklevel=5
            )

    def _read_pending(self) -> Growth | None:
        if self.pending is None:
            return None
        step, host, event = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()
        ratio, index = host.tolist()
        if not ratio > self.growth:  # a NaN ratio was made inf: it counts
            return None
        return Growth(int(index), ratio, step, self.since)


def _norms(params: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's 2-norm, in fp32, in one fused op."""
    fp32 = [p.detach() if p.dtype == torch.float32 else p.detach().float() for p in params]
    return torch.stack(torch._foreach_norm(fp32))
