"""The compiled source kernels' launches: for each kind of source (``momentum``, ``local``) its
value kernel (``momentum_source``, ``local_source``), its deferred compression
(``momentum_compress``, ``local_compress``) and its error update (``momentum_update_error``,
``local_update_error``), all three from one
[`SourceKernels`][lightning_onebit.kernels.native_sources.SourceKernels]: the segment table,
coefficients and tensors as the kernels take them, made once from arguments that
[kernels.sources][lightning_onebit.kernels.sources] checked already."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lightning_onebit.kernels import native
from lightning_onebit.kernels.denominator import Denominator

__all__ = ["SourceKernels", "local_kernels", "momentum_kernels"]


@dataclasses.dataclass(frozen=True)
class SourceKernels:
    """One source's three launches with what each of them takes.

    Attributes:
        kind: ``"momentum"`` or ``"local"``: the kernels' names' prefix.
        device: where the tensors are.
        table: the segment table (``native.segment_table``).
        base, nx: the flat range the segments tile, in order (first index, number of values).
        args: the tensors and flags every launch of the kind passes.
    """

    kind: str
    device: torch.device
    table: Any
    base: int
    nx: int
    args: dict[str, Any]

    def source(self, out: torch.Tensor) -> None:
        """The values into ``out`` (the flat buffer indexed like the others)."""
        native.launch(f"{self.kind}_source", self.device, self.table, **self.args, out=out)

    def compress(
        self,
        *,
        error: torch.Tensor,
        bits: torch.Tensor,
        scale: torch.Tensor,
        error_out: torch.Tensor,
        pending: bool,
        prev_bits: torch.Tensor,
        prev_scale: torch.Tensor,
    ) -> None:
        """The deferred ``worker_compress`` of the values as they are computed (arguments as its,
        checked by it; ``prev_bits`` and ``prev_scale`` read only if ``pending``)."""
        prev_bits, prev_scale = (prev_bits, prev_scale) if pending else (None, None)
        native.launch(f"{self.kind}_compress", self.device, self.table, **self.args,
                      base=self.base, nx=self.nx, error=error, error_out=error_out, bits=bits,
                      prev_bits=prev_bits, prev_scale=prev_scale, pending=bool(pending),
                      scale=scale)  # fmt: skip

    def update_error(
        self, *, error: torch.Tensor, scale: torch.Tensor, error_out: torch.Tensor, rows: int
    ) -> float:
        """``worker_update_error`` of the values recomputed as read (``error``, ``scale``,
        ``error_out``, ``rows`` as its ``error``, ``scale``, ``out``, ``rows``, checked by it).

        Returns:
            The scale of the values read.
        """
        return native.launch(f"{self.kind}_update_error", self.device, self.table, **self.args,
                             base=self.base, nx=self.nx, error=error, out=error_out, rows=rows,
                             scale=scale)  # fmt: skip


def momentum_kernels(
    *,
    exp_avg: torch.Tensor,
    grads: list[torch.Tensor | None],
    denom: Denominator | None,
    starts: list[int],
    sizes: list[int],
    beta: list[float],
    alpha: list[float],
) -> SourceKernels:
    """The launches of ``beta * exp_avg + alpha * grad`` (over ``d`` where ``denom`` is given).

    Args:
        exp_avg: the flat momentum.
        grads: the segments' gradients (``None``: zeros).
        denom: the divisor ([Denominator][lightning_onebit.kernels.Denominator]), or ``None``.
        starts, sizes: each segment's first flat index and number of values.
        beta, alpha: per segment the factors of ``exp_avg`` and of the gradient.
    """
    coefs = {"beta": beta, "alpha": alpha, **native.denominator_coefs(denom)}
    table = native.segment_table(starts, sizes, {"grads": grads}, coefs)
    args = {"exp_avg": exp_avg, **native.denominator_args(denom)}
    return SourceKernels("momentum", exp_avg.device, table, starts[0], sum(sizes), args)


def local_kernels(
    *,
    exp_avg: torch.Tensor,
    grads: list[torch.Tensor | None],
    denom: Denominator,
    params: list[torch.Tensor | None] | None,
    acc: torch.Tensor | None,
    starts: list[int],
    sizes: list[int],
    beta: list[float],
    alpha: list[float],
    lr: list[float],
    weight_decay: list[float],
    preconditioned: bool,
) -> SourceKernels:
    """The launches of 0/1 Adam's sync source (``kernels.sources.local_source``'s values).

    Args:
        exp_avg: the flat momentum.
        denom: the divisor ([Denominator][lightning_onebit.kernels.Denominator]).
        grads: the segments' gradients (``None``: zeros).
        params: the segments' parameters, or ``None`` (no decay term).
        acc: the flat accumulator, or ``None`` (no accumulator term).
        starts, sizes: each segment's first flat index and number of values.
        beta, alpha, lr, weight_decay: per segment the coefficients (the kernels take
            ``-weight_decay``, +0.0 where there is none, as the torch ops skip it, and ``-lr``).
        preconditioned: the values divided by ``denom``.
    """
    nwd = [-w if w > 0 else 0.0 for w in weight_decay]
    coefs = {"beta": beta, "alpha": alpha, "nwd": nwd, "nlr": [-a for a in lr]}
    coefs.update(native.denominator_coefs(denom))
    table = native.segment_table(starts, sizes, {"grads": grads, "params": params}, coefs)
    args = {"exp_avg": exp_avg, **native.denominator_args(denom), "acc": acc}
    args["precond"] = bool(preconditioned)
    return SourceKernels("local", exp_avg.device, table, starts[0], sum(sizes), args)
