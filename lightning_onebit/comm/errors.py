"""The error state of one 1-bit exchange
([`CompressedAllreduce`][lightning_onebit.comm.flat.CompressedAllreduce]), in one set or two.

A set is the worker error, the worker's records (the bits and scale it sent) and its scale, the
server accumulator and the server record. Both stages defer their error update to the next call
(one sweep over the buffer instead of two): the buffer holds ``y`` (``c``), and the true error is
``y - s * sign(y)`` with ``s`` and ``sign(y)`` still in the records; the next call applies it as it
reads (see ``kernels.worker_compress``, ``kernels.server_reduce``). Double buffered, calls write
set ``1 - cur`` and a commit flips ``cur``. With one set calls update it in place, so the worker
cannot write before the verdict and updates its error in a second sweep after it (the server stage
runs after the verdict and defers either way). The worker's error and the server's may be one
set where the rest is two (``recompute_error``: ``worker_index``, ``server_index``): a call
writes no error then, and its error update runs once it is known to go ahead.

The buffers are made at the first call or load (``make``): an optimizer builds its exchange at
its first step, and its warmup never calls it.
"""

from __future__ import annotations

import threading

import torch

from lightning_onebit import kernels

__all__ = ["ErrorSets", "record_bits", "record_scales"]


def record_bits(records: torch.Tensor, row: int) -> torch.Tensor:
    """The packed signs (``row`` bytes) of each record of ``records`` (one per row)."""
    return records[:, 4 : 4 + row]


def record_scales(records: torch.Tensor) -> torch.Tensor:
    """The float32 scale that starts each record of ``records``."""
    return records.view(torch.float32)[:, 0]


class ErrorSets:
    """The error buffers and communication buffers of one exchange (see the module docstring).

    Args:
        padded_numel: ``n'``, the worker error's size.
        chunk_numel: ``n' / W``, the server accumulator's size.
        record: bytes of one record (``[float32 scale][bits][padding]``).
        world_size: ``W`` (``1``: no receive or gather buffers).
        sets: sets of the server records, 1 or 2.
        worker_sets: worker sets, 1 or ``sets``.
        server_sets: server accumulators, 1 or ``sets``.
        device: where they live.
    """

    def __init__(
        self,
        *,
        padded_numel: int,
        chunk_numel: int,
        record: int,
        world_size: int,
        sets: int,
        worker_sets: int,
        server_sets: int,
        device: torch.device,
    ) -> None:
        self.padded_numel, self.chunk_numel, self.record = padded_numel, chunk_numel, record
        self.world_size, self.sets, self.device = world_size, sets, device
        self.worker_sets, self.server_sets = worker_sets, server_sets
        self.werr: list[torch.Tensor] = []
        self.send: list[torch.Tensor] = []
        self.wscale: list[torch.Tensor] = []
        self.sacc: list[torch.Tensor] = []
        self.srec: list[torch.Tensor] = []
        self.recv: torch.Tensor | None = None
        self.gathered: torch.Tensor | None = None
        #: where a server stage run again at its commit writes its (unchanged) record
        self.scratch_record: torch.Tensor | None = None
        self._lock = threading.Lock()  # the first call may come from backward's hooks

    @property
    def made(self) -> bool:
        """Whether the buffers exist."""
        return bool(self.werr)

    def make(self) -> None:
        """Make every buffer (zeros), once."""
        if self.werr:
            return
        with self._lock:
            if self.werr:
                return
            w, kw = self.world_size, {"device": self.device}
            wsets, sets, record = self.worker_sets, self.sets, self.record
            self.send = [torch.zeros(w, record, dtype=torch.uint8, **kw) for _ in range(wsets)]
            self.wscale = [torch.zeros(1, dtype=torch.float32, **kw) for _ in range(wsets)]
            self.sacc = [
                torch.zeros(self.chunk_numel, dtype=torch.float32, **kw)
                for _ in range(self.server_sets)
            ]
            self.srec = [torch.zeros(record, dtype=torch.uint8, **kw) for _ in range(sets)]
            # W = 1 sends and gathers nothing: its result is the worker's record
            if w > 1:
                self.recv = torch.zeros(w, record, dtype=torch.uint8, **kw)
                self.gathered = torch.zeros(w, record, dtype=torch.uint8, **kw)
                if self.server_sets < sets:
                    self.scratch_record = torch.zeros(record, dtype=torch.uint8, **kw)
            self.werr = [  # last: the flag the checks above read
                torch.zeros(self.padded_numel, dtype=torch.float32, **kw) for _ in range(wsets)
            ]

    def worker_index(self, s: int) -> int:
        """The worker buffers' index of set ``s``."""
        return s if self.worker_sets == 2 else 0

    def server_index(self, s: int) -> int:
        """The server accumulators' index of set ``s``."""
        return s if self.server_sets == 2 else 0

    def settle(self, cur: int) -> None:
        """Apply the deferred error updates of the call that wrote set ``cur``, so that its
        buffers hold the errors themselves. The buffers hold ``y`` (``c``), and the bits sent are
        ``sign(y)``: the update ``y - s * sign(y)`` is ``worker_update_error``'s with no input, one
        native sweep, bit for bit ``finish_pending``'s."""
        if self.worker_sets == 2:  # one set: the worker updated its error after the verdict
            e = self.werr[cur]
            kernels.worker_update_error(e[:0], e, self.wscale[cur])
        e = self.sacc[self.server_index(cur)]
        kernels.worker_update_error(e[:0], e, self.srec[cur].view(torch.float32)[:1])

    def update_worker(self, x: torch.Tensor | kernels.ExchangeSource) -> float | None:
        """One worker set: the error update of the call that compressed ``x`` without writing it
        (the second sweep, once the call goes ahead): ``x`` read again, or recomputed as it is
        read.

        Returns:
            The scale of what was read (``kernels.worker_update_error``'s; bitwise the
            compression's where the inputs did not change), or ``None`` where not recomputed.
        """
        return kernels.worker_update_error(x, self.werr[0], self.wscale[0], rows=self.world_size)

    def update_server(self, cur: int, pending: bool) -> None:
        """One server set: the error update of the call that wrote its record but not ``c``: its
        server stage again, on the same inputs (what it received, the accumulator, set ``cur``'s
        record; ``pending`` as then), storing ``c``. The record it writes is bitwise the one sent
        and goes to scratch (the all_gather may still read the one sent)."""
        assert self.recv is not None and self.scratch_record is not None  # W > 1
        row = self.chunk_numel // 8
        prev, out = self.srec[cur], self.scratch_record
        kernels.server_reduce(
            record_bits(self.recv, row),
            record_scales(self.recv),
            self.sacc[0],
            out[4 : 4 + row],
            out.view(torch.float32)[:1],
            pending=pending,
            prev_bits=prev[4 : 4 + row],
            prev_scale=prev.view(torch.float32)[:1],
        )

    def restore_unless(self, ok: torch.Tensor, nxt: int, cur: int, pending: bool) -> None:
        """Put set ``cur`` back into set ``nxt`` where the device verdict ``ok`` is false (a
        non-finite call leaves the errors as they were). ``pending``: whether set ``cur`` still
        awaits its deferred updates; if not, its errors are final (settled, a load), and with the
        scales of its records 0 the deferred updates leave them so."""
        if not pending:
            self.wscale[cur].zero_()
            self.srec[cur].view(torch.float32)[:1].zero_()
        state = (self.werr, self.send, self.wscale, self.sacc, self.srec)
        # W = 1 has no server stage: its buffers never change
        for bufs in state[: 3 if self.world_size == 1 else 5]:
            kernels.restore_unless(ok, bufs[nxt], bufs[cur])

    def reset(self, cur: int) -> None:
        """Zero the errors of set ``cur`` (nothing where they are not made: zeros when they are)."""
        if not self.werr:
            return
        self.werr[self.worker_index(cur)].zero_()
        self.sacc[self.server_index(cur)].zero_()
        for t in (*self.wscale, *self.srec):  # scales 0: a pending update changes nothing
            t.zero_()

    def load(self, cur: int, worker_error: torch.Tensor, server_error: torch.Tensor) -> None:
        """Set ``cur``'s errors from saved ones (made first)."""
        self.make()
        self.werr[self.worker_index(cur)].copy_(worker_error)
        self.sacc[self.server_index(cur)].copy_(server_error)
