"""The compiled kernels (``lightning_onebit._C``) and the marshalling of checked tensors into
their raw-pointer calls, on the CPU and on CUDA (the device's current stream).

Why raw pointers: the extension needs no torch headers, so it builds in seconds with pybind11
and CMake alone and one build works with any torch. :mod:`.checks` owns every check."""

from __future__ import annotations

import itertools
import warnings
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lightning_onebit.kernels.runs import SignRuns

__all__ = [
    "HAS_CPP",
    "HAS_CUDA",
    "IMPORT_ERROR",
    "adam_update_cpu",
    "adam_update_cuda",
    "chunk_starts",
    "decompress",
    "frozen_adam_update_cpu",
    "frozen_adam_update_cuda",
    "has_kernel",
    "lamb_frozen_update_cpu",
    "lamb_frozen_update_cuda",
    "layer_step_cuda",
    "local_compress",
    "local_source_cpu",
    "local_source_cuda",
    "local_step_cpu",
    "module",
    "momentum_compress",
    "momentum_source_cpu",
    "momentum_source_cuda",
    "nthreads",
    "on_device",
    "param_table",
    "restore_unless_cuda",
    "segment_table",
    "server_reduce",
    "stream",
    "sync_update_cpu",
    "sync_update_cuda",
    "update_error",
    "use_native",
    "worker_compress",
    "workspace",
]

try:
    from lightning_onebit import _C as module
except ImportError as _err:  # pragma: no cover - exercised only on broken installs
    module = None
    IMPORT_ERROR: ImportError | None = _err
else:
    IMPORT_ERROR = None

#: the compiled module imported (its CPU kernels); and it was built with CUDA kernels
HAS_CPP: bool = module is not None
HAS_CUDA: bool = bool(module is not None and module.has_cuda)

_fallback_warned = False


def has_kernel(device: torch.device) -> bool:
    """Whether the compiled module has a kernel for ``device``: the CPU, or CUDA in a build
    with CUDA kernels."""
    return device.type == "cpu" or (device.type == "cuda" and HAS_CUDA)


def use_native() -> bool:
    global _fallback_warned
    if HAS_CPP:
        return True
    if not _fallback_warned:
        warnings.warn(
            f"lightning_onebit._C failed to import ({IMPORT_ERROR}); using the pure-torch kernels "
            "(same results, several times slower). Reinstall the package to build the extension.",
            RuntimeWarning,
            stacklevel=3,
        )
        _fallback_warned = True
    return False


def nthreads() -> int:
    return max(1, torch.get_num_threads())


def stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host array (hyperparameters, offsets, pointers) in ``device``'s memory for one call,
    copied on the device's current stream, which the call's kernel runs on, without a host
    synchronisation: from pinned memory, which torch's caching host allocator keeps until the
    copy has run (a copy from pageable memory may synchronise). The result comes from the
    caching allocator on that stream, so it is reused only after the kernel has read it."""
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def chunk_starts(sizes: list[int]) -> list[int]:
    """The CUDA optimizer updates' chunk table (``cpp/onebit.h``): parameter (layer) ``j`` owns
    chunks ``out[j]:out[j + 1]`` of ``module.cuda_update_chunk()`` values; ``out[-1]`` chunks in all."""
    chunk = module.cuda_update_chunk()
    return list(itertools.accumulate((-(-s // chunk) for s in sizes), initial=0))


def workspace(device: torch.device) -> torch.Tensor:
    """Scratch for one CUDA call's partial sums, never shared: two exchanges in flight (buckets,
    param groups, threads) each get their own. From torch's caching allocator on the current
    stream, which the call's kernels run on, so it is reused only after they have read it."""
    return torch.empty(module.cuda_workspace_bytes(), dtype=torch.uint8, device=device)


def segment_table(
    pointers: list[int], starts: list[int], sizes: list[int], device: torch.device
) -> tuple[torch.Tensor, int] | None:
    """The CUDA segment sweeps' table on ``device``: ``pointers`` (the segments' tensors, one
    table or more of ``P`` each), then the segments' starts, sizes (``P`` each) and chunk table
    (``P + 1``), and the number of chunks; ``None`` when the segments hold no values."""
    chunk_start = chunk_starts(sizes)
    if chunk_start[-1] == 0:
        return None
    meta = on_device([*pointers, *starts, *sizes, *chunk_start], torch.int64, device)
    return meta, chunk_start[-1]


def param_table(
    params: list[torch.Tensor], starts: list[int], device: torch.device
) -> tuple[torch.Tensor, int] | None:
    """:func:`segment_table` of the CUDA parameter updates: the parameters' pointers first."""
    return segment_table(_pointers(params), starts, [p.numel() for p in params], device)


def worker_compress(
    x: torch.Tensor,
    error: torch.Tensor,
    bits: torch.Tensor,
    scale: torch.Tensor,
    error_out: torch.Tensor | None = None,
    pending: bool = False,
    prev_bits: torch.Tensor | None = None,
    prev_scale: torch.Tensor | None = None,
) -> None:
    """The compiled ``worker_compress``: deferred into ``error_out`` when given, else bits and
    scale only (the update left to :func:`update_error`)."""
    n, w, device = error.numel(), bits.size(0), error.device
    out = 0 if error_out is None else error_out.data_ptr()
    prev = prev_bits.data_ptr() if pending and prev_bits is not None else 0
    if device.type == "cuda":
        module.worker_compress_cuda(
            device.index,
            x.data_ptr(),
            x.numel(),
            error.data_ptr(),
            out,
            n,
            bits.data_ptr(),
            w,
            bits.stride(0),
            prev,
            prev_scale.data_ptr() if pending and prev_scale is not None else 0,
            bool(pending),
            scale.data_ptr(),
            workspace(device).data_ptr(),
            stream(device),
        )
    else:
        module.worker_compress_cpu(
            x.data_ptr(),
            x.numel(),
            error.data_ptr(),
            out,
            n,
            bits.data_ptr(),
            w,
            bits.stride(0),
            prev,
            float(prev_scale) if pending and prev_scale is not None else 0.0,
            bool(pending),
            scale.data_ptr(),
            nthreads(),
        )


def server_reduce(
    bits: torch.Tensor,
    scales: torch.Tensor,
    error: torch.Tensor,
    error_out: torch.Tensor,
    out_bits: torch.Tensor,
    out_scale: torch.Tensor,
    pending: bool,
    prev_bits: torch.Tensor,
    prev_scale: torch.Tensor,
) -> None:
    """The compiled ``server_reduce``."""
    w, m, device = bits.size(0), error.numel(), error.device
    head = (bits.data_ptr(), w, bits.stride(0), scales.data_ptr(), scales.stride(0))
    bufs = (error.data_ptr(), error_out.data_ptr(), m, prev_bits.data_ptr())
    tail = (out_bits.data_ptr(), out_scale.data_ptr(), bool(pending))
    if device.type == "cuda":
        module.server_reduce_cuda(
            device.index,
            *head,
            *bufs,
            prev_scale.data_ptr(),
            *tail,
            workspace(device).data_ptr(),
            stream(device),
        )
    else:
        module.server_reduce_cpu(
            *head, *bufs, float(prev_scale) if pending else 0.0, *tail, nthreads()
        )


def decompress(bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """The compiled ``decompress``."""
    w, m, device = bits.size(0), bits.size(1) * 8, out.device
    args = (bits.data_ptr(), w, bits.stride(0), scales.data_ptr(), scales.stride(0), m)
    if device.type == "cuda":
        module.decompress_cuda(device.index, *args, out.data_ptr(), out.numel(), stream(device))
    else:
        module.decompress_cpu(*args, out.data_ptr(), out.numel(), nthreads())


def _runs_arrays(runs: SignRuns | None) -> tuple[list[torch.Tensor], tuple[int, ...]]:
    """A ``SignRuns``' arrays (lo, hi, bits pointers, scales; kept alive by the caller) and the
    compiled call's trailing arguments: ``nruns, lo, hi, bits, scale`` (all 0 for ``None``)."""
    if runs is None:
        return [], (0, 0, 0, 0, 0)
    lo, hi, bits, scale = zip(*runs.runs, strict=True)
    arrays = [
        torch.tensor(lo, dtype=torch.int64),
        torch.tensor(hi, dtype=torch.int64),
        torch.tensor([b.data_ptr() for b in bits], dtype=torch.int64),
        torch.tensor(scale, dtype=torch.float32),
    ]
    return arrays, (len(lo), *(a.data_ptr() for a in arrays))


def lamb_frozen_update_cpu(
    tensors: tuple[torch.Tensor | SignRuns | None, ...],
    offsets: list[int],
    coefs: list[list[float]],
    preconditioned: bool,
    runs: SignRuns | None = None,
) -> torch.Tensor:
    """The compiled ``lamb_frozen_update`` on CPU tensors (``tensors``: exchanged, exp_avg,
    denom, exp_avg_sq_fresh, the layers' parameters (one fp32 contiguous tensor or ``None`` per
    layer) or ``None``, update; ``coefs``: per layer scaling, beta1,
    1 - beta1, beta2, 1 - beta2, eps, weight_decay; ``preconditioned``: exchanged * denom
    first; ``runs``: the ``SignRuns`` read in place of ``exchanged``, or ``None``)."""
    exchanged, exp_avg, denom, exp_avg_sq_fresh, param, update = tensors
    n_layers = len(offsets) - 1
    stats = torch.empty(n_layers, 3, dtype=torch.float64)
    arrays = [
        torch.tensor(offsets, dtype=torch.int64),
        *(torch.tensor(c, dtype=torch.float32) for c in coefs),
    ]
    kept, runs_args = _runs_arrays(runs)
    pointers = _pointer_array(param)
    module.lamb_frozen_update_cpu(
        0 if runs is not None else exchanged.data_ptr(),
        exp_avg.data_ptr(),
        denom.data_ptr(),
        exp_avg_sq_fresh.data_ptr(),
        _address(pointers),
        update.data_ptr(),
        n_layers,
        *(a.data_ptr() for a in arrays),
        bool(preconditioned),
        stats.data_ptr(),
        nthreads(),
        *runs_args,
    )
    del kept
    return stats


def update_error(
    x: torch.Tensor,
    error: torch.Tensor,
    scale: torch.Tensor,
    device: torch.device,
    out: torch.Tensor | None = None,
) -> None:
    n, out = error.numel(), error if out is None else out
    if device.type == "cuda":
        module.worker_update_error_cuda(
            device.index,
            x.data_ptr(),
            x.numel(),
            error.data_ptr(),
            out.data_ptr(),
            n,
            scale.data_ptr(),
            stream(device),
        )
    else:
        module.worker_update_error_cpu(
            x.data_ptr(), x.numel(), error.data_ptr(), out.data_ptr(), n, float(scale), nthreads()
        )


def restore_unless_cuda(ok: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
    nbytes = dst.numel() * dst.element_size()
    module.restore_unless_cuda(
        dst.device.index, ok.data_ptr(), dst.data_ptr(), src.data_ptr(), nbytes, stream(dst.device)
    )


def frozen_adam_update_cuda(
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
    table = param_table(params, starts, device)
    if table is None:
        return  # no values to update
    meta, nchunks = table
    # -lr and -lr * wd in double, then rounded: the alphas the torch path passes
    nlw = [-a * w for a, w in zip(lr, weight_decay, strict=True)]
    coef = on_device([[-a for a in lr], nlw], torch.float32, device)
    module.frozen_adam_update_cuda(
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
        stream(device),
    )


def lamb_frozen_update_cuda(
    tensors: tuple[torch.Tensor | list[torch.Tensor | None] | None, ...],
    offsets: list[int],
    coefs: list[list[float]],
    ok: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`lamb_frozen_update` on CUDA tensors (``tensors`` as :func:`lamb_frozen_update_cpu`'s:
    the layers' parameters one tensor or ``None`` per layer, or ``None``): the kernel on the
    current stream."""
    exchanged, exp_avg, denom, exp_avg_sq_fresh, param, update = tensors
    device, n_layers = exchanged.device, len(offsets) - 1
    stats = torch.empty(n_layers, 3, dtype=torch.float64, device=device)
    if n_layers == 0:
        return stats
    chunk_start = chunk_starts([b - a for a, b in itertools.pairwise(offsets)])
    pointers = [] if param is None else _pointers(param)
    # offsets (L + 1), chunk_start (L + 1), then the parameters' pointers (L, when given)
    meta = on_device([*offsets, *chunk_start, *pointers], torch.int64, device)
    coef = on_device(coefs, torch.float32, device)
    # the per-chunk partial sums: this call's own, never shared (see workspace)
    work = torch.empty(3 * max(chunk_start[-1], 1), dtype=torch.float64, device=device)
    module.lamb_frozen_update_cuda(
        device.index,
        0 if ok is None else ok.data_ptr(),
        exchanged.data_ptr(),
        exp_avg.data_ptr(),
        denom.data_ptr(),
        exp_avg_sq_fresh.data_ptr(),
        0 if param is None else meta[2 * (n_layers + 1) :].data_ptr(),
        update.data_ptr(),
        n_layers,
        meta.data_ptr(),
        meta[n_layers + 1 :].data_ptr(),
        chunk_start[-1],
        *(row.data_ptr() for row in coef),
        stats.data_ptr(),
        work.data_ptr(),
        stream(device),
    )
    return stats


def adam_update_cuda(
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
    table = param_table(params, starts, device)
    if table is None:
        return  # no values to update
    meta, nchunks = table
    b1, b2 = hp["beta1"], hp["beta2"]
    # 1 - beta in double, then rounded, as for the CPU kernel
    rows = [hp["lr"], b1, [1 - b for b in b1], b2, [1 - b for b in b2], hp["eps"]]
    coef = on_device([*rows, hp["weight_decay"]], torch.float32, device)
    module.adam_update_cuda(
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
        stream(device),
    )


def adam_update_cpu(
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
    module.adam_update_cpu(
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        arrays[0].data_ptr(),
        n,
        *(a.data_ptr() for a in arrays[1:]),
        update_variance,
        nthreads(),
    )


def _pointers(tensors: list[torch.Tensor | None]) -> list[int]:
    """Each segment's pointer for the kernels' tables (0: ``None``)."""
    return [0 if t is None else t.data_ptr() for t in tensors]


def _pointer_array(tensors: list[torch.Tensor | None] | None) -> torch.Tensor | None:
    """:func:`_pointers` as a host int64 array for the CPU kernels (``None``: no array)."""
    return None if tensors is None else torch.tensor(_pointers(tensors), dtype=torch.int64)


def _address(t: torch.Tensor | None) -> int:
    """``t``'s data pointer, 0 for ``None``."""
    return 0 if t is None else t.data_ptr()


def momentum_source_cpu(
    tensors: tuple[torch.Tensor, list[torch.Tensor | None], torch.Tensor | None, torch.Tensor],
    starts: list[int],
    sizes: list[int],
    coefs: tuple[list[float], list[float]],
) -> None:
    """The compiled ``momentum_source`` on CPU tensors (``tensors``: exp_avg, the segments'
    gradients (``None``: zeros), denom or ``None``, out; ``coefs``: per segment the factors of
    ``exp_avg`` and of the gradient)."""
    exp_avg, grads, denom, out = tensors
    kept, (g, *rest) = _source_tables(_pointers(grads), starts, sizes, coefs, False, out.device)
    module.momentum_source_cpu(
        exp_avg.data_ptr(), g, _address(denom), out.data_ptr(), len(starts), *rest, nthreads()
    )
    del kept


def _compress_tail(
    starts: list[int],
    sizes: list[int],
    compress: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    pending: bool,
    prev: tuple[torch.Tensor, torch.Tensor],
    cuda: bool = False,
) -> list:
    """The trailing arguments of the compiled source compressions: the flat range's start and
    length (the segments tile it), then ``worker_compress_cpu``'s from ``compress`` (error,
    bits, scale, error_out) and ``prev`` (prev_bits, prev_scale); with ``cuda``
    ``worker_compress_cuda``'s (``prev_scale`` in device memory, the workspace, the stream)."""
    (error, bits, scale, error_out), (prev_bits, prev_scale) = compress, prev
    device = error.device
    if not pending:
        prev_scale_arg: int | float = 0 if cuda else 0.0
    else:
        prev_scale_arg = prev_scale.data_ptr() if cuda else float(prev_scale)
    head = [
        starts[0],
        sum(sizes),
        error.data_ptr(),
        error_out.data_ptr(),
        error.numel(),
        bits.data_ptr(),
        bits.size(0),
        bits.stride(0),
        prev_bits.data_ptr() if pending else 0,
        prev_scale_arg,
        bool(pending),
        scale.data_ptr(),
    ]
    if cuda:
        return [*head, workspace(device).data_ptr(), stream(device)]
    return [*head, nthreads()]


def _source_tables(
    pointers: list[int],
    starts: list[int],
    sizes: list[int],
    coefs: tuple[list[float], ...],
    cuda: bool,
    device: torch.device,
) -> tuple[list[torch.Tensor], list[int]]:
    """The source compressions' tables: the addresses of ``pointers`` (one table or more of
    ``P`` each), the segments' starts and sizes (int64), then of each coefficient list
    (float32); with the arrays that hold them, for the caller to keep until the call has run.
    Host arrays on the CPU; on CUDA one int64 and one float32 array in ``device``'s memory
    (:func:`on_device`)."""
    ints = [*pointers, *starts, *sizes]
    if cuda:
        meta, coef = (
            on_device(ints, torch.int64, device),
            on_device(list(coefs), torch.float32, device),
        )
        rows = [meta[k : k + len(starts)] for k in range(0, len(ints), len(starts))]
        return [meta, coef], [r.data_ptr() for r in rows] + [c.data_ptr() for c in coef]
    arrays = [
        torch.tensor(ints, dtype=torch.int64),
        *(torch.tensor(c, dtype=torch.float32) for c in coefs),
    ]
    base, step = arrays[0].data_ptr(), 8 * len(starts)
    return arrays, [base + k * step for k in range(len(ints) // len(starts))] + [
        a.data_ptr() for a in arrays[1:]
    ]


def momentum_compress(
    tensors: tuple[
        torch.Tensor, list[torch.Tensor | None], torch.Tensor | None, list[int], list[int]
    ],
    coefs: tuple[list[float], list[float]],
    compress: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    pending: bool,
    prev: tuple[torch.Tensor, torch.Tensor],
    cuda: bool = False,
) -> None:
    """The compiled deferred ``worker_compress`` of ``momentum_source``'s values (``tensors``:
    exp_avg, the segments' gradients, denom or ``None``, the segments' starts and sizes, which
    tile the input's flat range in order; ``coefs``: the factors of exp_avg and gradient;
    ``compress``: error, bits, scale, error_out; ``prev``: prev_bits, prev_scale): the CPU
    kernel, or with ``cuda`` the CUDA one on the current stream."""
    exp_avg, grads, denom, starts, sizes = tensors
    device = exp_avg.device
    kept, (g, st, sz, b, a) = _source_tables(_pointers(grads), starts, sizes, coefs, cuda, device)
    head = [device.index] if cuda else []
    run = module.momentum_compress_cuda if cuda else module.momentum_compress_cpu
    run(
        *head,
        exp_avg.data_ptr(),
        g,
        _address(denom),
        len(starts),
        st,
        sz,
        b,
        a,
        *_compress_tail(starts, sizes, compress, pending, prev, cuda),
    )
    del kept


def local_compress(
    tensors: tuple[torch.Tensor, list[torch.Tensor | None], torch.Tensor],
    params: list[torch.Tensor | None] | None,
    acc: torch.Tensor | None,
    segments: tuple[list[int], list[int]],
    hp: tuple[tuple[list[float], list[float], list[float], list[float]], bool],
    compress: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    pending: bool,
    prev: tuple[torch.Tensor, torch.Tensor],
    cuda: bool = False,
) -> None:
    """The compiled deferred ``worker_compress`` of ``local_source``'s values (``tensors``,
    ``params``, ``acc`` and ``segments`` as :func:`local_source_cpu`, the segments tiling the
    input's flat range in order; ``hp``: the coefficients and ``preconditioned``;
    ``compress``: error, bits, scale, error_out; ``prev``: prev_bits, prev_scale): the CPU
    kernel, or with ``cuda`` the CUDA one on the current stream."""
    (exp_avg, grads, denom), (starts, sizes), (coefs, preconditioned) = tensors, segments, hp
    device = exp_avg.device
    pointers = _pointers(grads) + ([] if params is None else _pointers(params))
    kept, addresses = _source_tables(pointers, starts, sizes, _local_coefs(coefs), cuda, device)
    g, p = addresses[0], (0 if params is None else addresses[1])
    st, sz, *c = addresses[-6:]  # starts, sizes, beta, alpha, -weight_decay, -lr
    head = [device.index] if cuda else []
    run = module.local_compress_cuda if cuda else module.local_compress_cpu
    run(
        *head,
        exp_avg.data_ptr(),
        g,
        denom.data_ptr(),
        p,
        _address(acc),
        len(starts),
        st,
        sz,
        *c,
        bool(preconditioned),
        *_compress_tail(starts, sizes, compress, pending, prev, cuda),
    )
    del kept


def frozen_adam_update_cpu(
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    params: list[torch.Tensor],
    starts: list[int],
    hp: tuple[list[float], list[float], bool],
    runs: SignRuns | None = None,
) -> None:
    """:func:`frozen_adam_update` on CPU tensors (``tensors``: exchanged, exp_avg, denom;
    ``hp``: lr, weight_decay, preconditioned; ``runs``: the ``SignRuns`` read in place of
    ``exchanged``, or ``None``), without a verdict."""
    (exchanged, exp_avg, denom), (lr, weight_decay, preconditioned) = tensors, hp
    # -lr and -lr * wd in double, then rounded: the alphas the torch path passes; +0.0 (no
    # decay step at all) where weight_decay is not positive, as the torch path skips it
    nlw = [-a * w if w > 0 else 0.0 for a, w in zip(lr, weight_decay, strict=True)]
    arrays = [
        torch.tensor([p.data_ptr() for p in params], dtype=torch.int64),
        torch.tensor(starts, dtype=torch.int64),
        torch.tensor([p.numel() for p in params], dtype=torch.int64),
        torch.tensor([-a for a in lr], dtype=torch.float32),
        torch.tensor(nlw, dtype=torch.float32),
    ]
    kept, runs_args = _runs_arrays(runs)
    module.frozen_adam_update_cpu(
        0 if runs is not None else exchanged.data_ptr(),
        exp_avg.data_ptr(),
        denom.data_ptr(),
        arrays[0].data_ptr(),
        len(params),
        *(a.data_ptr() for a in arrays[1:]),
        bool(preconditioned),
        nthreads(),
        *runs_args,
    )
    del kept


def _local_coefs(
    hp: tuple[list[float], list[float], list[float], list[float]],
) -> tuple[list[float], ...]:
    """``local_source``'s per-segment coefficients as its kernels take them: beta, alpha,
    -weight_decay rounded from double (+0.0: no decay term, as the torch ops skip it), -lr."""
    beta, alpha, lr, weight_decay = hp
    return beta, alpha, [-w if w > 0 else 0.0 for w in weight_decay], [-a for a in lr]


def local_source_cpu(
    tensors: tuple[torch.Tensor, list[torch.Tensor | None], torch.Tensor],
    params: list[torch.Tensor | None] | None,
    acc: torch.Tensor | None,
    out: torch.Tensor,
    segments: tuple[list[int], list[int]],
    hp: tuple[list[float], list[float], list[float], list[float]],
    preconditioned: bool,
) -> None:
    """The compiled ``local_source`` on CPU tensors (``tensors``: exp_avg, the segments'
    gradients (``None``: zeros), denom; ``params``: the segments' parameters (``None``: no
    decay term) or ``None``; ``segments``: starts, sizes; ``hp``: per segment beta, alpha, lr,
    weight_decay)."""
    (exp_avg, grads, denom), (starts, sizes) = tensors, segments
    pointers = _pointers(grads) + ([] if params is None else _pointers(params))
    kept, addresses = _source_tables(pointers, starts, sizes, _local_coefs(hp), False, out.device)
    module.local_source_cpu(
        exp_avg.data_ptr(),
        addresses[0],
        denom.data_ptr(),
        0 if params is None else addresses[1],
        _address(acc),
        out.data_ptr(),
        len(starts),
        *addresses[-6:],  # starts, sizes, beta, alpha, -weight_decay, -lr
        bool(preconditioned),
        nthreads(),
    )
    del kept


def local_step_cpu(
    tensors: tuple[torch.Tensor, list[torch.Tensor | None], torch.Tensor, torch.Tensor],
    params: list[torch.Tensor],
    starts: list[int],
    hp: tuple[list[float], list[float], list[float], list[float]],
) -> bool:
    """The compiled ``local_step`` on CPU tensors (``tensors``: exp_avg, the parameters'
    gradients (``None``: zeros), denom, acc; ``params`` fp32 and contiguous; ``hp``: per
    parameter beta, alpha, lr, weight_decay); whether it ran (every gradient finite)."""
    exp_avg, grads, denom, acc = tensors
    beta, alpha, lr, weight_decay = hp
    # the decay's factor (+0.0: none, as the torch ops skip it) and -lr, rounded from double
    coefs = (beta, alpha, [w if w > 0 else 0.0 for w in weight_decay], [-a for a in lr])
    sizes, pointers = [p.numel() for p in params], _pointers(grads) + _pointers(params)
    kept, (g, p, *rest) = _source_tables(pointers, starts, sizes, coefs, False, acc.device)
    ran = module.local_step_cpu(
        g, exp_avg.data_ptr(), denom.data_ptr(), acc.data_ptr(), p, len(params), *rest, nthreads()
    )
    del kept
    return ran


def sync_update_cpu(
    tensors: tuple[torch.Tensor, ...],
    floored: torch.Tensor | None,
    acc: torch.Tensor | None,
    params: list[torch.Tensor],
    starts: list[int],
    hp: tuple[list[float], bool, bool],
    runs: SignRuns | None = None,
) -> None:
    """The compiled ``sync_update`` on CPU tensors (``tensors``: exchanged, denom, exp_avg,
    synced; ``hp``: per parameter the lr summed since the last sync, preconditioned, and
    whether to write the parameters, fp32 and contiguous, too; ``runs``: the ``SignRuns``
    read in place of ``exchanged``, or ``None``)."""
    (exchanged, denom, exp_avg, synced), (lrs, preconditioned, write_params) = tensors, hp
    # -lrs rounded from double, the divisor of the torch path; +0.0: m = 0 (no step taken)
    arrays = [
        torch.tensor([p.data_ptr() for p in params], dtype=torch.int64),
        torch.tensor(starts, dtype=torch.int64),
        torch.tensor([p.numel() for p in params], dtype=torch.int64),
        torch.tensor([-a if a > 0 else 0.0 for a in lrs], dtype=torch.float32),
    ]
    kept, runs_args = _runs_arrays(runs)
    module.sync_update_cpu(
        0 if runs is not None else exchanged.data_ptr(),
        denom.data_ptr(),
        0 if floored is None else floored.data_ptr(),
        exp_avg.data_ptr(),
        synced.data_ptr(),
        arrays[0].data_ptr() if write_params else 0,
        0 if acc is None else acc.data_ptr(),
        len(params),
        *(a.data_ptr() for a in arrays[1:]),
        bool(preconditioned),
        nthreads(),
        *runs_args,
    )
    del kept


def momentum_source_cuda(
    tensors: tuple[torch.Tensor, list[torch.Tensor | None], torch.Tensor | None, torch.Tensor],
    starts: list[int],
    sizes: list[int],
    coefs: tuple[list[float], list[float]],
) -> None:
    """The compiled ``momentum_source`` on CUDA tensors (arguments as
    :func:`momentum_source_cpu`): the kernel on the current stream."""
    exp_avg, grads, denom, out = tensors
    n, device = len(starts), out.device
    table = segment_table(_pointers(grads), starts, sizes, device)
    if table is None:
        return  # no values
    meta, nchunks = table
    coef = on_device(list(coefs), torch.float32, device)  # beta, alpha, rounded from double
    module.momentum_source_cuda(
        device.index,
        exp_avg.data_ptr(),
        meta.data_ptr(),  # the gradients' pointers
        0 if denom is None else denom.data_ptr(),
        out.data_ptr(),
        n,
        *(meta[k * n :].data_ptr() for k in range(1, 4)),  # starts, sizes, chunk_start
        nchunks,
        coef[0].data_ptr(),
        coef[1].data_ptr(),
        stream(device),
    )


def local_source_cuda(
    tensors: tuple[torch.Tensor, list[torch.Tensor | None], torch.Tensor],
    params: list[torch.Tensor | None] | None,
    acc: torch.Tensor | None,
    out: torch.Tensor,
    segments: tuple[list[int], list[int]],
    hp: tuple[list[float], list[float], list[float], list[float]],
    preconditioned: bool,
) -> None:
    """The compiled ``local_source`` on CUDA tensors (arguments as :func:`local_source_cpu`):
    the kernel on the current stream."""
    (exp_avg, grads, denom), (starts, sizes) = tensors, segments
    n, device = len(starts), out.device
    pointers = _pointers(grads) + ([] if params is None else _pointers(params))
    table = segment_table(pointers, starts, sizes, device)  # the gradients', the parameters'
    if table is None:
        return  # no values
    meta, nchunks = table
    coef = on_device(list(_local_coefs(hp)), torch.float32, device)
    head = len(pointers)
    module.local_source_cuda(
        device.index,
        exp_avg.data_ptr(),
        meta.data_ptr(),  # the gradients' pointers
        denom.data_ptr(),
        0 if params is None else meta[n:].data_ptr(),  # the parameters' pointers
        0 if acc is None else acc.data_ptr(),
        out.data_ptr(),
        n,
        *(meta[head + k * n :].data_ptr() for k in range(3)),  # starts, sizes, chunk_start
        nchunks,
        *(row.data_ptr() for row in coef),
        bool(preconditioned),
        stream(device),
    )


def layer_step_cuda(
    update: torch.Tensor, params: list[torch.Tensor], starts: list[int], alpha: torch.Tensor
) -> None:
    """:func:`layer_step` on CUDA tensors: the kernel on the current stream."""
    n, device = len(params), update.device
    table = param_table(params, starts, device)
    if table is None:
        return  # no values
    meta, nchunks = table
    module.layer_step_cuda(
        device.index,
        update.data_ptr(),
        meta.data_ptr(),  # the parameters' pointers
        n,
        *(meta[k * n :].data_ptr() for k in range(1, 4)),  # starts, sizes, chunk_start
        nchunks,
        alpha.data_ptr(),
        stream(device),
    )


def _reciprocals(lrs: list[float]) -> list[float]:
    """Per parameter the reciprocal that torch's CUDA division by the Python scalar ``-lrs[j]``
    multiplies by: ``1.0 / -lrs[j]`` taken on the host in double and rounded once to float32 (by
    :func:`on_device`; overflow gives -inf, as torch's cast); +0.0 (the kernel's "m = 0") where
    ``lrs[j] <= 0``."""
    return [1.0 / -a if a > 0 else 0.0 for a in lrs]


def sync_update_cuda(
    tensors: tuple[torch.Tensor, ...],
    floored: torch.Tensor | None,
    acc: torch.Tensor | None,
    params: list[torch.Tensor],
    starts: list[int],
    hp: tuple[list[float], bool, bool],
) -> None:
    """The compiled ``sync_update`` on CUDA tensors (arguments as :func:`sync_update_cpu`):
    the kernel on the current stream."""
    (exchanged, denom, exp_avg, synced), (lrs, preconditioned, write_params) = tensors, hp
    n, device = len(params), exchanged.device
    table = param_table(params, starts, device)
    if table is None:
        return  # no values
    meta, nchunks = table
    inv = on_device(_reciprocals(lrs), torch.float32, device)
    module.sync_update_cuda(
        device.index,
        exchanged.data_ptr(),
        denom.data_ptr(),
        0 if floored is None else floored.data_ptr(),
        exp_avg.data_ptr(),
        synced.data_ptr(),
        meta.data_ptr() if write_params else 0,  # the parameters' pointers
        0 if acc is None else acc.data_ptr(),
        n,
        *(meta[k * n :].data_ptr() for k in range(1, 4)),  # starts, sizes, chunk_start
        nchunks,
        inv.data_ptr(),
        bool(preconditioned),
        stream(device),
    )
