"""The integer codec of a compressed average: values as 4- or 8-bit integers with one float32
scale per block of ``block`` values, the error of each rounding kept by the caller (error
feedback, as the 1-bit exchange keeps its own). It is what a compressed gradient average (the
warmup's) sends in place of bf16 values: at 4 bits and blocks of 256, ``32 / (4 + 32 / 256) =
7.8`` times fewer bytes than fp32 where bf16 sends 2 times fewer.

Per block: ``s = max|y| / Q`` (``Q = 2**(bits - 1) - 1``: 7 or 127), ``q = clamp(round(y / s),
-Q, Q)`` (round half to even), ``q = 0`` where ``s`` is 0 or not finite (a NaN or Inf in the
block makes its scale non-finite: the receiver's check sees it); the block decodes to ``s * q``
and its error is ``y - s * q``. A *row* is one destination's chunk of ``m`` values (``m`` a multiple
of ``block``) on the wire: its ``m / block`` scales, then its codes (8 bits: int8; 4 bits: ``q +
8`` in a nibble, value ``2k`` in the low nibble of byte ``k``). Rows are the rows of a uint8
tensor, at least [`row_bytes`][lightning_onebit.kernels.quantized.row_bytes] wide.

The compiled kernels (C++, CPU) and their torch twins give the same bits: every value is
computed with the same float32 operations.
"""

from __future__ import annotations

import torch

from lightning_onebit.kernels import native
from lightning_onebit.kernels.reference import (
    reference_dequantize,
    reference_quantize,
    reference_quantized_reduce,
)

__all__ = ["check_codec", "dequantize", "quantize", "quantized_reduce", "row_bytes"]

#: the largest block the kernels take
MAX_BLOCK = 4096


def row_bytes(m: int, bits: int, block: int) -> int:
    """Bytes of one row of ``m`` values: ``m / block`` float32 scales and ``m * bits / 8`` bytes of
    codes, rounded up to a multiple of 4 (so that rows stacked in one tensor keep their scales
    aligned)."""
    check_codec(bits, block)
    if m <= 0 or m % block:
        raise ValueError(f"a row holds a positive multiple of block={block} values, got {m}")
    return -(-(4 * (m // block) + m * bits // 8) // 4) * 4


def check_codec(bits: int, block: int) -> None:
    """Raise ``ValueError`` unless ``bits`` is 4 or 8 and ``block`` an even int the kernels
    take (at most ``MAX_BLOCK``)."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    if not isinstance(block, int) or block <= 0 or block % 2 or block > MAX_BLOCK:
        raise ValueError(f"block must be an even int in [2, {MAX_BLOCK}], got {block!r}")


def _check_rows(rows: torch.Tensor, m: int, bits: int, block: int) -> None:
    need = 4 * (m // block) + m * bits // 8
    if rows.dim() != 2 or rows.size(1) < need:
        raise ValueError(
            f"rows must be a (W, >= {need}) uint8 tensor for rows of {m} values at {bits} bits "
            f"in blocks of {block}, got shape {tuple(rows.shape)}"
        )


def _qmax(bits: int) -> int:
    return 7 if bits == 4 else 127


def quantize(
    x: torch.Tensor,
    error: torch.Tensor | None,
    rows: torch.Tensor,
    *,
    bits: int,
    block: int,
    error_out: torch.Tensor | None = None,
    n: int | None = None,
    write_error: bool = True,
) -> None:
    """Encode ``y = x + error`` (``x`` zero-padded to ``n`` values; ``error`` ``None``: ``y = x``,
    no error kept) into ``rows``: chunk ``j`` of ``n / W`` values into row ``j``.

    Args:
        x: float32, contiguous, at most ``n`` values.
        error: float32, contiguous, ``n`` values (``n`` a multiple of ``W * block``), or
            ``None``.
        rows: uint8 ``(W, >= row_bytes(n / W, bits, block))``, rows contiguous.
        bits: 4 or 8.
        block: values per scale (even, at most 4096).
        error_out: where the new error ``y - s * q`` goes (float32, contiguous, ``n`` values; may
            be ``error``). Default: ``error`` (in place); nothing where ``error`` is ``None``.
        n: the padded size; default ``error.numel()`` (needed without an ``error``).
        write_error: ``False``: the rows only (a call whose error update waits until it is known
            to go ahead; the same call with ``True`` writes the same rows).

    Raises:
        ValueError: another size, dtype or layout.
    """
    check_codec(bits, block)
    error_out = (error if error_out is None else error_out) if write_error else None
    device, _ = native.check("quantize", x=x, error=error, error_out=error_out, rows=rows)
    w = rows.size(0)
    if n is None:
        if error is None:
            raise ValueError("quantize: pass n (the padded size) where there is no error buffer")
        n = error.numel()
    if error is not None and error.numel() != n:
        raise ValueError(f"error must hold n = {n} values, got {error.numel()}")
    if n <= 0 or n % (w * block) or x.numel() > n:
        raise ValueError(
            f"quantize: the buffer must be a positive multiple of W * block = {w * block} values "
            f"holding x ({x.numel()}), got {n}"
        )
    if error_out is not None and error_out.numel() != n:
        raise ValueError(f"error_out must hold {n} values, got {error_out.numel()}")
    _check_rows(rows, n // w, bits, block)
    if not native.has_kernel(device, "quantize") or not native.use_native():
        reference_quantize(
            x,
            error,
            rows,
            bits=bits,
            block=block,
            error_out=error_out,
            n=n,
            write_error=write_error,
        )
        return
    native.launch("quantize", device, x=x, error=error, error_out=error_out, n=n, bits=bits,
                  block=block, rows=rows)  # fmt: skip


def quantized_reduce(
    rows: torch.Tensor,
    error: torch.Tensor | None,
    out_row: torch.Tensor,
    *,
    m: int,
    bits: int,
    block: int,
    error_out: torch.Tensor | None = None,
    write_error: bool = True,
) -> None:
    """The server side: ``c = sum_r (s_r / W) * q_r`` over the ``W`` rows in order, ``+ error``
    (``None``: nothing), encoded into ``out_row``.

    Args:
        rows: uint8 ``(W, >= row_bytes(m, bits, block))``, one sender's chunk per row.
        error: float32, contiguous, ``m`` values, or ``None``.
        out_row: uint8, contiguous, at least ``row_bytes(m, bits, block)`` bytes.
        m: values per row.
        bits, block: the codec.
        error_out: where ``c - s * q`` goes (default: ``error``, in place).
        write_error: ``False``: the row only, the error not written (a call whose error update
            waits until it is known to go ahead; the same call with ``True`` writes the same row).
    """
    check_codec(bits, block)
    error_out = (error if error_out is None else error_out) if write_error else None
    device, _ = native.check("quantized_reduce", rows=rows, error=error, error_out=error_out,
                             out_row=out_row)  # fmt: skip
    need = row_bytes(m, bits, block)
    _check_rows(rows, m, bits, block)
    for name, t in (("error", error), ("error_out", error_out)):
        if t is not None and t.numel() != m:
            raise ValueError(f"{name} must hold m = {m} values, got {t.numel()}")
    if out_row.numel() < need - 3:
        raise ValueError(f"out_row must hold at least {need - 3} bytes, got {out_row.numel()}")
    if not native.has_kernel(device, "quantized_reduce") or not native.use_native():
        reference_quantized_reduce(rows, error, out_row, m=m, bits=bits, block=block,
                                   error_out=error_out, write_error=write_error)  # fmt: skip
        return
    native.launch("quantized_reduce", device, rows=rows, m=m, bits=bits, block=block, error=error,
                  error_out=error_out, out_row=out_row)  # fmt: skip


def dequantize(rows: torch.Tensor, out: torch.Tensor, *, m: int, bits: int, block: int) -> None:
    """Decode ``W`` rows of ``m`` values into ``out`` (``s * q``; its first ``out.numel() <= W *
    m`` values: the padding dropped)."""
    check_codec(bits, block)
    device, _ = native.check("dequantize", rows=rows, out=out)
    _check_rows(rows, m, bits, block)
    if out.numel() > rows.size(0) * m:
        raise ValueError(f"out holds at most W * m = {rows.size(0) * m} values, got {out.numel()}")
    if not native.has_kernel(device, "dequantize") or not native.use_native():
        reference_dequantize(rows, out, m=m, bits=bits, block=block)
        return
    native.launch("dequantize", device, rows=rows, m=m, bits=bits, block=block, out=out)
