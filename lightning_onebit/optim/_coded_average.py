"""The gradient average in integer codes (``average_dtype=torch.int4``/``torch.int8``): a
[`QuantizedAllreduce`][lightning_onebit.comm.quantized.QuantizedAllreduce] over the optimizer's
gradients, gathered straight into its own layout (each parameter starting a block of its own),
whose error buffers carry each step's rounding into the next (error feedback) and go into the
checkpoint, so a resumed run continues exactly."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from lightning_onebit.comm import CODED_BITS, QuantizedAllreduce

if TYPE_CHECKING:
    from lightning_onebit.optim._flat import Layout

__all__ = ["CodedAverage", "check_coded"]


def check_coded(dtype: torch.dtype, average_warmup_grads: bool, two_levels: bool) -> None:
    """Raise ``ValueError`` where an integer-coded ``dtype`` cannot be averaged: by a caller
    (``average_warmup_grads=False``: DDP's hooks keep no error buffers) or in two levels."""
    if dtype in CODED_BITS and (two_levels or not average_warmup_grads):
        raise ValueError(
            f"average_dtype={dtype} is averaged by the optimizer itself, over one level: it "
            "needs average_warmup_grads=True and no two-level exchange (hierarchical=False); "
            "use average_dtype='bf16' otherwise"
        )


class CodedAverage:
    """The integer-coded average of one optimizer (``OneBitOptimizer.coded_average``): its
    exchange, made at the first average and remade when the layout or the codec changes, and
    the error buffers a checkpoint loaded until then."""

    def __init__(self) -> None:
        self.exchange: QuantizedAllreduce | None = None
        #: a loaded state the next exchange takes (``"reset"``: zeros)
        self.pending: dict[str, Any] | str | None = None

    def inputs(self, layout: Layout, group: Any, bits: int) -> list[torch.Tensor]:
        """Where the next average reads each parameter's gradient (shaped like it) and leaves
        its average: the exchange's own layout
        ([`segment_views`][lightning_onebit.comm.quantized.QuantizedAllreduce.segment_views]), so
        no flat copy of the gradients is made. The exchange is (re)made here for ``layout``, over
        ``group``, in ``bits``-bit codes, a loaded state applied."""
        ex, sizes = self.exchange, [p.numel() for p in layout.params]
        if ex is None or ex.sizes != sizes or ex.bits != bits or ex.device != layout.device:
            if ex is not None and ex.calls > 0 and self.pending is None:
                warnings.warn(
                    "the trainable parameters or the average's codec changed: the coded "
                    "average's error buffers restart from zero",
                    RuntimeWarning,
                    stacklevel=5,
                )
            ex = QuantizedAllreduce(layout.numel, layout.device, group, bits=bits, segments=sizes)
            self.exchange = ex
        pending, self.pending = self.pending, None
        if isinstance(pending, dict):
            try:
                ex.load_state_dict(pending)
            except ValueError as err:  # another world size or layout: the errors do not map
                warnings.warn(f"{err}; they restart from zero", RuntimeWarning, stacklevel=5)
                ex.reset_error()
        elif pending == "reset":
            ex.reset_error()
        views = ex.segment_views()
        return [v.view_as(p) for v, p in zip(views, layout.params, strict=True)]

    def average_(self) -> int:
        """Replace the values at ``inputs`` by their average over the group's ranks; return the
        bytes this rank sent.

        Raises:
            NonFiniteError: on every rank, when any rank's gradients have a NaN/Inf; the error
                buffers are as they were.
        """
        assert self.exchange is not None, "inputs() first"
        self.exchange.average_in_place()
        return self.exchange.bytes_sent

    def inter_node_bytes(self, node_size: int) -> int:
        """Of the last call's bytes, those that left the node (``node_size`` ranks per node):
        the records to the ranks of other nodes."""
        ex = self.exchange
        if ex is None or ex.world_size <= node_size:
            return 0
        w = ex.world_size
        return ex.bytes_sent * (w - node_size) // (w - 1)

    def release(self) -> None:
        """Let go of the exchange and its buffers (at the switch: the compression phase averages
        no gradients, or averages them rarely enough to start its errors afresh)."""
        self.exchange, self.pending = None, None

    def state(self) -> dict[str, Any] | None:
        """This rank's error buffers as a checkpoint keeps them (``None``: none)."""
        if isinstance(self.pending, dict):
            return self.pending
        if self.pending == "reset" or self.exchange is None or self.exchange.calls == 0:
            return None
        return self.exchange.state_dict()

    def load(self, state: dict[str, Any] | None) -> None:
        """Apply a ``state`` at the next average (``None``: start from zeros)."""
        self.pending = state or "reset"
