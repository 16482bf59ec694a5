"""Python face of the fused 1-bit kernels (``lightning_onebit._C``).

Every public function validates its arguments (dtype, device, sizes, contiguity) and raises a
``TypeError``/``ValueError`` that says what to pass instead, then dispatches to the C++ (CPU)
or CUDA kernel. The C++ side trusts these checks: it receives raw pointers.

The ``reference_*`` functions are a pure-torch implementation with identical semantics. The
tests compare the kernels against them, and they are the fallback when the compiled module is
missing (with a warning: that path is several times slower, the math is the same).

Wire format (shared by CPU and CUDA, so ranks on different hardware interoperate): a chunk of
``m`` values (``m % 8 == 0``) packs into ``m // 8`` bytes; value ``k`` is bit ``k % 8`` of byte
``k // 8``, least-significant bit first (``numpy.packbits(bitorder="little")``). The bit is 1
iff the value is ``>= 0``: +0.0 and -0.0 both encode +1, NaN encodes -1. ``W`` chunks are the
rows of a ``(W, m // 8)`` uint8 tensor whose rows may be strided (views into larger records).
"""

from __future__ import annotations

import itertools
import math
import warnings

import torch

__all__ = [
    "HAS_CPP",
    "HAS_CUDA",
    "adam_update",
    "decompress",
    "finish_pending",
    "lamb_frozen_update",
    "reference_adam_update",
    "reference_decompress",
    "reference_lamb_frozen_update",
    "reference_server_reduce",
    "reference_worker_compress",
    "reference_worker_update_error",
    "server_reduce",
    "worker_compress",
    "worker_update_error",
]

try:
    from lightning_onebit import _C
except ImportError as _err:  # pragma: no cover - exercised only on broken installs
    _C = None
    _IMPORT_ERROR: ImportError | None = _err
else:
    _IMPORT_ERROR = None

HAS_CPP: bool = _C is not None
HAS_CUDA: bool = bool(_C is not None and _C.has_cuda)

_fallback_warned = False


# --------------------------------------------------------------------------- validation


def _check_tensor(name: str, t: object, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(
            f"{name} must have dtype {dtype}, got {t.dtype} (convert with .to({dtype}))"
        )
    if t.is_sparse or t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    return t


def _check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


def _check_rows(name: str, bits: torch.Tensor, row_bytes: int | None = None) -> None:
    """A (W, m/8) uint8 tensor whose rows are contiguous and do not overlap."""
    if bits.dim() != 2:
        raise ValueError(f"{name} must be 2-D (W, m // 8), got shape {tuple(bits.shape)}")
    if bits.size(0) < 1 or bits.size(1) < 1:
        raise ValueError(f"{name} must have at least one row and one byte, got {tuple(bits.shape)}")
    if row_bytes is not None and bits.size(1) != row_bytes:
        raise ValueError(f"{name} rows must hold {row_bytes} bytes, got {bits.size(1)}")
    if bits.stride(1) != 1 and bits.size(1) > 1:
        raise ValueError(
            f"{name} rows must be contiguous (stride(1) == 1), got strides {bits.stride()}"
        )
    if bits.size(0) > 1 and bits.stride(0) < bits.size(1):
        raise ValueError(
            f"{name} rows overlap: stride(0)={bits.stride(0)} < row length {bits.size(1)}"
        )


def _check_device(*named: tuple[str, torch.Tensor], need_cuda_kernels: bool = True) -> torch.device:
    device = named[0][1].device
    for name, t in named[1:]:
        if t.device != device:
            raise ValueError(
                f"all tensors must be on one device: {named[0][0]} is on {device}, {name} on {t.device}"
            )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"only cpu and cuda tensors are supported, got device {device}")
    if device.type == "cuda" and not HAS_CUDA and need_cuda_kernels:
        raise RuntimeError(
            "lightning_onebit was built without CUDA kernels; reinstall with a CUDA compiler on PATH "
            "(ONEBIT_CUDA=ON pip install lightning-onebit) or keep the buffers on the CPU"
        )
    return device


def _check_scale(name: str, scale: torch.Tensor) -> None:
    _check_tensor(name, scale, torch.float32)
    if scale.numel() != 1:
        raise ValueError(f"{name} must have exactly one element, got {scale.numel()}")


def _check_scales(name: str, scales: torch.Tensor, w: int) -> None:
    _check_tensor(name, scales, torch.float32)
    if scales.dim() != 1 or scales.numel() != w:
        raise ValueError(
            f"{name} must be 1-D with one scale per row ({w}), got shape {tuple(scales.shape)}"
        )


def _check_verdict(ok: object, device: torch.device) -> None:
    if not isinstance(ok, torch.Tensor) or ok.dtype != torch.bool or ok.numel() != 1:
        raise TypeError("ok must be a one-element bool tensor (an exchange's verdict)")
    if ok.device != device:
        raise ValueError(f"ok is on {ok.device}, the buffers on {device}")


def _check_params_fit(
    params: list[torch.Tensor], starts: list[int], n_flat: int, device: torch.device
) -> None:
    """Parameter ``j`` is on ``device`` and its values fit the flat buffers at ``starts[j]``."""
    for j, (p, lo) in enumerate(zip(params, starts, strict=True)):
        if p.device != device:
            raise ValueError(f"params[{j}] is on {p.device}, the buffers on {device}")
        if lo < 0 or lo + p.numel() > n_flat:
            raise ValueError(
                f"params[{j}] ({p.numel()} values from {lo}) does not fit the flat buffers "
                f"({n_flat} values)"
            )


def _param_table(
    params: list[torch.Tensor], starts: list[int], device: torch.device
) -> tuple[torch.Tensor, int] | None:
    """The CUDA parameter updates' table on ``device``: the parameters' pointers, starts, sizes
    and chunk table (``P`` values each, ``P + 1`` for the chunks), and the number of chunks;
    ``None`` when there are no values to update."""
    sizes = [p.numel() for p in params]
    chunk_start = _chunk_starts(sizes)
    if chunk_start[-1] == 0:
        return None
    meta = _on_device(
        [*(p.data_ptr() for p in params), *starts, *sizes, *chunk_start], torch.int64, device
    )
    return meta, chunk_start[-1]


def _use_cpp() -> bool:
    global _fallback_warned
    if HAS_CPP:
        return True
    if not _fallback_warned:
        warnings.warn(
            f"lightning_onebit._C failed to import ({_IMPORT_ERROR}); using the pure-torch kernels "
            "(same results, several times slower). Reinstall the package to build the extension.",
            RuntimeWarning,
            stacklevel=3,
        )
        _fallback_warned = True
    return False


def _nthreads() -> int:
    return max(1, torch.get_num_threads())


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host array (hyperparameters, offsets, pointers) in ``device``'s memory for one call,
    copied on the device's current stream, which the call's kernel runs on, without a host
    synchronisation: from pinned memory, which torch's caching host allocator keeps until the
    copy has run (a copy from pageable memory may synchronise). The result comes from the
    caching allocator on that stream, so it is reused only after the kernel has read it."""
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _chunk_starts(sizes: list[int]) -> list[int]:
    """The CUDA optimizer updates' chunk table (``cpp/onebit.h``): parameter (layer) ``j`` owns
    chunks ``out[j]:out[j + 1]`` of ``_C.cuda_update_chunk()`` values; ``out[-1]`` chunks in all."""
    chunk = _C.cuda_update_chunk()
    return list(itertools.accumulate((-(-s // chunk) for s in sizes), initial=0))


def _workspace(device: torch.device) -> torch.Tensor:
    """Scratch for one CUDA call's partial sums, never shared: two exchanges in flight (buckets,
    param groups, threads) each get their own. From torch's caching allocator on the current
    stream, which the call's kernels run on, so it is reused only after they have read it."""
    return torch.empty(_C.cuda_workspace_bytes(), dtype=torch.uint8, device=device)


# --------------------------------------------------------------------------- kernels


def worker_compress(
    x: torch.Tensor,
    error: torch.Tensor,
    bits: torch.Tensor,
    scale: torch.Tensor,
    *,
    update_error: bool = True,
) -> None:
    """Error-compensated 1-bit compression of ``x`` (the worker side of the exchange).

    With ``n = error.numel()`` and ``W = bits.size(0)``: ``y = x + error`` (``x`` is read as
    zero beyond its ``x.numel() <= n`` values), ``scale = ||y||_2 / sqrt(n)``, row ``j`` of
    ``bits`` receives the packed signs of ``y[j*n/W : (j+1)*n/W]``, and
    ``error <- y - scale * sign(y)``.

    With ``update_error=False`` the error is left as it was, and :func:`worker_update_error`
    (same ``x``, ``error``, ``scale``) applies the update later: the exchange first learns
    whether every rank's scale is finite, so a skipped step changes nothing. Both ways cost the
    same memory traffic (the update pass recomputes ``y`` instead of storing it).

    Args:
        x: float32, contiguous, at most ``n`` values (any shape).
        error: float32, contiguous, ``n`` values, ``n`` a multiple of ``8 * W``.
        bits: uint8 ``(W, n // (8 * W))``, rows contiguous (may be strided views).
        scale: float32 with one element; receives the scale (on the tensors' device).
        update_error: update ``error`` in place now.
    """
    for name, t, dt in (
        ("x", x, torch.float32),
        ("error", error, torch.float32),
        ("bits", bits, torch.uint8),
    ):
        _check_tensor(name, t, dt)
    _check_scale("scale", scale)
    device = _check_device(("x", x), ("error", error), ("bits", bits), ("scale", scale))
    _check_contiguous("x", x)
    _check_contiguous("error", error)
    n, w = error.numel(), bits.size(0) if bits.dim() == 2 else 0
    _check_rows("bits", bits)
    if n == 0 or n % (8 * w):
        raise ValueError(f"error.numel() must be a positive multiple of 8 * W = {8 * w}, got {n}")
    _check_rows("bits", bits, n // (8 * w))
    if x.numel() > n:
        raise ValueError(f"x has {x.numel()} values but error only {n}; pad error to >= x.numel()")
    if not _use_cpp():
        reference_worker_compress(x, error, bits, scale, update_error=update_error)
        return
    if device.type == "cuda":
        _C.worker_compress_cuda(
            device.index,
            x.data_ptr(),
            x.numel(),
            error.data_ptr(),
            n,
            bits.data_ptr(),
            w,
            bits.stride(0),
            scale.data_ptr(),
            _workspace(device).data_ptr(),
            _stream(device),
        )
    else:
        _C.worker_compress_cpu(
            x.data_ptr(),
            x.numel(),
            error.data_ptr(),
            n,
            bits.data_ptr(),
            w,
            bits.stride(0),
            scale.data_ptr(),
            _nthreads(),
        )
    if update_error:
        _update_error(x, error, scale, device)


def worker_update_error(
    x: torch.Tensor, error: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None
) -> None:
    """The deferred half of ``worker_compress(..., update_error=False)``:
    ``out <- y - scale * sign(y)`` with ``y = x + error`` (``x`` and ``error`` unchanged since).

    ``out`` defaults to ``error`` (in place); another buffer of the same size keeps ``error`` as
    it was (the exchange's double buffering, for steps that may still be dropped).
    """
    _check_tensor("x", x, torch.float32)
    _check_tensor("error", error, torch.float32)
    _check_scale("scale", scale)
    out = error if out is None else out
    _check_tensor("out", out, torch.float32)
    device = _check_device(("x", x), ("error", error), ("scale", scale), ("out", out))
    _check_contiguous("x", x)
    _check_contiguous("error", error)
    _check_contiguous("out", out)
    n = error.numel()
    if n == 0 or n % 8:
        raise ValueError(f"error.numel() must be a positive multiple of 8, got {n}")
    if out.numel() != n:
        raise ValueError(f"out must have error's {n} values, got {out.numel()}")
    if x.numel() > n:
        raise ValueError(f"x has {x.numel()} values but error only {n}; pad error to >= x.numel()")
    if not _use_cpp():
        reference_worker_update_error(x, error, scale, out)
        return
    _update_error(x, error, scale, device, out)


def _update_error(
    x: torch.Tensor,
    error: torch.Tensor,
    scale: torch.Tensor,
    device: torch.device,
    out: torch.Tensor | None = None,
) -> None:
    n, out = error.numel(), error if out is None else out
    if device.type == "cuda":
        _C.worker_update_error_cuda(
            device.index,
            x.data_ptr(),
            x.numel(),
            error.data_ptr(),
            out.data_ptr(),
            n,
            scale.data_ptr(),
            _stream(device),
        )
    else:
        _C.worker_update_error_cpu(
            x.data_ptr(), x.numel(), error.data_ptr(), out.data_ptr(), n, float(scale), _nthreads()
        )


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
    _check_tensor("bits", bits, torch.uint8)
    _check_tensor("error", error, torch.float32)
    _check_tensor("error_out", error_out, torch.float32)
    _check_tensor("out_bits", out_bits, torch.uint8)
    _check_tensor("prev_bits", prev_bits, torch.uint8)
    _check_scale("out_scale", out_scale)
    _check_scale("prev_scale", prev_scale)
    _check_rows("bits", bits)
    w = bits.size(0)
    _check_scales("scales", scales, w)
    device = _check_device(
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
        _check_contiguous(name, t)
    m = error.numel()
    if m == 0 or m % 8:
        raise ValueError(f"error.numel() must be a positive multiple of 8, got {m}")
    if error_out.numel() != m:
        raise ValueError(f"error_out must have error's {m} values, got {error_out.numel()}")
    _check_rows("bits", bits, m // 8)
    for name, t in (("out_bits", out_bits), ("prev_bits", prev_bits)):
        if t.numel() != m // 8:
            raise ValueError(f"{name} must hold m // 8 = {m // 8} bytes, got {t.numel()}")
    if not _use_cpp():
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
    head = (bits.data_ptr(), w, bits.stride(0), scales.data_ptr(), scales.stride(0))
    bufs = (error.data_ptr(), error_out.data_ptr(), m, prev_bits.data_ptr())
    tail = (out_bits.data_ptr(), out_scale.data_ptr(), bool(pending))
    if device.type == "cuda":
        _C.server_reduce_cuda(
            device.index,
            *head,
            *bufs,
            prev_scale.data_ptr(),
            *tail,
            _workspace(device).data_ptr(),
            _stream(device),
        )
    else:
        _C.server_reduce_cpu(
            *head, *bufs, float(prev_scale) if pending else 0.0, *tail, _nthreads()
        )


def finish_pending(error: torch.Tensor, out_bits: torch.Tensor, out_scale: torch.Tensor) -> None:
    """Apply a deferred server error update: ``error <- error - out_scale * sign(out_bits)``."""
    error.sub_(_sign_times(_unpack(out_bits.reshape(-1)), out_scale.reshape(())))


def decompress(bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """Decode ``W`` chunks of ``m`` values: ``out[j*m + k] = scales[j] * sign(bit k of row j)``.

    Args:
        bits: uint8 ``(W, m // 8)`` (rows may be strided).
        scales: float32 ``(W,)`` (may be strided).
        out: float32, contiguous, at most ``W * m`` values; values beyond ``out.numel()``
            (the padding) are dropped.
    """
    _check_tensor("bits", bits, torch.uint8)
    _check_tensor("out", out, torch.float32)
    _check_rows("bits", bits)
    w = bits.size(0)
    _check_scales("scales", scales, w)
    device = _check_device(("bits", bits), ("scales", scales), ("out", out))
    _check_contiguous("out", out)
    m = bits.size(1) * 8
    if out.numel() > w * m:
        raise ValueError(f"out has {out.numel()} values but bits encode only W * m = {w * m}")
    if out.numel() == 0:
        return None
    if not _use_cpp():
        return reference_decompress(bits, scales, out)
    if device.type == "cuda":
        _C.decompress_cuda(
            device.index,
            bits.data_ptr(),
            w,
            bits.stride(0),
            scales.data_ptr(),
            scales.stride(0),
            m,
            out.data_ptr(),
            out.numel(),
            _stream(device),
        )
    else:
        _C.decompress_cpu(
            bits.data_ptr(),
            w,
            bits.stride(0),
            scales.data_ptr(),
            scales.stride(0),
            m,
            out.data_ptr(),
            out.numel(),
            _nthreads(),
        )
    return None


def lamb_frozen_update(
    exchanged: torch.Tensor,
    exp_avg: torch.Tensor,
    denom: torch.Tensor,
    exp_avg_sq_fresh: torch.Tensor,
    param: torch.Tensor | None,
    update: torch.Tensor,
    offsets: list[int],
    scaling: list[float],
    beta1: list[float],
    beta2: list[float],
    eps: list[float],
    weight_decay: list[float],
    ok: torch.Tensor | None = None,
) -> torch.Tensor:
    """1-bit LAMB's compression-phase update after the exchange: one sweep over flat buffers.

    Layer ``k`` holds the values ``offsets[k]:offsets[k + 1]``; per value, with that layer's
    hyperparameters (``x = exchanged``, ``m = exp_avg``, ``d = denom = sqrt(v) + eps`` of the
    frozen variance, ``v_fresh = exp_avg_sq_fresh``, ``p = param``, ``u = update``)::

        m_new = x / scaling                     # the exchanged momentum, unscaled
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
            at least ``offsets[-1]`` values each.
        param: like them, or ``None`` when every ``weight_decay`` is 0.
        offsets: ``L + 1`` non-decreasing offsets.
        scaling, beta1, beta2, eps, weight_decay: ``L`` values each (``0 <= beta < 1``).
        ok: ``None``, or a one-element bool tensor on the buffers' device (an exchange's
            verdict, see :class:`~lightning_onebit.comm.CompressedAllreduce`): when it is
            false the call writes ``u = 0`` and statistics ``1, 0, 0`` and leaves ``m`` and
            ``v_fresh`` as they were, so ``p - lr * coeff * u`` leaves ``p`` as it was. On CUDA
            the kernel reads it on the device (no host synchronisation); elsewhere it is read
            on the host.
    """
    named = [
        ("exchanged", exchanged),
        ("exp_avg", exp_avg),
        ("denom", denom),
        ("exp_avg_sq_fresh", exp_avg_sq_fresh),
        ("update", update),
    ]
    if param is not None:
        named.append(("param", param))
    for name, t in named:
        _check_tensor(name, t, torch.float32)
        _check_contiguous(name, t)
    device = _check_device(*named, need_cuda_kernels=False)
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
    if ok is not None:
        _check_verdict(ok, device)
    on_gpu = device.type == "cuda" and HAS_CUDA and _use_cpp()
    if ok is not None and not on_gpu and not bool(ok):  # (a host read: free off the GPU)
        update[: offsets[-1] if offsets else 0].zero_()
        stats = torch.zeros(n_layers, 3, dtype=torch.float64, device=device)
        stats[:, 0] = 1.0
        return stats
    if not _use_cpp() or (device.type == "cuda" and not HAS_CUDA):
        return reference_lamb_frozen_update(
            exchanged,
            exp_avg,
            denom,
            exp_avg_sq_fresh,
            param,
            update,
            offsets,
            **hp,
            weight_decay=weight_decay,
        )
    ob1, ob2 = [1 - b for b in beta1], [1 - b for b in beta2]  # in double, then rounded
    if device.type == "cuda":
        tensors = (exchanged, exp_avg, denom, exp_avg_sq_fresh, param, update)
        coefs = [scaling, beta1, ob1, beta2, ob2, eps, weight_decay]
        return _lamb_frozen_update_cuda(tensors, offsets, coefs, ok)
    stats = torch.empty(n_layers, 3, dtype=torch.float64)
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    arrays = [
        torch.tensor(offsets, dtype=torch.int64),
        f32(scaling),
        f32(beta1),
        f32(ob1),
        f32(beta2),
        f32(ob2),
        f32(eps),
        f32(weight_decay),
    ]
    _C.lamb_frozen_update_cpu(
        exchanged.data_ptr(),
        exp_avg.data_ptr(),
        denom.data_ptr(),
        exp_avg_sq_fresh.data_ptr(),
        0 if param is None else param.data_ptr(),
        update.data_ptr(),
        n_layers,
        *(a.data_ptr() for a in arrays),
        stats.data_ptr(),
        _nthreads(),
    )
    return stats


# --------------------------------------------------------------------------- pure-torch reference

_BIT_WEIGHTS = {}


def _bit_weights(device: torch.device) -> torch.Tensor:
    w = _BIT_WEIGHTS.get(device)
    if w is None:
        w = _BIT_WEIGHTS[device] = (2 ** torch.arange(8, dtype=torch.int32, device=device)).to(
            torch.uint8
        )
    return w


def _pack(v: torch.Tensor) -> torch.Tensor:
    """(..., 8k) float -> (..., k) uint8, LSB first; bit = v >= 0."""
    b = (v >= 0).view(*v.shape[:-1], -1, 8).to(torch.uint8)
    return (b * _bit_weights(v.device)).sum(-1, dtype=torch.uint8)


def _unpack(bits: torch.Tensor) -> torch.Tensor:
    """(..., k) uint8 -> (..., 8k) bool."""
    b = bits.unsqueeze(-1).bitwise_and(_bit_weights(bits.device)).ne(0)
    return b.flatten(-2)


def _scale_of(v: torch.Tensor) -> torch.Tensor:
    # Same arithmetic as the kernels: sum of squares in float64, sqrt(sum)/sqrt(n), then float32.
    return (v.double().square().sum().sqrt() / math.sqrt(v.numel())).float()


def _sign_times(positive: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.where(positive, s, -s)


def reference_worker_compress(
    x: torch.Tensor,
    error: torch.Tensor,
    bits: torch.Tensor,
    scale: torch.Tensor,
    *,
    update_error: bool = True,
) -> None:
    """Pure-torch :func:`worker_compress` (same arguments, same results)."""
    e = error.view(-1)
    n, w = e.numel(), bits.size(0)
    y = e.clone()
    y[: x.numel()] += x.reshape(-1)
    s = _scale_of(y)
    bits.copy_(_pack(y.view(w, n // w)))
    scale.view(-1).copy_(s)
    if update_error:
        e.copy_(y - _sign_times(y >= 0, s))


def reference_worker_update_error(
    x: torch.Tensor, error: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None
) -> None:
    """Pure-torch :func:`worker_update_error` (same arguments, same results)."""
    y = error.reshape(-1).clone()
    y[: x.numel()] += x.reshape(-1)
    (error if out is None else out).view(-1).copy_(y - _sign_times(y >= 0, scale.reshape(())))


def reference_server_reduce(
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
    """Pure-torch :func:`server_reduce` (same arguments, same results)."""
    e = error.reshape(-1).clone()
    if pending:
        prev_bits = out_bits if prev_bits is None else prev_bits
        finish_pending(e, prev_bits, out_scale if prev_scale is None else prev_scale)
    w = bits.size(0)
    weights = scales.float() / w  # float32 division, as in the kernels
    positive = _unpack(bits)  # (W, m)
    c = torch.zeros(e.numel(), dtype=torch.float32, device=e.device)
    for i in range(w):  # row order matters for bitwise-identical floats
        c += _sign_times(positive[i], weights[i])
    c += e
    out_bits.view(-1).copy_(_pack(c))
    # the update c - s * sign(c) stays deferred, as in the kernels
    (error if error_out is None else error_out).view(-1).copy_(c)
    out_scale.view(-1).copy_(_scale_of(c))


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
        _check_tensor(name, t, torch.float32)
        _check_contiguous(name, t)
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
    _check_params_fit(params, starts, min(t.numel() for _, t in named), device)
    fast = (device.type == "cpu" or (device.type == "cuda" and HAS_CUDA)) and all(
        p.dtype == torch.float32 and p.is_contiguous() for p in params
    )
    if ok is not None:
        _check_verdict(ok, device)
        if device.type != "cuda":  # (a host read: free off the GPU)
            if not bool(ok):
                return
            ok = None
        elif not fast or not _use_cpp():  # the torch path: the step aside, then kept or not
            m, v, ps = exp_avg.clone(), exp_avg_sq.clone(), [p.clone() for p in params]
            reference_adam_update(grad, m, v, ps, starts, **hp, update_variance=update_variance)
            torch.where(ok, m, exp_avg, out=exp_avg)
            torch.where(ok, v, exp_avg_sq, out=exp_avg_sq)
            for p, q in zip(params, ps, strict=True):
                p.copy_(torch.where(ok, q, p))
            return
    if not fast or not _use_cpp():
        reference_adam_update(grad, exp_avg, exp_avg_sq, params, starts, **hp,
                              update_variance=update_variance)  # fmt: skip
        return
    if device.type == "cuda":
        _adam_update_cuda(grad, exp_avg, exp_avg_sq, params, starts, hp, update_variance, ok)
    else:
        _adam_update_cpu(grad, exp_avg, exp_avg_sq, params, starts, hp, update_variance)
    # written through raw pointers: tell autograd, as an in-place torch op would (a graph that
    # saved a parameter then fails loudly in backward instead of using the new values).
    # One tensor per call: torch < 2.4 takes no list.
    for p in params:
        torch.autograd.graph.increment_version(p)


def restore_unless(ok: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst <- src`` only if ``ok`` (a one-element bool tensor) is false: puts an exchange's
    double-buffered state back after a call whose verdict was non-finite. On CUDA one launch
    that reads ``ok`` on the device and does nothing when it is true (no host synchronisation);
    elsewhere ``ok`` is read on the host."""
    if dst.dtype != src.dtype or dst.numel() != src.numel() or dst.device != src.device:
        raise ValueError("dst and src must have the same dtype, size and device")
    _check_contiguous("dst", dst)
    _check_contiguous("src", src)
    _check_verdict(ok, dst.device)
    if dst.device.type == "cuda" and HAS_CUDA:
        _restore_unless_cuda(ok, dst, src)
    elif not bool(ok):
        dst.copy_(src)


def frozen_adam_update(
    ok: torch.Tensor,
    exchanged: torch.Tensor,
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
    it is false nothing is written. On CUDA with fp32 contiguous parameters one fused kernel
    reads it on the device (no host synchronisation); its floats equal the torch path's within
    the last bit (each operation rounded on its own; torch's own kernels may fuse a multiply and
    an add). Otherwise torch ops compute the step aside and ``torch.where`` keeps it or not,
    also without a host read; on the CPU their floats are those of the path without a verdict
    (``_decoupled_update_``), bit for bit.
    """
    named = [("exchanged", exchanged), ("exp_avg", exp_avg), ("denom", denom)]
    for name, t in named:
        _check_tensor(name, t, torch.float32)
        _check_contiguous(name, t)
    device = _check_device(*named, need_cuda_kernels=False)
    _check_verdict(ok, device)
    n = len(params)
    for name, vals in (("starts", starts), ("lr", lr), ("weight_decay", weight_decay)):
        if len(vals) != n:
            raise ValueError(f"{name} must have one value per parameter ({n}), got {len(vals)}")
    _check_params_fit(params, starts, min(t.numel() for _, t in named), device)
    fast = device.type == "cuda" and HAS_CUDA and _use_cpp()
    if fast and all(p.dtype == torch.float32 and p.is_contiguous() for p in params):
        hp = (lr, weight_decay, preconditioned)
        _frozen_adam_update_cuda(ok, (exchanged, exp_avg, denom), params, starts, hp)
        for p in params:  # (written through raw pointers: see adam_update)
            torch.autograd.graph.increment_version(p)
        return
    for p, lo, a, w in zip(params, starts, lr, weight_decay, strict=True):
        s = slice(lo, lo + p.numel())
        m_new = torch.mul(exchanged[s], denom[s]) if preconditioned else exchanged[s]
        torch.where(ok, m_new, exp_avg[s], out=exp_avg[s])
        x = exchanged[s].view_as(p)
        q = p.clone()
        if w > 0:
            q.add_(q, alpha=-a * w)
        if preconditioned:
            q.add_(x, alpha=-a)
        else:
            q.addcdiv_(x, denom[s].view_as(p), value=-a)
        p.copy_(torch.where(ok, q, p))


def _restore_unless_cuda(ok: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
    nbytes = dst.numel() * dst.element_size()
    _C.restore_unless_cuda(
        dst.device.index, ok.data_ptr(), dst.data_ptr(), src.data_ptr(), nbytes, _stream(dst.device)
    )


def _frozen_adam_update_cuda(
    ok: torch.Tensor,
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    params: list[torch.Tensor],
    starts: list[int],
    hp: tuple[list[float], list[float], bool],
) -> None:
    """:func:`frozen_adam_update` on CUDA tensors (``tensors``: exchanged, exp_avg, denom;
    ``hp``: lr, weight_decay, preconditioned): the kernel on the current stream."""
    (exchanged, exp_avg, denom), (lr, weight_decay, preconditioned) = tensors, hp
    n, device = len(params), exchanged.device
    table = _param_table(params, starts, device)
    if table is None:
        return  # no values to update
    meta, nchunks = table
    # -lr and -lr * wd in double, then rounded: the alphas the torch path passes
    nlw = [-a * w for a, w in zip(lr, weight_decay, strict=True)]
    coef = _on_device([[-a for a in lr], nlw], torch.float32, device)
    _C.frozen_adam_update_cuda(
        device.index,
        ok.data_ptr(),
        exchanged.data_ptr(),
        exp_avg.data_ptr(),
        denom.data_ptr(),
        meta.data_ptr(),  # the parameters' pointers
        n,
        *(meta[k * n :].data_ptr() for k in range(1, 4)),  # starts, sizes, chunk_start
        nchunks,
        coef[0].data_ptr(),
        coef[1].data_ptr(),
        bool(preconditioned),
        _stream(device),
    )


def _lamb_frozen_update_cuda(
    tensors: tuple[torch.Tensor | None, ...],
    offsets: list[int],
    coefs: list[list[float]],
    ok: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`lamb_frozen_update` on CUDA tensors: the kernel on the current stream."""
    exchanged, exp_avg, denom, exp_avg_sq_fresh, param, update = tensors
    device, n_layers = exchanged.device, len(offsets) - 1
    stats = torch.empty(n_layers, 3, dtype=torch.float64, device=device)
    if n_layers == 0:
        return stats
    chunk_start = _chunk_starts([b - a for a, b in itertools.pairwise(offsets)])
    meta = _on_device([*offsets, *chunk_start], torch.int64, device)
    coef = _on_device(coefs, torch.float32, device)
    # the per-chunk partial sums: this call's own, never shared (see _workspace)
    work = torch.empty(3 * max(chunk_start[-1], 1), dtype=torch.float64, device=device)
    _C.lamb_frozen_update_cuda(
        device.index,
        0 if ok is None else ok.data_ptr(),
        exchanged.data_ptr(),
        exp_avg.data_ptr(),
        denom.data_ptr(),
        exp_avg_sq_fresh.data_ptr(),
        0 if param is None else param.data_ptr(),
        update.data_ptr(),
        n_layers,
        meta.data_ptr(),
        meta[n_layers + 1 :].data_ptr(),
        chunk_start[-1],
        *(row.data_ptr() for row in coef),
        stats.data_ptr(),
        work.data_ptr(),
        _stream(device),
    )
    return stats


def _adam_update_cuda(
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    params: list[torch.Tensor],
    starts: list[int],
    hp: dict[str, list[float]],
    update_variance: bool,
    ok: torch.Tensor | None = None,
) -> None:
    n, device = len(params), grad.device
    table = _param_table(params, starts, device)
    if table is None:
        return  # no values to update
    meta, nchunks = table
    b1, b2 = hp["beta1"], hp["beta2"]
    # 1 - beta in double, then rounded, as for the CPU kernel
    rows = [hp["lr"], b1, [1 - b for b in b1], b2, [1 - b for b in b2], hp["eps"]]
    coef = _on_device([*rows, hp["weight_decay"]], torch.float32, device)
    _C.adam_update_cuda(
        device.index,
        0 if ok is None else ok.data_ptr(),
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        meta.data_ptr(),  # the parameters' pointers
        n,
        *(meta[k * n :].data_ptr() for k in range(1, 4)),  # starts, sizes, chunk_start
        nchunks,
        *(row.data_ptr() for row in coef),
        update_variance,
        _stream(device),
    )


def _adam_update_cpu(
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    params: list[torch.Tensor],
    starts: list[int],
    hp: dict[str, list[float]],
    update_variance: bool,
) -> None:
    n, lr, beta1, beta2 = len(params), hp["lr"], hp["beta1"], hp["beta2"]
    eps, weight_decay = hp["eps"], hp["weight_decay"]
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    # 1 - beta in double, then rounded: 1 - float32(0.999) is 1.3e-5 (relative) off 0.001
    arrays = [
        i64([p.data_ptr() for p in params]),
        i64(starts),
        i64([p.numel() for p in params]),
        f32(lr),
        f32(beta1),
        f32([1 - b for b in beta1]),
        f32(beta2),
        f32([1 - b for b in beta2]),
        f32(eps),
        f32(weight_decay),
    ]
    _C.adam_update_cpu(
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        arrays[0].data_ptr(),
        n,
        *(a.data_ptr() for a in arrays[1:]),
        update_variance,
        _nthreads(),
    )


def reference_adam_update(
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
) -> None:
    """Pure-torch :func:`adam_update` (same arguments, same results up to rounding)."""
    for j, (p, lo) in enumerate(zip(params, starts, strict=True)):
        s = slice(lo, lo + p.numel())
        g, m, v = grad[s], exp_avg[s], exp_avg_sq[s]
        m.mul_(beta1[j]).add_(g, alpha=1 - beta1[j])
        if update_variance:
            v.mul_(beta2[j]).addcmul_(g, g, value=1 - beta2[j])
        u = m / (v.sqrt() + eps[j])
        p = p.detach()  # any layout: read through reshape, written through a view of u
        if weight_decay[j] != 0:
            u.add_(p.reshape(-1).float(), alpha=weight_decay[j])
        p.add_(u.view(p.shape).to(p.dtype), alpha=-lr[j])


def reference_decompress(bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """Pure-torch :func:`decompress` (same arguments, same results)."""
    values = _sign_times(_unpack(bits), scales.float().view(-1, 1)).reshape(-1)
    out.view(-1).copy_(values[: out.numel()])


def reference_lamb_frozen_update(
    exchanged: torch.Tensor,
    exp_avg: torch.Tensor,
    denom: torch.Tensor,
    exp_avg_sq_fresh: torch.Tensor,
    param: torch.Tensor | None,
    update: torch.Tensor,
    offsets: list[int],
    scaling: list[float],
    beta1: list[float],
    beta2: list[float],
    eps: list[float],
    weight_decay: list[float],
) -> torch.Tensor:
    """Pure-torch :func:`lamb_frozen_update` (same arguments, same results up to rounding).

    The statistics stay on the buffers' device (one tensor, no host sync per layer)."""
    rows = []
    for k, (lo, hi) in enumerate(itertools.pairwise(offsets)):
        if lo == hi:
            rows.append(torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64, device=update.device))
            continue
        x, m, d = exchanged[lo:hi], exp_avg[lo:hi], denom[lo:hi]
        vf, u = exp_avg_sq_fresh[lo:hi], update[lo:hi]
        m_new = x / scaling[k]
        g = (m_new - beta1[k] * m) / (1 - beta1[k])
        vf.mul_(beta2[k]).addcmul_(g, g, value=1 - beta2[k])
        ratio = (d / (vf.sqrt() + eps[k])).amax()
        torch.div(m_new, d, out=u)
        prelim = u.double().square().sum()
        if weight_decay[k] != 0:
            u.add_(param[lo:hi], alpha=weight_decay[k])
        m.copy_(m_new)
        rows.append(torch.stack([ratio.double(), prelim, u.double().square().sum()]))
    if not rows:
        return torch.empty(0, 3, dtype=torch.float64, device=update.device)
    return torch.stack(rows)
