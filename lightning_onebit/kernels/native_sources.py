"""The compiled source kernels' launches (``momentum_source``, ``local_source``, their deferred
compressions ``momentum_compress``, ``local_compress`` and their error updates
``momentum_update_error``, ``local_update_error``): each one's segment table and coefficients as
the kernels take them, on tensors [kernels.sources][lightning_onebit.kernels.sources] checked
already."""

from __future__ import annotations

from typing import Any

import torch

from lightning_onebit.kernels import native
from lightning_onebit.kernels.denominator import Denominator

__all__ = [
    "compressed_args",
    "local_coefficients",
    "local_compress",
    "local_source",
    "local_update_error",
    "momentum_compress",
    "momentum_source",
    "momentum_update_error",
]


def local_coefficients(
    beta: list[float], alpha: list[float], lr: list[float], weight_decay: list[float]
) -> dict[str, list[float]]:
    """``local_source``'s per-segment coefficients as its kernels take them: ``beta``,
    ``alpha``, ``-weight_decay`` rounded from double (+0.0: no decay term, as the torch ops skip
    it), ``-lr``."""
    nwd = [-w if w > 0 else 0.0 for w in weight_decay]
    return {"beta": beta, "alpha": alpha, "nwd": nwd, "nlr": [-a for a in lr]}


def compressed_args(
    *,
    starts: list[int],
    sizes: list[int],
    error: torch.Tensor,
    bits: torch.Tensor,
    scale: torch.Tensor,
    error_out: torch.Tensor,
    pending: bool,
    prev_bits: torch.Tensor,
    prev_scale: torch.Tensor,
) -> dict[str, Any]:
    """The source compressions' deferred ``worker_compress`` arguments: the flat range the
    segments ``starts``, ``sizes`` tile, ``error``, ``bits``, ``scale``, ``error_out`` and, if
    ``pending``, ``prev_bits`` and ``prev_scale``."""
    prev_bits, prev_scale = (prev_bits, prev_scale) if pending else (None, None)
    return dict(base=starts[0], nx=sum(sizes), error=error, error_out=error_out, bits=bits,
                prev_bits=prev_bits, prev_scale=prev_scale, pending=bool(pending), scale=scale)  # fmt: skip


def momentum_source(
    *,
    exp_avg: torch.Tensor,
    grads: list[torch.Tensor | None],
    denom: Denominator | None,
    out: torch.Tensor,
    starts: list[int],
    sizes: list[int],
    beta: list[float],
    alpha: list[float],
) -> None:
    """The compiled ``momentum_source`` on checked tensors.

    Args:
        exp_avg, out: the flat buffers read and written.
        grads: the segments' gradients (``None``: zeros).
        denom: the divisor ([Denominator][lightning_onebit.kernels.Denominator]), or ``None``
            (no division).
        starts, sizes: each segment's first flat index and number of values.
        beta, alpha: per segment the factors of ``exp_avg`` and of the gradient.
    """
    table = native.segment_table(
        starts,
        sizes,
        {"grads": grads},
        {"beta": beta, "alpha": alpha, **native.denominator_coefs(denom)},
    )
    native.launch(
        "momentum_source",
        out.device,
        table,
        exp_avg=exp_avg,
        **native.denominator_args(denom),
        out=out,
    )


def local_source(
    *,
    exp_avg: torch.Tensor,
    grads: list[torch.Tensor | None],
    denom: Denominator,
    params: list[torch.Tensor | None] | None,
    acc: torch.Tensor | None,
    out: torch.Tensor,
    starts: list[int],
    sizes: list[int],
    beta: list[float],
    alpha: list[float],
    lr: list[float],
    weight_decay: list[float],
    preconditioned: bool,
) -> None:
    """The compiled ``local_source`` on checked tensors.

    Args:
        exp_avg, out: the flat buffers read and written.
        denom: the divisor ([Denominator][lightning_onebit.kernels.Denominator]).
        grads: the segments' gradients (``None``: zeros).
        params: the segments' parameters, or ``None`` (no decay term).
        acc: the flat accumulator, or ``None`` (no accumulator term).
        starts, sizes: each segment's first flat index and number of values.
        beta, alpha, lr, weight_decay: per segment the coefficients.
        preconditioned: the values divided by ``denom``.
    """
    coefs = {**local_coefficients(beta, alpha, lr, weight_decay), **native.denominator_coefs(denom)}
    table = native.segment_table(starts, sizes, {"grads": grads, "params": params}, coefs)
    native.launch("local_source", out.device, table, exp_avg=exp_avg, **native.denominator_args(denom), acc=acc, out=out,
           precond=bool(preconditioned))  # fmt: skip


def momentum_compress(
    *,
    exp_avg: torch.Tensor,
    grads: list[torch.Tensor | None],
    denom: Denominator | None,
    starts: list[int],
    sizes: list[int],
    beta: list[float],
    alpha: list[float],
    error: torch.Tensor,
    bits: torch.Tensor,
    scale: torch.Tensor,
    error_out: torch.Tensor,
    pending: bool,
    prev_bits: torch.Tensor,
    prev_scale: torch.Tensor,
) -> None:
    """The compiled deferred ``worker_compress`` of `momentum_source`'s values.

    Args:
        exp_avg, grads, denom, beta, alpha: as `momentum_source`'s.
        starts, sizes: as `momentum_source`'s; the segments tile the input's flat range in
            order.
        error, bits, scale, error_out, pending, prev_bits, prev_scale: as ``worker_compress``'s
            (checked by it).
    """
    table = native.segment_table(
        starts,
        sizes,
        {"grads": grads},
        {"beta": beta, "alpha": alpha, **native.denominator_coefs(denom)},
    )
    compressed = compressed_args(starts=starts, sizes=sizes, error=error, bits=bits, scale=scale,
                             error_out=error_out, pending=pending, prev_bits=prev_bits,
                             prev_scale=prev_scale)  # fmt: skip
    native.launch(
        "momentum_compress",
        exp_avg.device,
        table,
        exp_avg=exp_avg,
        **native.denominator_args(denom),
        **compressed,
    )


def local_compress(
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
    error: torch.Tensor,
    bits: torch.Tensor,
    scale: torch.Tensor,
    error_out: torch.Tensor,
    pending: bool,
    prev_bits: torch.Tensor,
    prev_scale: torch.Tensor,
) -> None:
    """The compiled deferred ``worker_compress`` of `local_source`'s values.

    Args:
        exp_avg, grads, denom, params, acc, beta, alpha, lr, weight_decay, preconditioned: as
            `local_source`'s.
        starts, sizes: as `local_source`'s; the segments tile the input's flat range in order.
        error, bits, scale, error_out, pending, prev_bits, prev_scale: as ``worker_compress``'s
            (checked by it).
    """
    coefs = {**local_coefficients(beta, alpha, lr, weight_decay), **native.denominator_coefs(denom)}
    table = native.segment_table(starts, sizes, {"grads": grads, "params": params}, coefs)
    compressed = compressed_args(starts=starts, sizes=sizes, error=error, bits=bits, scale=scale,
                             error_out=error_out, pending=pending, prev_bits=prev_bits,
                             prev_scale=prev_scale)  # fmt: skip
    native.launch("local_compress", exp_avg.device, table, exp_avg=exp_avg, **native.denominator_args(denom), acc=acc,
           precond=bool(preconditioned), **compressed)  # fmt: skip


def momentum_update_error(
    *,
    exp_avg: torch.Tensor,
    grads: list[torch.Tensor | None],
    denom: Denominator | None,
    starts: list[int],
    sizes: list[int],
    beta: list[float],
    alpha: list[float],
    error: torch.Tensor,
    scale: torch.Tensor,
    error_out: torch.Tensor,
    rows: int,
) -> float:
    """The compiled ``worker_update_error`` of `momentum_source`'s values, recomputed as read.

    Args:
        exp_avg, grads, denom, beta, alpha: as `momentum_source`'s.
        starts, sizes: as `momentum_source`'s; the segments tile the input's flat range in
            order.
        error, scale, error_out, rows: as ``worker_update_error``'s ``error``, ``scale``,
            ``out``, ``rows`` (checked by it).

    Returns:
        The scale of the values read (``worker_update_error``'s).
    """
    table = native.segment_table(
        starts,
        sizes,
        {"grads": grads},
        {"beta": beta, "alpha": alpha, **native.denominator_coefs(denom)},
    )
    return native.launch("momentum_update_error", exp_avg.device, table, exp_avg=exp_avg,
                         **native.denominator_args(denom), base=starts[0], nx=sum(sizes), error=error, out=error_out,
                         rows=rows, scale=scale)  # fmt: skip


def local_update_error(
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
    error: torch.Tensor,
    scale: torch.Tensor,
    error_out: torch.Tensor,
    rows: int,
) -> float:
    """The compiled ``worker_update_error`` of `local_source`'s values, recomputed as read.

    Args:
        exp_avg, grads, denom, params, acc, beta, alpha, lr, weight_decay, preconditioned: as
            `local_source`'s.
        starts, sizes: as `local_source`'s; the segments tile the input's flat range in order.
        error, scale, error_out, rows: as ``worker_update_error``'s ``error``, ``scale``,
            ``out``, ``rows`` (checked by it).

    Returns:
        The scale of the values read (``worker_update_error``'s).
    """
    coefs = {**local_coefficients(beta, alpha, lr, weight_decay), **native.denominator_coefs(denom)}
    table = native.segment_table(starts, sizes, {"grads": grads, "params": params}, coefs)
    return native.launch("local_update_error", exp_avg.device, table, exp_avg=exp_avg,
                         **native.denominator_args(denom), acc=acc, precond=bool(preconditioned), base=starts[0],
                         nx=sum(sizes), error=error, out=error_out, rows=rows,
                         scale=scale)  # fmt: skip
