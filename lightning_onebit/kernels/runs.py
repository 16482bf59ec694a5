"""An exchange's result where it lies: [SignRuns][lightning_onebit.kernels.SignRuns], the record
that the update kernels read in place of a decoded buffer. A leaf of ``kernels``: the compiled
calls (``native``) and the decoding (``compression``) both take it."""

from __future__ import annotations

import torch

from lightning_onebit.kernels.checks import check_contiguous, check_tensor

__all__ = ["SignRuns"]


class SignRuns:
    """An exchange's result where it lies, in place of the decoded buffer: run
    ``(lo, hi, bits, scale)`` holds the flat values ``lo:hi``, value ``lo + k`` being ``+scale``
    where bit ``k`` of ``bits`` is set and ``-scale`` where not (the wire format's numbering).
    `frozen_adam_update`, `lamb_frozen_update` and `sync_update` read it directly with the
    compiled CPU kernels, so the values are never written out and read back (8 bytes per
    value); elsewhere they decode it first (`decode_runs`), the same floats. The runs' bits are
    views of the exchange's records: valid until its next call.

    Args:
        runs: non-empty runs that tile a flat range (any order), ``bits`` a contiguous uint8 CPU
            tensor of at least ``ceil((hi - lo) / 8)`` bytes.

    Raises:
        ValueError: the runs do not tile a range, or a run's bits are too short.
    """

    def __init__(self, runs: list[tuple[int, int, torch.Tensor, float]]) -> None:
        self.runs = sorted(runs, key=lambda r: r[0])
        for k, (lo, hi, bits, _) in enumerate(self.runs):
            check_tensor("bits", bits, torch.uint8)
            check_contiguous("bits", bits)
            if bits.device.type != "cpu":
                raise ValueError(f"SignRuns are read on the CPU, got bits on {bits.device}")
            if hi <= lo or (k and lo != self.runs[k - 1][1]) or bits.numel() * 8 < hi - lo:
                raise ValueError(
                    "SignRuns must be non-empty runs that tile a flat range, each with its "
                    f"values' bits; got run {k} = [{lo}, {hi}) with {bits.numel()} bytes after "
                    f"{self.runs[k - 1][:2] if k else 'none'}"
                )
        if not self.runs:
            raise ValueError("SignRuns needs at least one run")
        self.lo, self.hi = self.runs[0][0], self.runs[-1][1]

    def covers(self, lo: int, hi: int) -> bool:
        """Whether the runs hold every value of ``lo:hi`` (an empty range: always)."""
        return lo >= hi or (self.lo <= lo and hi <= self.hi)

    def check_covers(self, ranges: list[tuple[int, int]], device: torch.device) -> None:
        """Raise ``ValueError`` unless the update's buffers are on the CPU and the runs hold
        every value of each ``(lo, hi)`` of ``ranges``."""
        if device.type != "cpu":
            raise ValueError(f"SignRuns are read on the CPU, got buffers on {device}")
        for lo, hi in ranges:
            if not self.covers(lo, hi):
                raise ValueError(
                    f"the SignRuns hold the values [{self.lo}, {self.hi}), the update reads "
                    f"[{lo}, {hi})"
                )
