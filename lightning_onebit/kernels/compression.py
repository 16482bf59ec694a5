"""The exchange's kernels: the worker's error-compensated 1-bit compression
([`worker_compress`][lightning_onebit.kernels.compression.worker_compress]), the server's reduction
of ``W`` compressed chunks ([`server_reduce`][lightning_onebit.kernels.compression.server_reduce]),
decompression ([`decompress`][lightning_onebit.kernels.compression.decompress]), and the decoding of
the exchange's result where it lies (`decode_runs`)."""

from __future__ import annotations

import torch

from lightning_onebit.kernels import native
from lightning_onebit.kernels.checks import check_row_bytes
from lightning_onebit.kernels.reference import (
    reference_decompress,
    reference_server_reduce,
    reference_worker_compress,
    reference_worker_update_error,
)
from lightning_onebit.kernels.runs import SignRuns
from lightning_onebit.kernels.sources import ExchangeSource

__all__ = ["decode_runs", "decompress", "server_reduce", "worker_compress", "worker_update_error"]


def worker_compress(
    x: torch.Tensor | ExchangeSource,
    error: torch.Tensor,
    bits: torch.Tensor,
    scale: torch.Tensor,
    *,
    update_error: bool = True,
    deferred: bool = False,
    error_out: torch.Tensor | None = None,
    pending: bool = False,
    prev_bits: torch.Tensor | None = None,
    prev_scale: torch.Tensor | None = None,
) -> None:
    """Error-compensated 1-bit compression of ``x`` (the worker side of the exchange).

    With ``n = error.numel()`` and ``W = bits.size(0)``: ``y = x + error`` (``x`` is read as
    zero beyond its ``x.numel() <= n`` values), ``scale = ||y||_2 / sqrt(n)``, row ``j`` of
    ``bits`` receives the packed signs of ``y[j*n/W : (j+1)*n/W]``, and the error becomes
    ``y - scale * sign(y)``. That update needs the scale, i.e. every value read first, so it
    takes a second sweep over the buffer, or none:

    - default: the second sweep runs in this call, ``error`` in place.
    - ``update_error=False``: ``error`` is left as it was, and
    [`worker_update_error`][lightning_onebit.kernels.compression.worker_update_error]
      (same ``x``, ``error``, ``scale``) applies the update later: the exchange first learns
      whether every rank's scale is finite, so that a skipped step changes nothing.
    - ``deferred=True``: one sweep. ``error_out`` (default: ``error``) receives ``y``, and the
      true error is ``error_out - scale * sign(bits)``: pass ``pending=True`` to the next call
      with this call's ``bits`` and ``scale`` as ``prev_bits``/``prev_scale`` (defaults:
      ``bits``/``scale``, still holding them when the same buffers are reused) and it applies
      the update as it reads ``error``; or apply it with
      [`finish_pending`][lightning_onebit.kernels.reference.finish_pending], as
      [`server_reduce`][lightning_onebit.kernels.compression.server_reduce]'s. A separate
      ``error_out`` (and ``bits``) leaves the inputs as they were (double buffering: a call that may
      still be dropped).

    ``x`` may be an [`ExchangeSource`][lightning_onebit.kernels.sources.ExchangeSource]
    ([`MomentumSource`][lightning_onebit.kernels.sources.MomentumSource],
    [`LocalSource`][lightning_onebit.kernels.sources.LocalSource]): the deferred form computes its
    values as it reads them where it can
    ([`ExchangeSource.computed_as_read`][lightning_onebit.kernels.sources.ExchangeSource.computed_as_read]),
    the same floats as from the buffer; otherwise it materializes them first (a
    [`TensorSource`][lightning_onebit.kernels.sources.TensorSource]: its tensor).

    Args:
        x: float32, contiguous, at most ``n`` values (any shape); or an
            [`ExchangeSource`][lightning_onebit.kernels.sources.ExchangeSource].
        error: float32, contiguous, ``n`` values, ``n`` a multiple of ``8 * W``.
        bits: uint8 ``(W, n // (8 * W))``, rows contiguous (may be strided views).
        scale: float32 with one element; receives the scale (on the tensors' device).
        update_error: update the error in this call (``False``: leave it to
            [`worker_update_error`][lightning_onebit.kernels.compression.worker_update_error]).
        deferred: the one-sweep form above.
        error_out: (``deferred``) float32, contiguous, ``n`` values; default ``error``.
        pending: (``deferred``) whether ``error`` still awaits the previous call's deferred
            update.
        prev_bits: (``pending``) uint8, the shape and row stride of ``bits``; default ``bits``.
        prev_scale: (``pending``) float32 with one element; default ``scale``.

    Raises:
        ValueError: on a wrong dtype, device, size or layout, ``error_out``/``pending``
            without ``deferred``, or ``deferred`` with ``update_error=False``.
    """
    if not deferred and (pending or error_out is not None):
        raise ValueError("error_out and pending are the deferred form's: pass deferred=True")
    if deferred and not update_error:
        raise ValueError(
            "deferred=True updates the error (deferred); update_error=False is the two-call form"
        )
    source = None
    if isinstance(x, ExchangeSource):
        computed = x.computed_as_read and (deferred or x.updated_as_read)
        if computed:  # x: its geometry, for the checks; not read
            source, x = x, x.like()
        else:
            x = x.materialize()
    error_out = error if error_out is None else error_out
    prev_bits = bits if prev_bits is None else prev_bits
    prev_scale = scale if prev_scale is None else prev_scale
    device, _ = native.check("worker_compress", x=x, error=error, error_out=error_out, bits=bits,
                             prev_bits=prev_bits, scale=scale, prev_scale=prev_scale)  # fmt: skip
    n, w = error.numel(), bits.size(0)
    if n == 0 or n % (8 * w):
        raise ValueError(f"error.numel() must be a positive multiple of 8 * W = {8 * w}, got {n}")
    check_row_bytes("bits", bits, n // (8 * w))
    if error_out.numel() != n:
        raise ValueError(f"error_out must have error's {n} values, got {error_out.numel()}")
    if prev_bits.shape != bits.shape or (w > 1 and prev_bits.stride(0) != bits.stride(0)):
        raise ValueError(
            f"prev_bits must have the shape {tuple(bits.shape)} and row stride of bits, got "
            f"{tuple(prev_bits.shape)} with stride {tuple(prev_bits.stride())}"
        )
    if x.numel() > n:
        raise ValueError(f"x has {x.numel()} values but error only {n}; pad error to >= x.numel()")
    if not native.use_native():
        reference_worker_compress(
            x,
            error,
            bits,
            scale,
            update_error=update_error,
            deferred=deferred,
            error_out=error_out,
            pending=pending,
            prev_bits=prev_bits,
            prev_scale=prev_scale,
        )
        return
    if source is not None:
        if not deferred:  # not written here: the error updated by a second sweep, or left
            error_out, pending, prev_bits, prev_scale = None, False, bits, scale
        source.compress_as_read(error=error, bits=bits, scale=scale, error_out=error_out,
                                pending=pending, prev_bits=prev_bits, prev_scale=prev_scale)  # fmt: skip
        if update_error and not deferred:
            source.update_error_as_read(error=error, scale=scale, error_out=error, rows=w)
        return
    if not deferred:  # the error updated by a second sweep, or left
        error_out, pending = None, False
    prev_bits, prev_scale = (prev_bits, prev_scale) if pending else (None, None)
    native.launch("worker_compress", device, x=x, error=error, error_out=error_out, bits=bits,
                  prev_bits=prev_bits, prev_scale=prev_scale, pending=pending, scale=scale)  # fmt: skip
    if update_error and error_out is None:
        native.launch("worker_update_error", device, x=x, error=error, out=error, scale=scale)


def worker_update_error(
    x: torch.Tensor | ExchangeSource,
    error: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    rows: int = 1,
) -> float | None:
    """The second half of ``worker_compress(..., update_error=False)``:
    ``out <- y - scale * sign(y)`` with ``y = x + error`` (``x`` and ``error`` unchanged since).

    ``out`` defaults to ``error`` (in place); another buffer of the same size keeps ``error`` as
    it was (the exchange's double buffering, for steps that may still be dropped). ``x`` may be
    an [`ExchangeSource`][lightning_onebit.kernels.sources.ExchangeSource] (its inputs unchanged
    since the compression): its values are recomputed as read where
    [`updated_as_read`][lightning_onebit.kernels.sources.ExchangeSource.updated_as_read], the same
    floats as from a buffer of them, else materialized first.

    Args:
        x, error, scale: the compression's input, error buffer and scale.
        out: where the updated error goes (default ``error``).
        rows: the compression's ``bits.size(0)`` (``W``), for the recomputed values' scale.

    Returns:
        For recomputed values, their scale, summed as the compression summed it: equal to
        ``scale`` unless the source's inputs changed since the compression (then the update
        is not the compression's, and the caller must not keep it). ``None`` otherwise.
    """
    out = error if out is None else out
    source = None
    if isinstance(x, ExchangeSource):
        source, x = (x, x.like()) if x.updated_as_read else (None, x.materialize())
    device, _ = native.check("worker_update_error", x=x, error=error, scale=scale, out=out)
    n = error.numel()
    if n == 0 or n % 8:
        raise ValueError(f"error.numel() must be a positive multiple of 8, got {n}")
    if out.numel() != n:
        raise ValueError(f"out must have error's {n} values, got {out.numel()}")
    if x.numel() > n:
        raise ValueError(f"x has {x.numel()} values but error only {n}; pad error to >= x.numel()")
    if source is not None:
        if rows < 1 or n % (8 * rows):
            raise ValueError(f"error.numel() must be a multiple of 8 * rows = {8 * rows}, got {n}")
        return source.update_error_as_read(error=error, scale=scale, error_out=out, rows=rows)
    if not native.use_native():
        reference_worker_update_error(x, error, scale, out)
        return None
    native.launch("worker_update_error", device, x=x, error=error, out=out, scale=scale)
    return None


def server_reduce(
    bits: torch.Tensor,
    scales: torch.Tensor,
    error: torch.Tensor,
    out_bits: torch.Tensor,
    out_scale: torch.Tensor,
    pending: bool = False,
    *,
    error_out: torch.Tensor | None = None,
    prev_bits: torch.Tensor | None = None,
    prev_scale: torch.Tensor | None = None,
    write_error: bool = True,
) -> None:
    """Average ``W`` compressed chunks and recompress with error feedback (the server side).

    ``c = sum_i sign_i * (scales[i] / W)`` (summed over rows in order) ``+ e``;
    ``out_scale = ||c||_2 / sqrt(m)``; ``out_bits`` receives the packed signs of ``c``.

    The error update ``e <- c - out_scale * sign(c)`` is *deferred* to save a second sweep
    over the buffer: afterwards ``error_out`` (default: ``error``) holds ``c``, and the true error
    is ``c - out_scale * sign(out_bits)``. Pass ``pending=True`` on the next call with that
    call's outputs as ``prev_bits``/``prev_scale`` (default: ``out_bits``/``out_scale``, still
    holding them when the same buffers are reused) and the kernel applies the deferred update on
    the fly; or call [`finish_pending`][lightning_onebit.kernels.reference.finish_pending] to apply
    it explicitly. Separate output buffers leave the inputs as they were (double buffering: a call
    that may still be dropped).

    Args:
        bits: uint8 ``(W, m // 8)``, one compressed chunk per row (rows may be strided).
        scales: float32 ``(W,)``, the rows' scales (may be strided).
        error: float32, contiguous, ``m`` values (``m % 8 == 0``).
        out_bits: uint8, contiguous, ``m // 8`` bytes.
        out_scale: float32 with one element.
        pending: whether ``error`` still awaits the previous call's deferred update.
        error_out: float32, contiguous, ``m`` values; default ``error`` (in place).
        prev_bits: uint8, contiguous, ``m // 8`` bytes; default ``out_bits``.
        prev_scale: float32 with one element; default ``out_scale``.
        write_error: ``False``: write the outputs only, not ``c`` (``error_out`` is left as it
            was): a call whose error update waits until it is known to go ahead, when the same
            call with ``write_error=True`` (its outputs bitwise the same) stores it. CPU only.
    """
    error_out = error if error_out is None else error_out
    prev_bits = out_bits if prev_bits is None else prev_bits
    prev_scale = out_scale if prev_scale is None else prev_scale
    device, _ = native.check("server_reduce", bits=bits, scales=scales, error=error,
                             error_out=error_out, out_bits=out_bits, prev_bits=prev_bits,
                             out_scale=out_scale, prev_scale=prev_scale)  # fmt: skip
    m = error.numel()
    if m == 0 or m % 8:
        raise ValueError(f"error.numel() must be a positive multiple of 8, got {m}")
    if error_out.numel() != m:
        raise ValueError(f"error_out must have error's {m} values, got {error_out.numel()}")
    check_row_bytes("bits", bits, m // 8)
    for name, t in (("out_bits", out_bits), ("prev_bits", prev_bits)):
        if t.numel() != m // 8:
            raise ValueError(f"{name} must hold m // 8 = {m // 8} bytes, got {t.numel()}")
    if not write_error and device.type != "cpu":
        raise ValueError(f"server_reduce(write_error=False) runs on the CPU, not {device}")
    if not native.use_native():
        reference_server_reduce(
            bits,
            scales,
            error,
            out_bits,
            out_scale,
            pending,
            error_out=error_out if write_error else None,
            prev_bits=prev_bits,
            prev_scale=prev_scale,
            write_error=write_error,
        )
        return
    native.launch("server_reduce", device, bits=bits, scales=scales, error=error,
                  error_out=error_out if write_error else None, prev_bits=prev_bits,
                  prev_scale=prev_scale if pending else None, out_bits=out_bits,
                  out_scale=out_scale, pending=bool(pending))  # fmt: skip


def decompress(bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """Decode ``W`` chunks of ``m`` values: ``out[j*m + k] = scales[j] * sign(bit k of row j)``.

    Args:
        bits: uint8 ``(W, m // 8)`` (rows may be strided).
        scales: float32 ``(W,)`` (may be strided).
        out: float32, contiguous, at most ``W * m`` values; values beyond ``out.numel()``
            (the padding) are dropped.
    """
    device, _ = native.check("decompress", bits=bits, scales=scales, out=out)
    w, m = bits.size(0), bits.size(1) * 8
    if out.numel() > w * m:
        raise ValueError(f"out has {out.numel()} values but bits encode only W * m = {w * m}")
    if out.numel() == 0:
        return None
    if not native.use_native():
        return reference_decompress(bits, scales, out)
    native.launch("decompress", device, bits=bits, scales=scales, m=m, out=out)
    return None


def decode_runs(runs: SignRuns, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode an exchange's result where it lies into a buffer: `decompress` of each run.

    Args:
        runs: the [SignRuns][lightning_onebit.kernels.SignRuns] to decode.
        out: flat float32, indexed like the runs, at least ``runs.hi`` values; ``None``: a new
            buffer of zeros of ``runs.hi`` values.

    Returns:
        ``out``, the runs' values written (the values outside them unchanged).
    """
    out = torch.zeros(runs.hi) if out is None else out
    for lo, hi, bits, scale in runs.runs:
        decompress(bits.view(1, -1), torch.tensor([scale]), out[lo:hi])
    return out
