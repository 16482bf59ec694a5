"""A flat exchange's call in flight
([`ExchangeHandle`][lightning_onebit.comm.handle.ExchangeHandle]) and its stage 1 done
([`Compressed`][lightning_onebit.comm.handle.Compressed]): what
[`CompressedAllreduce.start`][lightning_onebit.comm.flat.CompressedAllreduce.start] returns and
takes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from lightning_onebit import kernels
from lightning_onebit.comm.base import Handle, NonFiniteError, explained

if TYPE_CHECKING:
    from lightning_onebit.comm.flat import CompressedAllreduce

__all__ = ["Compressed", "ExchangeHandle"]


class Compressed(NamedTuple):
    """A call's stage 1, done
    ([`CompressedAllreduce.prepare`][lightning_onebit.comm.flat.CompressedAllreduce.prepare]): the
    worker compression into the send records of error-buffer set ``next_set``;
    [`CompressedAllreduce.start`][lightning_onebit.comm.flat.CompressedAllreduce.start] sends them.
    ``x``: the input where the call reads it again (one set of error buffers)."""

    exchange: CompressedAllreduce
    x: torch.Tensor | kernels.ExchangeSource
    shape: torch.Size
    next_set: int
    commit: bool


class ExchangeHandle(Handle):
    """An exchange in flight: stage 1 is done, the final ``all_gather`` may still be running.

    ``wait()`` finishes it and returns the averaged tensor; ``get_future()`` gives a
    ``torch.futures.Future`` for use in DDP communication hooks. A handle from
    ``start(..., commit=False)`` also has ``finite`` (whether every rank's input was finite) and
    ``commit()`` / ``discard()``: the exchange's error buffers advance only on ``commit()``.
    """

    def __init__(
        self,
        exchange: CompressedAllreduce,
        work: Any,
        out: torch.Tensor,
        shape: torch.Size,
        *,
        gathered: torch.Tensor | None = None,
        next_set: int = 0,
        finite: bool = True,
        bad_ranks: list[int] | None = None,
        call: int = 0,
        ok: torch.Tensor | None = None,
    ) -> None:
        self._exchange = exchange
        self._work = work
        self._out = out
        self._shape = shape
        self._result: torch.Tensor | None = None
        self.finite = finite
        self.bad_ranks = bad_ranks or []
        self._call = call
        self._gathered = gathered  # the records to decode
        self._next = next_set  # the error-buffer set this call wrote
        self.ok = ok  # device_verdict: the verdict on the device (finite is then always True)

    def error(self) -> NonFiniteError:
        """The error of a call with non-finite input (``finite`` is False)."""
        return self._exchange.non_finite_error(self.bad_ranks, self._call)

    def wait(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The averaged tensor (identical on every rank), decoded into ``out`` if given (else
        where ``start`` was told). Raises NonFiniteError if not finite."""
        if not self.finite:
            raise self.error()
        if self._result is None:
            self._drain()
            out = self._out if out is None else out
            self._result = self._exchange.decode(self._gathered, out).view(self._shape)
        return self._result

    def runs(self, base: int = 0) -> list[tuple[int, int, torch.Tensor, float]]:
        """The averaged values where they lie, not decoded: one run per server chunk (see
        [`SignRuns`][lightning_onebit.kernels.runs.SignRuns]), at flat offset ``base``. Raises
        NonFiniteError if not finite."""
        if not self.finite:
            raise self.error()
        self._drain()
        return self._exchange.sign_runs(self._gathered, base)

    def records(self) -> torch.Tensor:
        """The ``W`` records every rank decodes (``[scale][bits][padding]`` per server chunk),
        once the final ``all_gather`` is done: the two-level exchange forwards them."""
        self._drain()
        return self._gathered

    def _drain(self) -> None:
        if self._work is not None:
            work, self._work = self._work, None
            with explained("all_gather", self._exchange.rank, self._exchange.world_size):
                work.wait()

    def commit(self, ok: torch.Tensor | None = None) -> None:
        """Make this call's error-buffer updates the exchange's state (``commit=False`` calls).
        With ``device_verdict``, only where ``ok`` (default: this call's verdict; e.g. the
        verdict of every bucket of a step) is true, on the device."""
        if not self.finite:
            raise self.error()
        self._exchange.commit_call(self, self._next, ok)

    def discard(self) -> None:
        """Drop this call: its all_gather is drained, the error buffers stay as before it."""
        self._drain()
        self._exchange.forget_call(self)

    def get_future(self) -> torch.futures.Future:
        if self._work is None:
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(self.wait())
            return fut
        return self._work.get_future().then(lambda _: self.wait())
