"""The NaN/Inf verdict of each step, and the skip policy.

A NaN/Inf in what a step communicates is known to every rank in the same call, before any state
was written, so the step is dropped on every rank as if its batch had not been there;
``max_consecutive_skips`` dropped steps in a row mean the run diverged and raise
[`NonFiniteError`][lightning_onebit.comm.base.NonFiniteError]. On CUDA the verdict stays on the
device (a host read would wait for the GPU and the exchange's ``all_to_all``): the step's writes
take it, and the host reads a copy of it at the start of the next step
(``StepVerdict.read_last_step``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_onebit import kernels
from lightning_onebit.comm import NonFiniteError

__all__ = ["Dropped", "StepVerdict", "verdict_message"]


@dataclass(frozen=True)
class Dropped:
    """A step whose device verdict, read on the host one step later, was non-finite."""

    #: what was judged: ``"average"``, ``"exchange"`` or ``"local"`` (one rank's local step)
    kind: str
    #: why, for the warning or the error
    message: str
    #: the host-side counters from before the step, to put back
    counters: dict[str, Any]


def verdict_message(finite: list[bool], kind: str, step: int) -> str:
    """What a non-finite verdict says: ``finite`` per rank, ``kind`` as in ``Dropped``."""
    if kind == "average":
        return f"the averaged gradient has non-finite values (NaN/Inf) at step {step}"
    bad = [i for i, f in enumerate(finite) if not f]
    # the hierarchical exchange's non-finite shard reaches every node: it names none
    where = f"rank(s) {bad} of {len(finite)}" if len(bad) < len(finite) else "a rank"
    return (
        f"non-finite values (NaN/Inf) entered the 1-bit exchange on {where} at step {step}; "
        "every rank dropped the step (nothing was written: the verdict was taken on the device)"
    )


class StepVerdict:
    """The verdict of the step in flight and the count of dropped steps of one optimizer.

    Interface: ``uses_device`` (where verdicts stay on the device); in a step,
    ``start_step``, ``hold_on_device`` / ``from_exchange`` (a verdict on the device),
    ``read_on_host`` (read it at once), ``on_device`` (not read yet), ``end_step``; between steps
    ``read_last_step`` / ``apply_last_step`` (the last step's, on the host); ``drop_step`` and
    ``count_drop`` (the skip policy); ``skipped_steps`` (checkpointed).

    Args:
        name: the optimizer's class name, for messages.
        device_capable: whether the optimizer's steps can keep their verdict on the device
            (their writes take it), which they do on CUDA with the CUDA kernels built.
    """

    def __init__(self, name: str, device_capable: bool) -> None:
        self.name = name
        self.device_capable = device_capable
        #: keep verdicts on the device on the CPU too (tests: the CUDA path, read on the host)
        self.on_cpu = False
        self.skipped_steps = 0  # steps dropped for non-finite values
        self.consecutive = 0  # ... in a row
        #: this step's ``(ok, finite per rank, what it judged)`` on the device
        self.current: tuple[torch.Tensor, torch.Tensor, str] | None = None
        self.read = False  # ... read on the host already (``read_on_host``)
        #: the last step's: ``(step, host copy, CUDA event, kind, counters)`` (see ``end_step``)
        self.pending: tuple[Any, ...] | None = None
        self._skipped_before = 0  # skipped_steps when the step began

    def uses_device(self, device: torch.device) -> bool:
        """Whether steps on ``device`` keep their verdicts there."""
        on_gpu = device.type == "cuda" and kernels.HAS_CUDA
        return self.device_capable and (on_gpu or self.on_cpu)

    # ------------------------------------------------------------------ in a step

    def start_step(self) -> None:
        """A step starts: no verdict yet."""
        self.current = None
        self._skipped_before = self.skipped_steps
        self.read = False

    def hold_on_device(self, ok: torch.Tensor, finite: torch.Tensor, kind: str) -> torch.Tensor:
        """Keep this step's verdict ``ok`` (and ``finite`` per rank) on the device; return
        ``ok``."""
        self.current = (ok, finite, kind)
        return ok

    def from_exchange(self, exchange: Any) -> torch.Tensor | None:
        """After a compressed exchange: its verdict on the device (the step's update kernels
        take it), or ``None`` when the exchange read it on the host (and raised)."""
        if not exchange.device_verdict:
            return None
        ok, finite = exchange.verdict
        return self.hold_on_device(ok, finite, "exchange")

    @property
    def ok(self) -> torch.Tensor | None:
        """This step's verdict on the device, if any."""
        return None if self.current is None else self.current[0]

    @property
    def on_device(self) -> bool:
        """Whether this step's verdict is on the device only: the host learns it at the next
        ``apply_last_step``."""
        return self.current is not None and not self.read

    def read_on_host(self, step: int) -> None:
        """Read this step's device verdict on the host now (a host synchronisation, for the
        steps that change the phase: once per run) and raise
        [`NonFiniteError`][lightning_onebit.comm.base.NonFiniteError] if it was false, as the host's
        own verdict does; the step wrote nothing."""
        if self.current is None:
            return
        ok, finite, kind = self.current
        if not bool(ok):
            self.current = None
            raise NonFiniteError(verdict_message(finite.tolist(), kind, step))
        self.read = True

    def end_step(self, step: int, counters: dict[str, Any]) -> None:
        """End of step ``step``: a verdict still on the device is copied to the host without
        waiting (pinned memory, an event after the copy) for ``read_last_step``; a step that
        counted ends the run of dropped steps."""
        if self.current is None:
            if self.skipped_steps == self._skipped_before:
                self.consecutive = 0
            return
        _, finite, kind = self.current
        event = None
        if finite.is_cuda:
            host = torch.empty(finite.shape, dtype=torch.bool, pin_memory=True)
            host.copy_(finite, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(finite.device))
        else:
            host = finite.clone()
        self.pending = (step, host, event, kind, counters)

    # ------------------------------------------------------------------ between steps

    def read_last_step(self) -> Dropped | None:
        """The host's half of the last step, if its verdict stayed on the device: ``None`` if it
        was finite (or there was none), else what to drop. The copy has arrived by the next
        step (the event waits only if the GPU is still on that step's exchange)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        step, host, event, kind, counters = pending
        if event is not None:
            event.synchronize()
        finite = host.tolist()
        if all(finite):
            self.consecutive = 0
            return None
        return Dropped(kind, verdict_message(finite, kind, step), counters)

    def apply_last_step(
        self,
        restore: Callable[[dict[str, Any]], None],
        drop: Callable[[NonFiniteError], None],
        drop_local: Callable[[], None],
    ) -> bool | None:
        """The host's half of a step whose verdict stayed on the device (``read_last_step``), at
        the start of the next step and before a checkpoint: if it was non-finite, the step
        (which wrote nothing) gets its host counters put back (``restore``) and is dropped
        (``drop``, as ``drop_step`` does); a ``"local"`` one (0/1 Adam's local step, skipped by
        its own rank only) goes to ``drop_local``. Returns whether that step counts: ``True``
        (finite, or sat out by one rank), ``False`` (dropped), ``None`` (no verdict was
        waiting)."""
        if self.pending is None:
            return None
        dropped = self.read_last_step()
        if dropped is None:
            return True
        if dropped.kind == "local":
            drop_local()
            return True
        restore(dropped.counters)
        drop(NonFiniteError(dropped.message))
        return False

    def count_drop(self, limit: int) -> bool:
        """Count a dropped step; return whether it is the ``limit``-th in a row (diverged)."""
        self.skipped_steps += 1
        self.consecutive += 1
        return self.consecutive >= limit

    def drop_step(
        self,
        err: NonFiniteError,
        *,
        step: int,
        limit: int,
        rank: int,
        hint: Callable[[], str],
    ) -> None:
        """Step ``step + 1`` was dropped on every rank for ``err``: count it, warn (on ``rank``
        0, for all), or raise after ``limit`` in a row with what to change (``hint()``)."""
        if self.count_drop(limit):
            raise NonFiniteError(
                f"{self.consecutive} steps in a row had non-finite values (last: {err}); the "
                f"run has diverged: {hint()}, and resume from the last checkpoint"
            ) from err
        if rank == 0:
            warnings.warn(
                f"{self.name}: skipped step {step + 1} on every rank "
                f"({self.skipped_steps} so far): {err}",
                RuntimeWarning,
                stacklevel=4,
            )
