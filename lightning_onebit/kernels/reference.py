"""Pure-torch twins of the fused kernels: the same arguments and the same results (bit for bit
where the docstring says so, else up to rounding). The tests compare every kernel with its twin;
they are also the path taken when the compiled module is missing (with a warning)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from lightning_onebit.kernels.denominator import Denominator

__all__ = [
    "finish_pending",
    "reference_adam_update",
    "reference_decompress",
    "reference_dequantize",
    "reference_frozen_adam_update",
    "reference_lamb_frozen_update",
    "reference_layer_step",
    "reference_local_source",
    "reference_local_step",
    "reference_momentum_source",
    "reference_quantize",
    "reference_quantized_reduce",
    "reference_restore_unless",
    "reference_server_reduce",
    "reference_sync_update",
    "reference_worker_compress",
    "reference_worker_update_error",
]


_BIT_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _divided(t: torch.Tensor, k: float) -> torch.Tensor:
    """``t / k`` as the compiled kernels compute it, each value divided: torch's CUDA kernels
    multiply by a rounded ``1 / k`` where ``k`` is a Python number (a bit off where ``1 / k`` is
    not exact, e.g. ``k`` = 3 or 7), and divide where it is a tensor on the device."""
    return t / torch.full((), k, dtype=t.dtype, device=t.device)


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


def finish_pending(error: torch.Tensor, out_bits: torch.Tensor, out_scale: torch.Tensor) -> None:
    """Apply a deferred error update
    ([`server_reduce`][lightning_onebit.kernels.compression.server_reduce]'s, or
    ``worker_compress(..., deferred=True)``'s): ``error <- error - out_scale * sign(out_bits)``
    (``out_bits``: the call's packed signs, rows in order)."""
    error.sub_(_sign_times(_unpack(out_bits.reshape(-1)), out_scale.reshape(())))


def reference_worker_compress(
    x: torch.Tensor,
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
    """Pure-torch [`worker_compress`][lightning_onebit.kernels.compression.worker_compress] (same
    arguments, same results)."""
    e = error.reshape(-1).clone()
    if pending:  # read before bits and scale, which may be prev_bits and prev_scale, change
        finish_pending(
            e, bits if prev_bits is None else prev_bits, scale if prev_scale is None else prev_scale
        )
    n, w = e.numel(), bits.size(0)
    y = e
    y[: x.numel()] += x.reshape(-1)
    s = _scale_of(y)
    bits.copy_(_pack(y.view(w, n // w)))
    scale.view(-1).copy_(s)
    if deferred:
        (error if error_out is None else error_out).view(-1).copy_(y)
    elif update_error:
        error.view(-1).copy_(y - _sign_times(y >= 0, s))


def reference_worker_update_error(
    x: torch.Tensor, error: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None
) -> None:
    """Pure-torch [`worker_update_error`][lightning_onebit.kernels.compression.worker_update_error]
    (same arguments, same results)."""
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
    write_error: bool = True,
) -> None:
    """Pure-torch [`server_reduce`][lightning_onebit.kernels.compression.server_reduce] (same
    arguments, same results)."""
    e = error.reshape(-1).clone()
    if pending:
        prev_bits = out_bits if prev_bits is None else prev_bits
        finish_pending(e, prev_bits, out_scale if prev_scale is None else prev_scale)
    w = bits.size(0)
    weights = _divided(scales.float(), w)  # float32 division, as in the kernels
    positive = _unpack(bits)  # W, m
    c = torch.zeros(e.numel(), dtype=torch.float32, device=e.device)
    for i in range(w):  # row order matters for bitwise-identical floats
        c += _sign_times(positive[i], weights[i])
    c += e
    out_bits.view(-1).copy_(_pack(c))
    # the update c - s * sign(c) stays deferred, as in the kernels
    if write_error:
        (error if error_out is None else error_out).view(-1).copy_(c)
    out_scale.view(-1).copy_(_scale_of(c))


def reference_decompress(bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """Pure-torch [`decompress`][lightning_onebit.kernels.compression.decompress] (same arguments,
    same results)."""
    values = _sign_times(_unpack(bits), scales.float().view(-1, 1)).reshape(-1)
    out.view(-1).copy_(values[: out.numel()])


def reference_adam_update(
    grad: torch.Tensor | Sequence[torch.Tensor | None],
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
    """Pure-torch [`adam_update`][lightning_onebit.kernels.updates.adam_update] (same arguments,
    same results up to rounding): ``grad`` a flat buffer or one tensor (``None``: zeros) per
    parameter."""
    for j, (p, lo) in enumerate(zip(params, starts, strict=True)):
        s = slice(lo, lo + p.numel())
        m, v = exp_avg[s], exp_avg_sq[s]
        if isinstance(grad, torch.Tensor):
            g = grad[s]
        else:
            g = torch.zeros_like(m) if grad[j] is None else grad[j].reshape(-1)
        m.mul_(beta1[j]).add_(g, alpha=1 - beta1[j])
        if update_variance:
            v.mul_(beta2[j]).addcmul_(g, g, value=1 - beta2[j])
        u = m / (v.sqrt() + eps[j])
        p = p.detach()  # any layout: read through reshape, written through a view of u
        if weight_decay[j] != 0:
            u.add_(p.reshape(-1).float(), alpha=weight_decay[j])
        p.add_(u.view(p.shape).to(p.dtype), alpha=-lr[j])


def _piece(t: torch.Tensor | Sequence[torch.Tensor], k: int, s: slice) -> torch.Tensor:
    """Segment ``k`` (flat slice ``s``) of a flat buffer, or the ``k``-th of per-segment tensors
    (flattened)."""
    return t[s] if isinstance(t, torch.Tensor) else t[k].reshape(-1)


def reference_lamb_frozen_update(
    exchanged: torch.Tensor,
    exp_avg: torch.Tensor,
    denom: Denominator,
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
) -> torch.Tensor:
    """Pure-torch [`lamb_frozen_update`][lightning_onebit.kernels.updates.lamb_frozen_update] (same
    arguments, same results up to rounding).

    The statistics stay on the buffers' device (one tensor, no host sync per layer)."""
    rows = []
    for k, (lo, hi) in enumerate(itertools.pairwise(offsets)):
        if lo == hi:
            rows.append(torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64, device=update.device))
            continue
        x, m, d = exchanged[lo:hi], exp_avg[lo:hi], denom.segment(k, lo, hi - lo)
        vf, u = exp_avg_sq_fresh[lo:hi], update[lo:hi]
        if preconditioned:  # x was exchanged divided by d
            x = torch.mul(x, d)
        m_new = x / scaling[k]
        g = (m_new - beta1[k] * m) / (1 - beta1[k])
        vf.mul_(beta2[k]).addcmul_(g, g, value=1 - beta2[k])
        ratio = (d / (vf.sqrt() + eps[k])).amax()
        torch.div(m_new, d, out=u)
        prelim = u.double().square().sum()
        if weight_decay[k] != 0:
            u.add_(_piece(param, k, slice(lo, hi)), alpha=weight_decay[k])
        m.copy_(m_new)
        rows.append(torch.stack([ratio.double(), prelim, u.double().square().sum()]))
    if not rows:
        return torch.empty(0, 3, dtype=torch.float64, device=update.device)
    return torch.stack(rows)


def reference_layer_step(
    update: torch.Tensor, params: list[torch.Tensor], starts: list[int], alpha: torch.Tensor
) -> None:
    """[`layer_step`][lightning_onebit.kernels.updates.layer_step] as torch ops: ``p.addcmul_(u_j,
    alpha[j])`` for every parameter ``j``, ``u_j`` its values of ``update`` in its shape."""
    for j, (p, lo) in enumerate(zip(params, starts, strict=True)):
        p.addcmul_(update[lo : lo + p.numel()].view_as(p), alpha[j])


def reference_momentum_source(
    exp_avg: torch.Tensor,
    grad: torch.Tensor | Sequence[torch.Tensor | None],
    denom: Denominator | None,
    out: torch.Tensor,
    starts: list[int],
    sizes: list[int],
    beta: list[float],
    alpha: list[float],
) -> None:
    """Pure-torch [`momentum_source`][lightning_onebit.kernels.sources.momentum_source] (same
    arguments; bit for bit on x86 CPUs): ``grad`` a flat buffer or one tensor (``None``: zeros) per
    segment."""
    for k, (lo, n, b, a) in enumerate(zip(starts, sizes, beta, alpha, strict=True)):
        s = slice(lo, lo + n)
        if isinstance(grad, torch.Tensor):
            g = grad[s]
        else:
            g = torch.zeros_like(out[s]) if grad[k] is None else grad[k].reshape(-1)
        torch.mul(exp_avg[s], b, out=out[s]).add_(g, alpha=a)
        if denom is not None:
            out[s].div_(denom.segment(k, lo, n))


def reference_local_source(
    *,
    exp_avg: torch.Tensor,
    grad: torch.Tensor | Sequence[torch.Tensor | None],
    denom: Denominator,
    param: torch.Tensor | Sequence[torch.Tensor] | None,
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
    """Pure-torch [`local_source`][lightning_onebit.kernels.sources.local_source] (same arguments;
    0/1 Adam's torch ops, bit for bit on x86 CPUs): the gradient a flat buffer or one tensor
    (``None``: zeros) per segment, the parameter a flat buffer or one tensor per segment."""
    coefs = zip(starts, sizes, beta, alpha, lr, weight_decay, strict=True)
    for k, (lo, n, b, a, r, w) in enumerate(coefs):
        s = slice(lo, lo + n)
        x = out[s]
        if isinstance(grad, torch.Tensor):
            g = grad[s]
        else:
            g = torch.zeros_like(x) if grad[k] is None else grad[k].reshape(-1)
        torch.mul(exp_avg[s], b, out=x).add_(g, alpha=a)
        d = denom.segment(k, lo, n)
        if preconditioned:
            x.div_(d)
            if param is not None and w > 0:
                x.add_(_piece(param, k, s), alpha=w)
        elif param is not None and w > 0:
            x.addcmul_(_piece(param, k, s), d, value=w)
        x.mul_(-r)
        if acc is not None:
            if preconditioned:
                x.add_(acc[s])
            else:
                x.addcmul_(acc[s], d)


def reference_local_step(
    *,
    exp_avg: torch.Tensor,
    grad: torch.Tensor | Sequence[torch.Tensor | None],
    denom: Denominator,
    acc: torch.Tensor,
    params: list[torch.Tensor],
    starts: list[int],
    beta: list[float],
    alpha: list[float],
    lr: list[float],
    weight_decay: list[float],
) -> bool:
    """Pure-torch [`local_step`][lightning_onebit.kernels.updates.local_step] (same arguments; 0/1
    Adam's torch ops, bit for bit on x86 CPUs): the gradient a flat buffer or one tensor (``None``:
    zeros) per parameter."""
    pieces = []
    for j, p in enumerate(params):
        s = slice(starts[j], starts[j] + p.numel())
        if isinstance(grad, torch.Tensor):
            pieces.append(grad[s])
        else:
            pieces.append(torch.zeros_like(exp_avg[s]) if grad[j] is None else grad[j].reshape(-1))
    if not all(bool(torch.isfinite(g).all()) for g in pieces):
        return False
    for j, (p, g) in enumerate(zip(params, pieces, strict=True)):
        s = slice(starts[j], starts[j] + p.numel())
        exp_avg[s].mul_(beta[j]).add_(g, alpha=alpha[j])
        u = torch.div(exp_avg[s], denom.segment(j, starts[j], p.numel()))
        if weight_decay[j] > 0:
            u.add_(p.detach().reshape(-1).to(torch.float32), alpha=weight_decay[j])
        acc[s].add_(u, alpha=-lr[j])
        torch._foreach_add_([p], [u.view_as(p)], alpha=-lr[j])
    return True


def reference_sync_update(
    *,
    exchanged: torch.Tensor,
    denom: Denominator,
    exp_avg: torch.Tensor,
    synced: torch.Tensor,
    floored: torch.Tensor | None,
    acc: torch.Tensor | None,
    params: list[torch.Tensor],
    starts: list[int],
    lrs: list[float],
    preconditioned: bool,
) -> None:
    """Pure-torch [`sync_update`][lightning_onebit.kernels.updates.sync_update] (same arguments; 0/1
    Adam's torch ops, bit for bit on x86 CPUs)."""
    for j, (p, lo, total) in enumerate(zip(params, starts, lrs, strict=True)):
        s = slice(lo, lo + p.numel())
        d = denom.segment(j, lo, p.numel())
        if preconditioned:
            torch.mul(exchanged[s], d, out=exp_avg[s])
            src = exp_avg[s]
        else:
            src = exchanged[s]
        if total > 0:
            torch.div(src, -total, out=exp_avg[s])
        else:  # no step since the last sync
            exp_avg[s].zero_()
        if floored is not None:
            exp_avg[s].masked_fill_(floored[s], 0.0)
        if preconditioned:
            synced[s].add_(exchanged[s])
        else:
            synced[s].addcdiv_(exchanged[s], d)
        if acc is not None:
            acc[s].zero_()
        p.copy_(synced[s].view_as(p))


def reference_frozen_adam_update(
    ok: torch.Tensor | None,
    exchanged: torch.Tensor,
    exp_avg: torch.Tensor,
    denom: Denominator,
    params: list[torch.Tensor],
    starts: list[int],
    lr: list[float],
    weight_decay: list[float],
    preconditioned: bool,
) -> None:
    """Pure-torch [`frozen_adam_update`][lightning_onebit.kernels.updates.frozen_adam_update] (same
    arguments; with a verdict the step is computed aside and kept with ``torch.where``, no host read
    of ``ok``; without one, ``None``, in place). Its floats are the optimizers' torch ops', bit for
    bit on the CPU."""
    for j, (p, lo, a, w) in enumerate(zip(params, starts, lr, weight_decay, strict=True)):
        s = slice(lo, lo + p.numel())
        d = denom.segment(j, lo, p.numel())
        m_new = torch.mul(exchanged[s], d) if preconditioned else exchanged[s]
        if ok is None:
            exp_avg[s].copy_(m_new)
        else:
            torch.where(ok, m_new, exp_avg[s], out=exp_avg[s])
        x = exchanged[s].view_as(p)
        q = p.detach() if ok is None else p.clone()
        # one-tensor foreach ops: the optimizers' ops, also on CUDA, where torch fuses them
        if w > 0:
            torch._foreach_add_([q], [q], alpha=-a * w)
        if preconditioned:
            torch._foreach_add_([q], [x], alpha=-a)
        else:
            torch._foreach_addcdiv_([q], [x], [d.view_as(p)], value=-a)
        if ok is not None:
            p.copy_(torch.where(ok, q, p))


def reference_restore_unless(ok: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
    """Pure-torch [`restore_unless`][lightning_onebit.kernels.updates.restore_unless] (``ok`` read
    on the host)."""
    if not bool(ok):
        dst.copy_(src)


# ------------------------------------------------------------------ the integer codec (kernels.quantized)


def _encode(
    y: torch.Tensor, bits: int, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``y`` (a multiple of ``block`` values) as ``(scales, codes, error)``: codes packed as on
    the wire."""
    q_max = 7.0 if bits == 4 else 127.0
    yb = y.reshape(-1, block)
    s = _divided(yb.abs().amax(dim=1), q_max)
    coded = (s > 0) & torch.isfinite(s)
    ratio = torch.where(coded[:, None], yb / s[:, None], 0.0)
    q = torch.round(ratio).clamp_(-q_max, q_max)
    err = (yb - s[:, None] * q).reshape(-1)
    qi = q.reshape(-1).to(torch.int32)
    if bits == 8:
        codes = qi.to(torch.int8).view(torch.uint8)
    else:
        u = (qi + 8).to(torch.uint8)
        codes = u[0::2] | (u[1::2] << 4)
    return s, codes, err


def _decode(row: torch.Tensor, m: int, bits: int, block: int) -> torch.Tensor:
    nb = m // block
    s = row[: 4 * nb].view(torch.float32)
    codes = row[4 * nb : 4 * nb + m * bits // 8]
    if bits == 8:
        q = codes.view(torch.int8).float()
    else:
        q = torch.stack([(codes & 15).to(torch.int32) - 8, (codes >> 4).to(torch.int32) - 8], 1)
        q = q.reshape(-1).float()
    return s, q


def _write_row(row: torch.Tensor, s: torch.Tensor, codes: torch.Tensor) -> None:
    nb = s.numel()
    row[: 4 * nb].copy_(s.view(torch.uint8))
    row[4 * nb : 4 * nb + codes.numel()].copy_(codes)


def reference_quantize(
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
    """Pure-torch [`quantize`][lightning_onebit.kernels.quantized.quantize] (same arguments, same
    bits; ``n``: the padded size where ``error`` is ``None``)."""
    error_out = (error if error_out is None else error_out) if write_error else None
    n = error.numel() if error is not None else n
    y = torch.zeros(n, dtype=torch.float32, device=x.device)
    y[: x.numel()] = x.reshape(-1)
    if error is not None:
        y = y + error.reshape(-1)
    w = rows.size(0)
    m = n // w
    s, codes, err = _encode(y, bits, block)
    cb = m * bits // 8
    for j in range(w):
        _write_row(
            rows[j], s[j * (m // block) : (j + 1) * (m // block)], codes[j * cb : (j + 1) * cb]
        )
    if error_out is not None:
        error_out.view(-1).copy_(err)


def reference_quantized_reduce(
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
    """Pure-torch [`quantized_reduce`][lightning_onebit.kernels.quantized.quantized_reduce] (same
    arguments, same bits)."""
    error_out = (error if error_out is None else error_out) if write_error else None
    w = rows.size(0)
    c = torch.zeros(m, dtype=torch.float32, device=rows.device)
    for r in range(w):  # rows in order
        s, q = _decode(rows[r], m, bits, block)
        c += torch.repeat_interleave(_divided(s, w), block) * q
    if error is not None:
        c += error.reshape(-1)
    s, codes, err = _encode(c, bits, block)
    _write_row(out_row.reshape(-1), s, codes)
    if error_out is not None:
        error_out.view(-1).copy_(err)


def reference_dequantize(
    rows: torch.Tensor, out: torch.Tensor, *, m: int, bits: int, block: int
) -> None:
    """Pure-torch [`dequantize`][lightning_onebit.kernels.quantized.dequantize] (same arguments,
    same bits)."""
    values = []
    for j in range(rows.size(0)):
        s, q = _decode(rows[j], m, bits, block)
        values.append(torch.repeat_interleave(s, block) * q)
    out.view(-1).copy_(torch.cat(values)[: out.numel()])
