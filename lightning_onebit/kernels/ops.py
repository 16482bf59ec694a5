"""The fused kernels' public functions: check the arguments (:mod:`.checks`), then run the
compiled CPU or CUDA kernel (:mod:`.native`), or the pure-torch twin (:mod:`.reference`) where
none applies."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch

from lightning_onebit.kernels import native
from lightning_onebit.kernels.checks import (
    check_contiguous,
    check_device,
    check_params_fit,
    check_rows,
    check_scale,
    check_scales,
    check_tensor,
    check_verdict,
)
from lightning_onebit.kernels.reference import (
    reference_adam_update,
    reference_decompress,
    reference_frozen_adam_update,
    reference_lamb_frozen_update,
    reference_layer_step,
    reference_local_source,
    reference_local_step,
    reference_momentum_source,
    reference_restore_unless,
    reference_server_reduce,
    reference_sync_update,
    reference_worker_compress,
    reference_worker_update_error,
)

__all__ = [
    "ExchangeSource",
    "LocalSource",
    "MomentumSource",
    "SignRuns",
    "adam_update",
    "decompress",
    "frozen_adam_update",
    "lamb_frozen_update",
    "layer_step",
    "local_source",
    "local_step",
    "momentum_source",
    "restore_unless",
    "server_reduce",
    "sync_update",
    "worker_compress",
    "worker_update_error",
]


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
    - ``update_error=False``: ``error`` is left as it was, and :func:`worker_update_error`
      (same ``x``, ``error``, ``scale``) applies the update later: the exchange first learns
      whether every rank's scale is finite, so that a skipped step changes nothing.
    - ``deferred=True``: one sweep. ``error_out`` (default: ``error``) receives ``y``, and the
      true error is ``error_out - scale * sign(bits)``: pass ``pending=True`` to the next call
      with this call's ``bits`` and ``scale`` as ``prev_bits``/``prev_scale`` (defaults:
      ``bits``/``scale``, still holding them when the same buffers are reused) and it applies
      the update as it reads ``error``; or apply it with :func:`finish_pending`, as
      :func:`server_reduce`'s. A separate ``error_out`` (and ``bits``) leaves the inputs as
      they were (double buffering: a call that may still be dropped).

    ``x`` may be an :class:`ExchangeSource` (:class:`MomentumSource`, :class:`LocalSource`):
    the deferred form computes its values as it reads them where it can
    (:attr:`ExchangeSource.computed_as_read`), the same floats as from the buffer; otherwise it
    materializes them first.

    Args:
        x: float32, contiguous, at most ``n`` values (any shape); or an
            :class:`ExchangeSource`.
        error: float32, contiguous, ``n`` values, ``n`` a multiple of ``8 * W``.
        bits: uint8 ``(W, n // (8 * W))``, rows contiguous (may be strided views).
        scale: float32 with one element; receives the scale (on the tensors' device).
        update_error: update the error in this call (``False``: leave it to
            :func:`worker_update_error`).
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
        if deferred and x.computed_as_read:  # (x: its geometry, for the checks; not read)
            source, x = x, x.out[x.lo : x.hi]
        else:
            x = x.materialize()
    error_out = error if error_out is None else error_out
    prev_bits = bits if prev_bits is None else prev_bits
    prev_scale = scale if prev_scale is None else prev_scale
    for name, t, dt in (
        ("x", x, torch.float32),
        ("error", error, torch.float32),
        ("error_out", error_out, torch.float32),
        ("bits", bits, torch.uint8),
        ("prev_bits", prev_bits, torch.uint8),
    ):
        check_tensor(name, t, dt)
    check_scale("scale", scale)
    check_scale("prev_scale", prev_scale)
    device = check_device(
        ("x", x),
        ("error", error),
        ("error_out", error_out),
        ("bits", bits),
        ("prev_bits", prev_bits),
        ("scale", scale),
        ("prev_scale", prev_scale),
    )
    for name, t in (("x", x), ("error", error), ("error_out", error_out)):
        check_contiguous(name, t)
    n, w = error.numel(), bits.size(0) if bits.dim() == 2 else 0
    check_rows("bits", bits)
    if n == 0 or n % (8 * w):
        raise ValueError(f"error.numel() must be a positive multiple of 8 * W = {8 * w}, got {n}")
    check_rows("bits", bits, n // (8 * w))
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
        source._compress_as_read((error, bits, scale, error_out), pending, (prev_bits, prev_scale))
        return
    if deferred:
        native.worker_compress(x, error, bits, scale, error_out, pending, prev_bits, prev_scale)
        return
    native.worker_compress(x, error, bits, scale)
    if update_error:
        native.update_error(x, error, scale, device)


def worker_update_error(
    x: torch.Tensor, error: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None
) -> None:
    """The second half of ``worker_compress(..., update_error=False)``:
    ``out <- y - scale * sign(y)`` with ``y = x + error`` (``x`` and ``error`` unchanged since).

    ``out`` defaults to ``error`` (in place); another buffer of the same size keeps ``error`` as
    it was (the exchange's double buffering, for steps that may still be dropped).
    """
    check_tensor("x", x, torch.float32)
    check_tensor("error", error, torch.float32)
    check_scale("scale", scale)
    out = error if out is None else out
    check_tensor("out", out, torch.float32)
    device = check_device(("x", x), ("error", error), ("scale", scale), ("out", out))
    check_contiguous("x", x)
    check_contiguous("error", error)
    check_contiguous("out", out)
    n = error.numel()
    if n == 0 or n % 8:
        raise ValueError(f"error.numel() must be a positive multiple of 8, got {n}")
    if out.numel() != n:
        raise ValueError(f"out must have error's {n} values, got {out.numel()}")
    if x.numel() > n:
        raise ValueError(f"x has {x.numel()} values but error only {n}; pad error to >= x.numel()")
    if not native.use_native():
        reference_worker_update_error(x, error, scale, out)
        return
    native.update_error(x, error, scale, device, out)


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
) -> None:
    """Average ``W`` compressed chunks and recompress with error feedback (the server side).

    ``c = sum_i sign_i * (scales[i] / W)`` (summed over rows in order) ``+ e``;
    ``out_scale = ||c||_2 / sqrt(m)``; ``out_bits`` receives the packed signs of ``c``.

    The error update ``e <- c - out_scale * sign(c)`` is *deferred* to save a second sweep
    over the buffer: afterwards ``error_out`` (default: ``error``) holds ``c``, and the true error
    is ``c - out_scale * sign(out_bits)``. Pass ``pending=True`` on the next call with that
    call's outputs as ``prev_bits``/``prev_scale`` (default: ``out_bits``/``out_scale``, still
    holding them when the same buffers are reused) and the kernel applies the deferred update on
    the fly; or call :func:`finish_pending` to apply it explicitly. Separate output buffers
    leave the inputs as they were (double buffering: a call that may still be dropped).

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
    """
    error_out = error if error_out is None else error_out
    prev_bits = out_bits if prev_bits is None else prev_bits
    prev_scale = out_scale if prev_scale is None else prev_scale
    check_tensor("bits", bits, torch.uint8)
    check_tensor("error", error, torch.float32)
    check_tensor("error_out", error_out, torch.float32)
    check_tensor("out_bits", out_bits, torch.uint8)
    check_tensor("prev_bits", prev_bits, torch.uint8)
    check_scale("out_scale", out_scale)
    check_scale("prev_scale", prev_scale)
    check_rows("bits", bits)
    w = bits.size(0)
    check_scales("scales", scales, w)
    check_device(
        ("bits", bits),
        ("scales", scales),
        ("error", error),
        ("error_out", error_out),
        ("out_bits", out_bits),
        ("prev_bits", prev_bits),
        ("out_scale", out_scale),
        ("prev_scale", prev_scale),
    )
    for name, t in (
        ("error", error),
        ("error_out", error_out),
        ("out_bits", out_bits),
        ("prev_bits", prev_bits),
    ):
        check_contiguous(name, t)
    m = error.numel()
    if m == 0 or m % 8:
        raise ValueError(f"error.numel() must be a positive multiple of 8, got {m}")
    if error_out.numel() != m:
        raise ValueError(f"error_out must have error's {m} values, got {error_out.numel()}")
    check_rows("bits", bits, m // 8)
    for name, t in (("out_bits", out_bits), ("prev_bits", prev_bits)):
        if t.numel() != m // 8:
            raise ValueError(f"{name} must hold m // 8 = {m // 8} bytes, got {t.numel()}")
    if not native.use_native():
        reference_server_reduce(
            bits,
            scales,
            error,
            out_bits,
            out_scale,
            pending,
            error_out=error_out,
            prev_bits=prev_bits,
            prev_scale=prev_scale,
        )
        return
    native.server_reduce(
        bits, scales, error, error_out, out_bits, out_scale, pending, prev_bits, prev_scale
    )


def decompress(bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """Decode ``W`` chunks of ``m`` values: ``out[j*m + k] = scales[j] * sign(bit k of row j)``.

    Args:
        bits: uint8 ``(W, m // 8)`` (rows may be strided).
        scales: float32 ``(W,)`` (may be strided).
        out: float32, contiguous, at most ``W * m`` values; values beyond ``out.numel()``
            (the padding) are dropped.
    """
    check_tensor("bits", bits, torch.uint8)
    check_tensor("out", out, torch.float32)
    check_rows("bits", bits)
    w = bits.size(0)
    check_scales("scales", scales, w)
    check_device(("bits", bits), ("scales", scales), ("out", out))
    check_contiguous("out", out)
    m = bits.size(1) * 8
    if out.numel() > w * m:
        raise ValueError(f"out has {out.numel()} values but bits encode only W * m = {w * m}")
    if out.numel() == 0:
        return None
    if not native.use_native():
        return reference_decompress(bits, scales, out)
    native.decompress(bits, scales, out)
    return None


class SignRuns:
    """An exchange's result where it lies, in place of the decoded buffer (:func:`decompress`):
    run ``(lo, hi, bits, scale)`` holds the flat values ``lo:hi``, value ``lo + k`` being
    ``+scale`` where bit ``k`` of ``bits`` is set and ``-scale`` where not (the wire format's
    numbering). :func:`frozen_adam_update`, :func:`lamb_frozen_update` and :func:`sync_update`
    read it directly with the compiled CPU kernels, so the values are never written out and
    read back (8 bytes per value); elsewhere they decode it first (:meth:`decode`), the same
    floats. The runs' bits are views of the exchange's records: valid until its next call.

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

    def decode(self, out: torch.Tensor) -> torch.Tensor:
        """Write the values into ``out`` (flat float32, indexed like the runs); return it."""
        for lo, hi, bits, scale in self.runs:
            decompress(bits.view(1, -1), torch.tensor([scale]), out[lo:hi])
        return out

    def _decoded(self, like: torch.Tensor) -> torch.Tensor:
        """The values decoded into a new buffer of ``like``'s size (zeros outside the runs)."""
        return self.decode(torch.zeros_like(like))


def _check_runs(runs: SignRuns, ranges: list[tuple[int, int]], device: torch.device) -> None:
    if device.type != "cpu":
        raise ValueError(f"SignRuns are read on the CPU, got buffers on {device}")
    for lo, hi in ranges:
        if not runs.covers(lo, hi):
            raise ValueError(
                f"the SignRuns hold the values [{runs.lo}, {runs.hi}), the update reads [{lo}, {hi})"
            )


def lamb_frozen_update(
    exchanged: torch.Tensor | SignRuns,
    exp_avg: torch.Tensor,
    denom: torch.Tensor,
    exp_avg_sq_fresh: torch.Tensor,
    param: torch.Tensor | Sequence[torch.Tensor] | None,
    update: torch.Tensor,
    offsets: list[int],
    scaling: list[float],
    beta1: list[float],
    beta2: list[float],
    eps: list[float],
    weight_decay: list[float],
    preconditioned: bool = False,
    ok: torch.Tensor | None = None,
) -> torch.Tensor:
    """1-bit LAMB's compression-phase update after the exchange: one sweep over flat buffers.

    Layer ``k`` holds the values ``offsets[k]:offsets[k + 1]``; per value, with that layer's
    hyperparameters (``x = exchanged``, ``m = exp_avg``, ``d = denom = sqrt(v) + eps`` of the
    frozen variance, ``v_fresh = exp_avg_sq_fresh``, ``p = param``, ``u = update``)::

        m_new = x / scaling                     # the exchanged momentum, unscaled
                                                # (preconditioned: (x * d) / scaling)
        g = (m_new - beta1 * m) / (1 - beta1)   # gradient reconstructed from two momenta
        v_fresh <- beta2 * v_fresh + (1 - beta2) * g**2
        u_prelim = m_new / d
        u <- u_prelim + weight_decay * p;  m <- m_new

    Returns float64 ``(L, 3)`` on the buffers' device: per layer ``max(d / (sqrt(v_fresh) + eps))``,
    ``||u_prelim||**2`` and ``||u||**2`` (``1, 0, 0`` for an empty layer). The torch version of
    this is ~13 sweeps over the buffers; the C++ kernel is one (reads 4-5 buffers, writes 3).
    On CUDA tensors the CUDA kernel runs on the current stream (no host synchronisation; the
    statistics stay on the device): it writes the CPU kernel's floats bit for bit and the same
    ratios; the two sums of squares (float64) differ from the CPU's in their last bits (another
    summation order, within about ``(n_k - 1) * 2**-53`` relative for a layer of ``n_k`` values).
    Without CUDA kernels in the build, CUDA tensors take the pure-torch path
    (:func:`reference_lamb_frozen_update`).

    Args:
        exchanged, exp_avg, denom, exp_avg_sq_fresh, update: float32, contiguous, one device,
            at least ``offsets[-1]`` values each; ``exchanged`` may be :class:`SignRuns`
            holding every layer's values (CPU buffers).
        param: like them (a flat buffer), or one float32 contiguous tensor per layer of its
            ``offsets[k + 1] - offsets[k]`` values (any shape) on their device: each layer's
            parameter where it lies, read by both kernels from its own pointer, so that
            nothing copies the parameters into a flat buffer first; ``None`` when every
            ``weight_decay`` is 0.
        offsets: ``L + 1`` non-decreasing offsets.
        scaling, beta1, beta2, eps, weight_decay: ``L`` values each (``0 <= beta < 1``).
        preconditioned: ``x`` was exchanged divided by ``d``: the call scales it back first,
            ``x * d`` rounded to float32, the floats of ``exchanged.mul_(denom)`` before the
            call. The CPU kernel does it as it reads ``x`` (``exchanged`` unchanged, one sweep
            less); elsewhere ``exchanged`` is multiplied in place first.
        ok: ``None``, or a one-element bool tensor on the buffers' device (an exchange's
            verdict, see :class:`~lightning_onebit.comm.CompressedAllreduce`): when it is
            false the call writes ``u = 0`` and statistics ``1, 0, 0`` and leaves ``m`` and
            ``v_fresh`` as they were, so ``p - lr * coeff * u`` leaves ``p`` as it was. On CUDA
            the kernel reads it on the device (no host synchronisation); elsewhere it is read
            on the host.
    """
    runs = exchanged if isinstance(exchanged, SignRuns) else None
    named = [
        ("exp_avg", exp_avg),
        ("denom", denom),
        ("exp_avg_sq_fresh", exp_avg_sq_fresh),
        ("update", update),
    ]
    if runs is None:
        named.insert(0, ("exchanged", exchanged))
    if isinstance(param, torch.Tensor):
        named.append(("param", param))
    for name, t in named:
        check_tensor(name, t, torch.float32)
        check_contiguous(name, t)
    device = check_device(*named, need_cuda_kernels=False)
    n_layers = len(offsets) - 1
    if n_layers < 0 or any(b < a for a, b in itertools.pairwise(offsets)):
        raise ValueError("offsets must be L + 1 non-decreasing values")
    if offsets and offsets[0] < 0:
        raise ValueError(f"offsets must be >= 0, got {offsets[0]}")
    for name, t in named:
        if offsets and t.numel() < offsets[-1]:
            raise ValueError(f"{name} has {t.numel()} values, the layers need {offsets[-1]}")
    hp = {"scaling": scaling, "beta1": beta1, "beta2": beta2, "eps": eps}
    for name, vals in (*hp.items(), ("weight_decay", weight_decay)):
        if len(vals) != n_layers:
            raise ValueError(f"{name} must have one value per layer ({n_layers}), got {len(vals)}")
    if param is None and any(w != 0 for w in weight_decay):
        raise ValueError("param is required when a weight_decay is non-zero")
    starts, sizes = offsets[:-1], [b - a for a, b in itertools.pairwise(offsets)]
    params = None if param is None else _segment_tensors("param", param, starts, sizes, device)
    if ok is not None:
        check_verdict(ok, device)
    if runs is not None:
        _check_runs(runs, [(offsets[0], offsets[-1])] if offsets else [], device)
        if not native.use_native():
            exchanged = runs._decoded(exp_avg)
    on_gpu = device.type == "cuda" and native.HAS_CUDA and native.use_native()
    if ok is not None and not on_gpu and not bool(ok):  # (a host read: free off the GPU)
        update[: offsets[-1] if offsets else 0].zero_()
        stats = torch.zeros(n_layers, 3, dtype=torch.float64, device=device)
        stats[:, 0] = 1.0
        return stats
    fold = device.type == "cpu" and native.use_native()
    if preconditioned and not fold:  # (the CPU kernel scales x back as it reads it)
        n = offsets[-1] if offsets else 0
        exchanged[:n].mul_(denom[:n])
    if not native.use_native() or (device.type == "cuda" and not native.HAS_CUDA):
        return reference_lamb_frozen_update(
            exchanged,
            exp_avg,
            denom,
            exp_avg_sq_fresh,
            params,
            update,
            offsets,
            **hp,
            weight_decay=weight_decay,
        )
    ob1, ob2 = [1 - b for b in beta1], [1 - b for b in beta2]  # in double, then rounded
    coefs = [scaling, beta1, ob1, beta2, ob2, eps, weight_decay]
    tensors = (exchanged, exp_avg, denom, exp_avg_sq_fresh, params, update)
    if device.type == "cuda":
        return native.lamb_frozen_update_cuda(tensors, offsets, coefs, ok)
    return native.lamb_frozen_update_cpu(tensors, offsets, coefs, preconditioned, runs)


def adam_update(
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    params: list[torch.Tensor],
    starts: list[int],
    lr: list[float],
    beta1: list[float],
    beta2: list[float],
    eps: list[float],
    weight_decay: list[float],
    update_variance: bool = True,
    ok: torch.Tensor | None = None,
) -> None:
    """Adam's step without bias correction, moments and parameters in one sweep.

    Parameter ``j`` holds the flat values ``starts[j]:starts[j] + params[j].numel()`` of
    ``grad`` (``g``), ``exp_avg`` (``m``) and ``exp_avg_sq`` (``v``); per value, with its
    hyperparameters::

        m <- beta1 * m + (1 - beta1) * g
        v <- beta2 * v + (1 - beta2) * g**2          (only if update_variance)
        p <- p - lr * (m / (sqrt(v) + eps) + weight_decay * p)

    This is 1-bit Adam's warmup step and 0/1 Adam's variance-phase step. In torch it is ~17
    sweeps over the buffers (reading or writing one each); the C++ kernel reads 4 and writes 3.
    On CUDA tensors the CUDA kernel runs on the current stream (no host synchronisation) and
    writes the CPU kernel's values bit for bit. Calls with a parameter that is not an fp32,
    contiguous tensor take the pure-torch path (:func:`reference_adam_update`) on either device,
    as do CUDA tensors when the build has no CUDA kernels.

    Args:
        grad, exp_avg, exp_avg_sq: float32, contiguous, one device, covering every parameter.
        params: the parameters, updated in place (any float dtype).
        starts: each parameter's first flat index.
        lr, beta1, beta2, eps, weight_decay: one value per parameter.
        ok: ``None``, or a one-element bool tensor on the buffers' device (a step's NaN/Inf
            verdict): when it is false nothing is written. The CUDA kernel reads it on the
            device; CUDA tensors on the pure-torch path compute the step aside and keep it
            with ``torch.where`` (no host synchronisation either); on the CPU it is read on
            the host.
    """
    named = [("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    for name, t in named:
        check_tensor(name, t, torch.float32)
        check_contiguous(name, t)
    device = grad.device
    for name, t in named[1:]:
        if t.device != device:
            raise ValueError(
                f"all tensors must be on one device: grad is on {device}, {name} on {t.device}"
            )
    n = len(params)
    hp = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay}
    for name, vals in (("starts", starts), *hp.items()):
        if len(vals) != n:
            raise ValueError(f"{name} must have one value per parameter ({n}), got {len(vals)}")
    check_params_fit(params, starts, min(t.numel() for _, t in named), device)
    fast = (device.type == "cpu" or (device.type == "cuda" and native.HAS_CUDA)) and all(
        p.dtype == torch.float32 and p.is_contiguous() for p in params
    )
    if ok is not None:
        check_verdict(ok, device)
        if device.type != "cuda":  # (a host read: free off the GPU)
            if not bool(ok):
                return
            ok = None
        elif (
            not fast or not native.use_native()
        ):  # the torch path: the step aside, then kept or not
            m, v, ps = exp_avg.clone(), exp_avg_sq.clone(), [p.clone() for p in params]
            reference_adam_update(grad, m, v, ps, starts, **hp, update_variance=update_variance)
            torch.where(ok, m, exp_avg, out=exp_avg)
            torch.where(ok, v, exp_avg_sq, out=exp_avg_sq)
            for p, q in zip(params, ps, strict=True):
                p.copy_(torch.where(ok, q, p))
            return
    if not fast or not native.use_native():
        reference_adam_update(grad, exp_avg, exp_avg_sq, params, starts, **hp,
                              update_variance=update_variance)  # fmt: skip
        return
    if device.type == "cuda":
        native.adam_update_cuda(grad, exp_avg, exp_avg_sq, params, starts, hp, update_variance, ok)
    else:
        native.adam_update_cpu(grad, exp_avg, exp_avg_sq, params, starts, hp, update_variance)
    # written through raw pointers: tell autograd, as an in-place torch op would (a graph that
    # saved a parameter then fails loudly in backward instead of using the new values).
    # One tensor per call: torch < 2.4 takes no list.
    for p in params:
        torch.autograd.graph.increment_version(p)


def _has_kernel(device: torch.device) -> bool:
    """Whether the compiled module has a kernel for ``device``: the CPU, or CUDA in a build
    with CUDA kernels."""
    return device.type == "cpu" or (device.type == "cuda" and native.HAS_CUDA)


def _check_segments(
    named: list[tuple[str, torch.Tensor | None]],
    starts: list[int],
    per_segment: dict[str, Sequence[float]],
) -> None:
    """Raise ``ValueError`` unless every list of ``per_segment`` has one value per segment and
    each segment ``[starts[k], starts[k] + sizes[k])`` fits every tensor of ``named``."""
    n = len(starts)
    for name, vals in per_segment.items():
        if len(vals) != n:
            raise ValueError(f"{name} must have one value per segment ({n}), got {len(vals)}")
    limit = min(t.numel() for _, t in named if t is not None)
    for lo, size in zip(starts, per_segment["sizes"], strict=True):
        if lo < 0 or size < 0 or lo + size > limit:
            raise ValueError(f"segment [{lo}, {lo + size}) does not fit buffers of {limit} values")


def momentum_source(
    exp_avg: torch.Tensor,
    grad: torch.Tensor | Sequence[torch.Tensor | None],
    denom: torch.Tensor | None,
    out: torch.Tensor,
    starts: list[int],
    sizes: list[int],
    beta: list[float],
    alpha: list[float],
) -> None:
    """The momentum a compressed exchange sends, one sweep over flat buffers (``exp_avg``
    itself unchanged). Segment ``k`` holds the values ``starts[k]:starts[k] + sizes[k]``; per
    value, with its coefficients::

        out = beta * exp_avg + alpha * grad         (as torch.mul(m, beta).add_(g, alpha=alpha))
        out = out / denom                           (only where denom is given)

    The gradient is a flat buffer indexed like the others, or one tensor per segment: each
    parameter's ``.grad`` where autograd left it, so that nothing copies the gradients into a
    flat buffer first (the kernel reads each segment's from its own pointer; both forms are the
    same call). A segment given ``None`` reads zeros, with the floats a buffer of zeros gives.

    One sweep (reads 2-3 buffers, writes one) where the torch ops make three, writing torch's
    floats for that sequence bit for bit on the same device: on the CPU the C++ kernel (torch's
    CPU ``add`` with ``alpha`` is a fused multiply-add on x86, which the kernel does too), on
    CUDA the CUDA kernel on the current stream (no host synchronisation), with the roundings of
    torch's CUDA kernels. Without a compiled kernel for the device (no compiled module, a build
    without CUDA kernels, another device type) the torch ops themselves run
    (:func:`reference_momentum_source`).

    Args:
        exp_avg, out: float32, contiguous, one device, covering every segment.
        grad: like them (a flat buffer), or a sequence with one entry per segment: ``None``
            (zeros) or a float32 contiguous tensor of ``sizes[k]`` values (any shape) on their
            device.
        denom: like ``exp_avg``, or ``None`` (no division).
        starts, sizes: each segment's first flat index and number of values.
        beta, alpha: one value per segment (rounded to float32).

    Raises:
        TypeError, ValueError: a tensor of another dtype, not contiguous, on another device,
            a segment that does not fit or a per-segment gradient of another size; lists of
            other lengths.
    """
    grads = _check_momentum_source((exp_avg, grad, denom, out, starts, sizes, beta, alpha))
    _run_momentum_source((exp_avg, grads, denom, out, starts, sizes, beta, alpha))


def _run_momentum_source(args: tuple) -> None:
    """:func:`momentum_source` on checked arguments ``args`` (in its order, the gradient one
    entry per segment): the compiled kernel of the device, or the torch ops."""
    exp_avg, grads, denom, out, starts, sizes, beta, alpha = args
    device = exp_avg.device
    if not _has_kernel(device) or not native.use_native():
        reference_momentum_source(*args)
        return
    if device.type == "cuda":
        native.momentum_source_cuda((exp_avg, grads, denom, out), starts, sizes, (beta, alpha))
    else:
        native.momentum_source_cpu((exp_avg, grads, denom, out), starts, sizes, (beta, alpha))


def _check_momentum_source(args: tuple) -> list[torch.Tensor | None]:
    """:func:`momentum_source`'s checks of its arguments ``args``, in order; returns the
    gradient as one entry per segment."""
    exp_avg, grad, denom, out, starts, sizes, beta, alpha = args
    named = [("exp_avg", exp_avg), ("out", out)]
    if isinstance(grad, torch.Tensor):
        named.append(("grad", grad))
    if denom is not None:
        named.append(("denom", denom))
    for name, t in named:
        check_tensor(name, t, torch.float32)
        check_contiguous(name, t)
    device = check_device(*named, need_cuda_kernels=False)
    _check_segments(named, starts, {"sizes": sizes, "beta": beta, "alpha": alpha})
    return _segment_tensors("grad", grad, starts, sizes, device, missing=True)


class ExchangeSource:
    """Values of the flat range ``[lo, hi)`` that a source kernel would write to ``out``, not
    computed yet: the input of an exchange call (:func:`worker_compress`), for segments that
    tile the range in order (an exchange's bucket: whole parameters). Subclasses:
    :class:`MomentumSource`, :class:`LocalSource`.

    Where a compiled kernel applies (:attr:`computed_as_read`), :func:`worker_compress`
    computes each value as it compresses it: the same floats, bits and scale, without writing
    ``out`` and reading it back (two of the four fp32 sweeps of source and compression).
    Elsewhere :meth:`materialize` runs the source kernel into ``out`` first. The inputs are
    read when the values are computed.
    """

    out: torch.Tensor
    starts: list[int]
    sizes: list[int]
    lo: int
    hi: int

    def _tile(self) -> None:
        """Set :attr:`lo` and :attr:`hi`; raise ``ValueError`` unless the segments tile a
        non-empty range in order."""
        ends = list(itertools.accumulate(self.sizes, initial=self.starts[0] if self.starts else 0))
        if not self.starts or list(self.starts) != ends[:-1] or ends[-1] == ends[0]:
            raise ValueError(
                f"a {type(self).__name__}'s segments must tile a non-empty flat range in order, "
                f"got starts {self.starts} and sizes {self.sizes}"
            )
        self.lo, self.hi = ends[0], ends[-1]

    @property
    def device(self) -> torch.device:
        return self.out.device

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self.hi - self.lo])

    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def computed_as_read(self) -> bool:
        """Whether :func:`worker_compress` (``deferred=True``) computes the values as it reads
        them: the compiled module's kernels, on the CPU and (in a build with CUDA kernels) on
        CUDA; the pure-torch path materializes."""
        return _has_kernel(self.device) and native.use_native()

    def materialize(self) -> torch.Tensor:
        """Run the source kernel into ``out`` (arguments checked at construction); return
        ``out[lo:hi]``."""
        raise NotImplementedError

    def _compress_as_read(
        self,
        compress: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        pending: bool,
        prev: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """The compiled deferred compression of these values (``compress``: error, bits,
        scale, error_out; ``prev``: prev_bits, prev_scale), checked by :func:`worker_compress`."""
        raise NotImplementedError


@dataclasses.dataclass(eq=False)
class MomentumSource(ExchangeSource):
    """:func:`momentum_source`'s values as an :class:`ExchangeSource`. The arguments are
    :func:`momentum_source`'s, checked here.

    Raises:
        TypeError, ValueError: as :func:`momentum_source`; segments that do not tile a
            non-empty range in order.
    """

    exp_avg: torch.Tensor
    grad: torch.Tensor | Sequence[torch.Tensor | None]
    denom: torch.Tensor | None
    out: torch.Tensor
    starts: list[int]
    sizes: list[int]
    beta: list[float]
    alpha: list[float]

    def __post_init__(self) -> None:
        args = (self.exp_avg, self.grad, self.denom, self.out, self.starts, self.sizes)
        self.grad = _check_momentum_source((*args, self.beta, self.alpha))
        self._tile()

    def materialize(self) -> torch.Tensor:
        """Run :func:`momentum_source` into ``out`` (arguments checked at construction);
        return ``out[lo:hi]``."""
        args = (self.exp_avg, self.grad, self.denom, self.out, self.starts, self.sizes)
        _run_momentum_source((*args, self.beta, self.alpha))
        return self.out[self.lo : self.hi]

    def _compress_as_read(
        self,
        compress: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        pending: bool,
        prev: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        args = (self.exp_avg, self.grad, self.denom, self.starts, self.sizes)
        cuda = self.device.type == "cuda"
        native.momentum_compress(args, (self.beta, self.alpha), compress, pending, prev, cuda)


def _segment_tensors(
    name: str,
    t: torch.Tensor | Sequence[torch.Tensor | None],
    starts: list[int],
    sizes: list[int],
    device: torch.device,
    missing: bool = False,
) -> list[torch.Tensor | None]:
    """``t`` as one entry per segment: a flat buffer's slices ``starts[k]:starts[k] +
    sizes[k]`` (the buffer checked by the caller), or the sequence itself, checked here.

    Raises:
        TypeError, ValueError: unless the sequence has one entry per segment, each a float32
            contiguous tensor of its segment's size on ``device`` (or, where ``missing``,
            ``None``).
    """
    if isinstance(t, torch.Tensor):
        return [t[lo : lo + n] for lo, n in zip(starts, sizes, strict=True)]
    pieces = list(t)
    if len(pieces) != len(sizes):
        what = "one tensor (or None)" if missing else "one tensor"
        raise ValueError(f"{name} must have {what} per segment ({len(sizes)}), got {len(pieces)}")
    for k, (x, n) in enumerate(zip(pieces, sizes, strict=True)):
        if x is None:
            if missing:
                continue
            raise TypeError(f"{name}[{k}] is None: give a tensor for every segment")
        check_tensor(f"{name}[{k}]", x, torch.float32)
        check_contiguous(f"{name}[{k}]", x)
        if x.device != device:
            raise ValueError(f"{name}[{k}] is on {x.device}, the buffers on {device}")
        if x.numel() != n:
            raise ValueError(f"{name}[{k}] must have its segment's {n} values, got {x.numel()}")
    return pieces


def frozen_adam_update(
    ok: torch.Tensor | None,
    exchanged: torch.Tensor | SignRuns,
    exp_avg: torch.Tensor,
    denom: torch.Tensor,
    params: list[torch.Tensor],
    starts: list[int],
    lr: list[float],
    weight_decay: list[float],
    preconditioned: bool,
) -> None:
    """1-bit Adam's compression-phase step after the exchange, written only if ``ok``.

    Parameter ``j`` holds the flat values ``starts[j]:starts[j] + params[j].numel()`` of
    ``exchanged`` (``x``, the exchange's result), ``exp_avg`` (``m``) and ``denom``
    (``d = sqrt(v) + eps`` of the frozen variance); per value::

        m <- x * d,  dir = x          (preconditioned: x is m / d)
        m <- x,      dir = x / d      (otherwise)
        p <- p - lr * weight_decay * p;   p <- p - lr * dir

    ``ok`` is a one-element bool tensor on the buffers' device (the exchange's verdict): when
    it is false nothing is written; ``None`` is always true. On CUDA, given ``ok``, with fp32
    contiguous parameters one fused kernel reads it on the device (no host synchronisation);
    its floats equal the torch path's within the last bit (each operation rounded on its own;
    torch's own kernels may fuse a multiply and an add). On the CPU (``ok`` read on the host) with fp32
    contiguous parameters the C++ kernel makes the one sweep (reads 3 buffers, writes 2, where
    the torch ops make four sweeps) and writes the floats of the torch ops
    (``decoupled_update_``'s ``add_`` with ``alpha`` and ``addcdiv_``, after ``m = x * d``)
    bit for bit. Otherwise torch ops compute the step, aside with a verdict (kept with
    ``torch.where``, without a host read).
    """
    runs = exchanged if isinstance(exchanged, SignRuns) else None
    named = [("exp_avg", exp_avg), ("denom", denom)]
    if runs is None:
        named.insert(0, ("exchanged", exchanged))
    for name, t in named:
        check_tensor(name, t, torch.float32)
        check_contiguous(name, t)
    device = check_device(*named, need_cuda_kernels=False)
    if ok is not None:
        check_verdict(ok, device)
    n = len(params)
    for name, vals in (("starts", starts), ("lr", lr), ("weight_decay", weight_decay)):
        if len(vals) != n:
            raise ValueError(f"{name} must have one value per parameter ({n}), got {len(vals)}")
    check_params_fit(params, starts, min(t.numel() for _, t in named), device)
    if runs is not None:
        _check_runs(runs, [(a, a + p.numel()) for a, p in zip(starts, params, strict=True)], device)
    if device.type == "cpu" and ok is not None:  # (a host read: free off the GPU)
        if not bool(ok):
            return
        ok = None
    kernel = device.type == "cpu" or (device.type == "cuda" and native.HAS_CUDA and ok is not None)
    if (
        kernel
        and native.use_native()
        and all(p.dtype == torch.float32 and p.is_contiguous() for p in params)
    ):
        hp = (lr, weight_decay, preconditioned)
        if device.type == "cpu":
            native.frozen_adam_update_cpu((exchanged, exp_avg, denom), params, starts, hp, runs)
        else:
            native.frozen_adam_update_cuda(ok, (exchanged, exp_avg, denom), params, starts, hp)
        for p in params:  # (written through raw pointers: see adam_update)
            torch.autograd.graph.increment_version(p)
        return
    if runs is not None:
        exchanged = runs._decoded(exp_avg)
    reference_frozen_adam_update(
        ok, exchanged, exp_avg, denom, params, starts, lr, weight_decay, preconditioned
    )


def layer_step(
    update: torch.Tensor, params: list[torch.Tensor], starts: list[int], alpha: torch.Tensor
) -> None:
    """``p_j += alpha[j] * u_j`` for every parameter ``j``, ``u_j`` its values
    ``update[starts[j] : starts[j] + p_j.numel()]``: 1-bit LAMB's per-layer step on a GPU,
    ``alpha[j] = -lr_j * coeff_j`` computed on the device.

    On CUDA with fp32 contiguous parameters one kernel steps every parameter, where torch
    launches one per parameter, and writes the floats of ``p.addcmul_(u_j, alpha[j])``
    (:func:`reference_layer_step`; on CUDA one fused multiply-add per value) bit for bit.
    Elsewhere those torch ops run.

    Args:
        update: float32, contiguous.
        params: the parameters, on ``update``'s device.
        starts: per parameter, the offset of its values in ``update``.
        alpha: float32, contiguous, one value per parameter, on ``update``'s device (never read
            on the host: no synchronisation).

    Raises:
        TypeError, ValueError: on a wrong dtype, device, size or layout.
    """
    check_tensor("update", update, torch.float32)
    check_tensor("alpha", alpha, torch.float32)
    check_contiguous("update", update)
    check_contiguous("alpha", alpha)
    device = check_device(("update", update), ("alpha", alpha), need_cuda_kernels=False)
    n = len(params)
    if len(starts) != n or alpha.numel() != n:
        raise ValueError(
            f"starts and alpha must have one value per parameter ({n}), got {len(starts)} and "
            f"{alpha.numel()}"
        )
    check_params_fit(params, starts, update.numel(), device)
    if (
        device.type == "cuda"
        and native.HAS_CUDA
        and native.use_native()
        and all(p.dtype == torch.float32 and p.is_contiguous() for p in params)
    ):
        native.layer_step_cuda(update, params, starts, alpha)
        for p in params:  # (written through raw pointers: see adam_update)
            torch.autograd.graph.increment_version(p)
        return
    reference_layer_step(update, params, starts, alpha)


def local_source(
    tensors: tuple[torch.Tensor, torch.Tensor | Sequence[torch.Tensor | None], torch.Tensor],
    param: torch.Tensor | Sequence[torch.Tensor] | None,
    acc: torch.Tensor | None,
    out: torch.Tensor,
    starts: list[int],
    sizes: list[int],
    hp: tuple[list[float], list[float], list[float], list[float]],
    preconditioned: bool,
) -> None:
    """0/1 Adam's exchange source on a sync step of its local phase, one sweep over flat
    buffers (no input changes). ``tensors``: ``exp_avg``, ``grad``, ``denom``
    (``sqrt(v) + eps``); segment ``k`` holds the values ``starts[k]:starts[k] + sizes[k]``
    and has the coefficients ``hp`` (``beta``, ``alpha``, ``lr``, ``weight_decay``, one
    value per segment). Per value, as the optimizer's torch ops::

        x = beta * exp_avg + alpha * grad           (torch.mul(m, beta).add_(g, alpha=alpha))
        preconditioned: x = x / denom + weight_decay * param
        otherwise:      x = x + weight_decay * param * denom        (addcmul_)
        x = -lr * x
        preconditioned: out = x + acc;  otherwise: out = x + acc * denom  (addcmul_)

    The gradient is a flat buffer or one tensor per segment (``None``: zeros), as
    :func:`momentum_source`'s, and so is ``param``, without ``None`` entries (each parameter
    where it lies; ``param=None``: no decay terms). The decay term is taken where ``param`` is
    given and ``weight_decay > 0``, the accumulator's where ``acc`` is given. One sweep (reads 3-5
    buffers, writes one) where the torch ops make five or more, writing torch's floats bit for
    bit on the same device: on the CPU the C++ kernel (torch's CPU ``add`` with ``alpha`` and
    ``addcmul_`` are fused multiply-adds on x86, which the kernel does too), on CUDA the CUDA
    kernel on the current stream (no host synchronisation), with the roundings of torch's CUDA
    kernels (its ``addcmul_`` rounds ``param * denom`` before the fused multiply-add with
    ``weight_decay``). Both kernels read each segment's gradient and parameter from its own
    pointer: nothing is copied into a flat buffer first. Without a compiled kernel
    for the device the torch ops themselves run (:func:`reference_local_source`).

    Raises:
        TypeError, ValueError: a tensor of another dtype, not contiguous, on another device,
            a segment that does not fit or a per-segment gradient or parameter of another
            size; coefficient lists of other lengths.
    """
    args = (tensors, param, acc, out, starts, sizes, hp, preconditioned)
    grads, params = _check_local_source(args)
    _run_local_source(((tensors[0], grads, tensors[2]), params, *args[2:]))


def _check_local_source(
    args: tuple,
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None] | None]:
    """:func:`local_source`'s checks of its arguments ``args``, in order; returns the gradient
    and the parameter (or ``None``) as one entry per segment."""
    (exp_avg, grad, denom), param, acc, out, starts, sizes, hp, _ = args
    named = [("exp_avg", exp_avg), ("denom", denom), ("out", out)]
    for name, t in (("grad", grad), ("param", param), ("acc", acc)):
        if isinstance(t, torch.Tensor) or (name == "acc" and t is not None):
            named.append((name, t))
    for name, t in named:
        check_tensor(name, t, torch.float32)
        check_contiguous(name, t)
    device = check_device(*named, need_cuda_kernels=False)
    names = ("sizes", "beta", "alpha", "lr", "weight_decay")
    _check_segments(named, starts, dict(zip(names, (sizes, *hp), strict=True)))
    grads = _segment_tensors("grad", grad, starts, sizes, device, missing=True)
    params = None if param is None else _segment_tensors("param", param, starts, sizes, device)
    return grads, params


def _run_local_source(args: tuple) -> None:
    """:func:`local_source` on checked arguments ``args`` (in its order, the gradient and the
    parameter one entry per segment): the compiled kernel of the device, or the torch ops."""
    (exp_avg, _, _), params, acc, out, starts, sizes, hp, preconditioned = args
    device = exp_avg.device
    if not _has_kernel(device) or not native.use_native():
        reference_local_source(*args)
        return
    run = native.local_source_cuda if device.type == "cuda" else native.local_source_cpu
    run(args[0], params, acc, out, (starts, sizes), hp, preconditioned)


@dataclasses.dataclass(eq=False)
class LocalSource(ExchangeSource):
    """:func:`local_source`'s values as an :class:`ExchangeSource`. The arguments are
    :func:`local_source`'s, checked here.

    Raises:
        TypeError, ValueError: as :func:`local_source`; segments that do not tile a non-empty
            range in order.
    """

    tensors: tuple[torch.Tensor, torch.Tensor | Sequence[torch.Tensor | None], torch.Tensor]
    param: torch.Tensor | Sequence[torch.Tensor] | None
    acc: torch.Tensor | None
    out: torch.Tensor
    starts: list[int]
    sizes: list[int]
    hp: tuple[list[float], list[float], list[float], list[float]]
    preconditioned: bool

    def __post_init__(self) -> None:
        grads, self.param = _check_local_source(self._args())
        self.tensors = (self.tensors[0], grads, self.tensors[2])
        self._tile()

    def _args(self) -> tuple:
        return (
            self.tensors,
            self.param,
            self.acc,
            self.out,
            self.starts,
            self.sizes,
            self.hp,
            self.preconditioned,
        )

    def materialize(self) -> torch.Tensor:
        """Run :func:`local_source` into ``out`` (arguments checked at construction); return
        ``out[lo:hi]``."""
        _run_local_source(self._args())
        return self.out[self.lo : self.hi]

    def _compress_as_read(
        self,
        compress: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        pending: bool,
        prev: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        native.local_compress(
            self.tensors,
            self.param,
            self.acc,
            (self.starts, self.sizes),
            (self.hp, self.preconditioned),
            compress,
            pending,
            prev,
            self.device.type == "cuda",
        )


def local_step(
    tensors: tuple[
        torch.Tensor, torch.Tensor | Sequence[torch.Tensor | None], torch.Tensor, torch.Tensor
    ],
    params: list[torch.Tensor],
    starts: list[int],
    hp: tuple[list[float], list[float], list[float], list[float]],
) -> bool:
    """0/1 Adam's local step (no exchange) in one sweep, taken only if every gradient value is
    finite; returns whether it was (nothing changes otherwise: the rank sits the step out).
    ``tensors``: ``exp_avg``, ``grad``, ``denom`` (``sqrt(v) + eps``) and ``acc`` (the
    momentum accumulator); parameter ``j`` holds the flat values
    ``starts[j]:starts[j] + params[j].numel()`` and has the coefficients ``hp`` (``beta``,
    ``alpha``, ``lr``, ``weight_decay``, one value per parameter). Per value, as the
    optimizer's torch ops::

        exp_avg = beta * exp_avg + alpha * grad       (mul_(beta).add_(g, alpha=alpha))
        u = exp_avg / denom + weight_decay * p        (the decay only where weight_decay > 0)
        acc = acc - lr * u;  p = p - lr * u

    The gradient is a flat buffer or one tensor per parameter (``None``: zeros), as
    :func:`momentum_source`'s. On the CPU, with fp32 contiguous parameters, the C++ kernel
    checks the gradients, then makes the one sweep (reads 5 buffers, writes 3, where the torch
    ops make five sweeps and a copy of the parameters) with the torch ops' floats bit for bit;
    otherwise the torch ops run (:func:`reference_local_step`).

    Raises:
        TypeError, ValueError: a tensor of another dtype, not contiguous, on another device, a
            parameter that does not fit or a gradient of another size; coefficient lists of
            other lengths.
    """
    exp_avg, grad, denom, acc = tensors
    named = [("exp_avg", exp_avg), ("denom", denom), ("acc", acc)]
    if isinstance(grad, torch.Tensor):
        named.append(("grad", grad))
    for name, t in named:
        check_tensor(name, t, torch.float32)
        check_contiguous(name, t)
    device = check_device(*named, need_cuda_kernels=False)
    sizes = [p.numel() for p in params]
    names = ("sizes", "beta", "alpha", "lr", "weight_decay")
    _check_segments(named, starts, dict(zip(names, (sizes, *hp), strict=True)))
    check_params_fit(params, starts, min(t.numel() for _, t in named), device)
    grads = _segment_tensors("grad", grad, starts, sizes, device, missing=True)
    if (
        device.type != "cpu"
        or not native.use_native()
        or not all(p.dtype == torch.float32 and p.is_contiguous() for p in params)
    ):
        return reference_local_step((exp_avg, grads, denom, acc), params, starts, hp)
    if not native.local_step_cpu((exp_avg, grads, denom, acc), params, starts, hp):
        return False
    for p in params:  # (written through raw pointers: see adam_update)
        torch.autograd.graph.increment_version(p)
    return True


def sync_update(
    tensors: tuple[torch.Tensor | SignRuns, torch.Tensor, torch.Tensor, torch.Tensor],
    floored: torch.Tensor | None,
    acc: torch.Tensor | None,
    params: list[torch.Tensor],
    starts: list[int],
    lrs: list[float],
    preconditioned: bool,
) -> None:
    """0/1 Adam's update after a sync step's exchange, one sweep over flat buffers.
    ``tensors``: ``exchanged`` (the averaged accumulator; read only; or :class:`SignRuns`
    holding every parameter's values, CPU buffers), ``denom``
    (``sqrt(v) + eps``), ``exp_avg`` and ``synced`` (the synchronised parameters, fp32);
    parameter ``j``'s values start at ``starts[j]``, ``lrs[j]`` is the learning rate summed
    since the last sync. Per value, as the optimizer's torch ops::

        exp_avg = (exchanged * denom if preconditioned else exchanged) / -lrs
                  (0 where lrs <= 0, or floored is true: masked_fill_)
        synced += exchanged if preconditioned else exchanged / denom     (add_, addcdiv_)
        p = synced;  acc = 0  (where acc is given)

    One sweep where the torch ops make five or more, writing torch's floats bit for bit on the
    same device: on the CPU the C++ kernel, on CUDA the CUDA kernel on the current stream (no
    host synchronisation), with the roundings of torch's CUDA kernels (its division by ``-lrs``
    is a multiplication by the reciprocal, taken in double and rounded to float). The kernel
    writes the parameters itself when every one is fp32 and contiguous, else they are copied
    from ``synced`` after it (cast to their dtype). Without a compiled kernel for the device
    the torch ops run (:func:`reference_sync_update`).

    Raises:
        TypeError, ValueError: a tensor of another dtype, not contiguous, on another device,
            or a parameter that does not fit; ``lrs`` of another length.
    """
    names = ("exchanged", "denom", "exp_avg", "synced")
    named = list(zip(names, tensors, strict=True))
    runs = tensors[0] if isinstance(tensors[0], SignRuns) else None
    if runs is not None:
        named = named[1:]
    if acc is not None:
        named.append(("acc", acc))
    for name, t in named:
        check_tensor(name, t, torch.float32)
        check_contiguous(name, t)
    if floored is not None:
        check_tensor("floored", floored, torch.bool)
        check_contiguous("floored", floored)
        named.append(("floored", floored))
    device = check_device(*named, need_cuda_kernels=False)
    if len(starts) != len(params) or len(lrs) != len(params):
        raise ValueError(f"starts and lrs must have one value per parameter ({len(params)})")
    check_params_fit(params, starts, min(t.numel() for _, t in named), device)
    if runs is not None:
        _check_runs(runs, [(a, a + p.numel()) for a, p in zip(starts, params, strict=True)], device)
    if not _has_kernel(device) or not native.use_native():
        if runs is not None:
            tensors = (runs._decoded(tensors[2]), *tensors[1:])
        reference_sync_update(tensors, floored, acc, params, starts, lrs, preconditioned)
        return
    direct = all(p.dtype == torch.float32 and p.is_contiguous() for p in params)
    hp = (lrs, preconditioned, direct)
    if device.type == "cuda":
        native.sync_update_cuda(tensors, floored, acc, params, starts, hp)
    else:
        native.sync_update_cpu(tensors, floored, acc, params, starts, hp, runs)
    if direct:
        for p in params:  # (written through raw pointers: see adam_update)
            torch.autograd.graph.increment_version(p)
    else:
        synced = tensors[3]
        torch._foreach_copy_(
            params,
            [synced[lo : lo + p.numel()].view_as(p) for p, lo in zip(params, starts, strict=True)],
        )


def restore_unless(ok: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst <- src`` only if ``ok`` (a one-element bool tensor) is false: puts an exchange's
    double-buffered state back after a call whose verdict was non-finite. On CUDA one launch
    that reads ``ok`` on the device and does nothing when it is true (no host synchronisation);
    elsewhere ``ok`` is read on the host."""
    if dst.dtype != src.dtype or dst.numel() != src.numel() or dst.device != src.device:
        raise ValueError("dst and src must have the same dtype, size and device")
    check_contiguous("dst", dst)
    check_contiguous("src", src)
    check_verdict(ok, dst.device)
    if dst.device.type == "cuda" and native.HAS_CUDA:
        native.restore_unless_cuda(ok, dst, src)
    else:
        reference_restore_unless(ok, dst, src)
