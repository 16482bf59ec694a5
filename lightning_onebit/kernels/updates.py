"""The optimizers' fused updates: Adam's step
([`adam_update`][lightning_onebit.kernels.updates.adam_update]), the compression-phase steps after
the exchange ([`frozen_adam_update`][lightning_onebit.kernels.updates.frozen_adam_update],
[`lamb_frozen_update`][lightning_onebit.kernels.updates.lamb_frozen_update] with
[`layer_step`][lightning_onebit.kernels.updates.layer_step],
[`sync_update`][lightning_onebit.kernels.updates.sync_update]), 0/1 Adam's local step
([`local_step`][lightning_onebit.kernels.updates.local_step]), and
[`restore_unless`][lightning_onebit.kernels.updates.restore_unless] for a step that must change
nothing."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from lightning_onebit.kernels import native
from lightning_onebit.kernels.checks import check_params_fit, check_per_segment, check_segments
from lightning_onebit.kernels.compression import decode_runs
from lightning_onebit.kernels.denominator import Denominator, denominator_checks
from lightning_onebit.kernels.reference import (
    reference_adam_update,
    reference_frozen_adam_update,
    reference_lamb_frozen_update,
    reference_layer_step,
    reference_local_step,
    reference_restore_unless,
    reference_sync_update,
)
from lightning_onebit.kernels.runs import SignRuns

__all__ = [
    "adam_update",
    "frozen_adam_update",
    "lamb_frozen_update",
    "layer_step",
    "local_step",
    "reads_sign_runs",
    "restore_unless",
    "sync_update",
]


def reads_sign_runs(device: torch.device) -> bool:
    """Whether the update kernels on ``device`` read an exchange's result where it lies, as
    [SignRuns][lightning_onebit.kernels.SignRuns] (the compiled CPU kernels), so that it need
    not be decoded into a buffer first; elsewhere they take the decoded values."""
    return device.type == "cpu" and native.use_native()


def adam_update(
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
    ok: torch.Tensor | None = None,
) -> None:
    """Adam's step without bias correction, moments and parameters in one sweep.

    Parameter ``j`` holds the flat values ``starts[j]:starts[j] + params[j].numel()`` of
    ``exp_avg`` (``m``) and ``exp_avg_sq`` (``v``), and of ``grad`` (``g``) where it is a flat
    buffer; per value, with its hyperparameters::

        m <- beta1 * m + (1 - beta1) * g
        v <- beta2 * v + (1 - beta2) * g**2          (only if update_variance)
        p <- p - lr * (m / (sqrt(v) + eps) + weight_decay * p)

    This is 1-bit Adam's warmup step and 0/1 Adam's variance-phase step. In torch it is ~17
    sweeps over the buffers (reading or writing one each); the C++ kernel reads 4 and writes 3.
    The gradient is a flat buffer indexed like the moments, or one tensor per parameter: each
    parameter's ``.grad`` where autograd left it, so that nothing copies the gradients into a
    flat buffer first (both kernels read each parameter's gradient from its own pointer; both
    forms are the same call, the same floats). A parameter given ``None`` reads zeros, with the
    floats a buffer of zeros gives.
    On CUDA tensors the CUDA kernel runs on the current stream (no host synchronisation) and
    writes the CPU kernel's values bit for bit. Calls with a parameter that is not an fp32,
    contiguous tensor take the pure-torch path
    ([`reference_adam_update`][lightning_onebit.kernels.reference.reference_adam_update]) on either
    device, as do CUDA tensors when the build has no CUDA kernels.

    Args:
        exp_avg, exp_avg_sq: float32, contiguous, one device, covering every parameter.
        grad: like them (a flat buffer), or a sequence with one entry per parameter: ``None``
            (zeros) or a float32 contiguous tensor of that parameter's number of values (any
            shape) on their device.
        params: the parameters, updated in place (any float dtype).
        starts: each parameter's first flat index.
        lr, beta1, beta2, eps, weight_decay: one value per parameter.
        ok: ``None``, or a one-element bool tensor on the buffers' device (a step's NaN/Inf
            verdict): when it is false nothing is written. The CUDA kernel reads it on the
            device; CUDA tensors on the pure-torch path compute the step aside and keep it
            with ``torch.where`` (no host synchronisation either); on the CPU it is read on
            the host.

    Raises:
        TypeError, ValueError: a tensor of another dtype, not contiguous, on another device, a
            parameter that does not fit, a per-parameter gradient of another size; lists of
            other lengths.
    """
    args = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    device, named = native.check("adam_update", **args, grad=grad, ok=ok)
    n = len(params)
    hp = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay}
    for name, vals in (("starts", starts), *hp.items()):
        if len(vals) != n:
            raise ValueError(f"{name} must have one value per parameter ({n}), got {len(vals)}")
    check_params_fit(params, starts, min(t.numel() for _, t in named), device)
    sizes = [p.numel() for p in params]
    grads = check_per_segment("grad", grad, starts, sizes, device, missing=True)
    fast = native.has_kernel(device) and all(
        p.dtype == torch.float32 and p.is_contiguous() for p in params
    )
    if ok is not None:
        if device.type != "cuda":  # a host read: free off the GPU
            if not bool(ok):
                return
            ok = None
        elif (
            not fast or not native.use_native()
        ):  # the torch path: the step aside, then kept or not
            m, v, ps = exp_avg.clone(), exp_avg_sq.clone(), [p.clone() for p in params]
            reference_adam_update(grads, m, v, ps, starts, **hp, update_variance=update_variance)
            torch.where(ok, m, exp_avg, out=exp_avg)
            torch.where(ok, v, exp_avg_sq, out=exp_avg_sq)
            for p, q in zip(params, ps, strict=True):
                p.copy_(torch.where(ok, q, p))
            return
    if not fast or not native.use_native():
        reference_adam_update(grads, exp_avg, exp_avg_sq, params, starts, **hp,
                              update_variance=update_variance)  # fmt: skip
        return
    # 1 - beta in double, then rounded: 1 - float32(0.999) is 1.3e-5 (relative) off 0.001
    ob1, ob2 = [1 - b for b in beta1], [1 - b for b in beta2]
    coefs = {"lr": lr, "beta1": beta1, "ob1": ob1, "beta2": beta2, "ob2": ob2, "eps": eps}
    pointers = {"params": params, "grads": grads}
    table = native.segment_table(starts, sizes, pointers, {**coefs, "wd": weight_decay})
    native.launch("adam_update", device, table, ok=ok, **args, update_variance=update_variance)
    # written through raw pointers: tell autograd, as an in-place torch op would (a graph that
    # saved a parameter then fails loudly in backward instead of using the new values).
    # One tensor per call: torch < 2.4 takes no list.
    for p in params:
        torch.autograd.graph.increment_version(p)


def frozen_adam_update(
    ok: torch.Tensor | None,
    exchanged: torch.Tensor | SignRuns,
    exp_avg: torch.Tensor,
    denom: Denominator,
    params: list[torch.Tensor],
    starts: list[int],
    lr: list[float],
    weight_decay: list[float],
    preconditioned: bool,
) -> None:
    """1-bit Adam's compression-phase step after the exchange, written only if ``ok``.

    Parameter ``j`` holds the flat values ``starts[j]:starts[j] + params[j].numel()`` of
    ``exchanged`` (``x``, the exchange's result), ``exp_avg`` (``m``) and the frozen variance of
    ``denom`` (a [Denominator][lightning_onebit.kernels.Denominator] with one ``eps`` per
    parameter: ``d = sqrt(v) + eps``, computed as the kernel reads ``v``); per value::

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
    variance, eps = denominator_checks(denom)
    args = {"exchanged": exchanged, "exp_avg": exp_avg, "exp_avg_sq": variance}
    device, named = native.check("frozen_adam_update", **args, ok=ok)
    n = len(params)
    per_param = (("starts", starts), ("lr", lr), ("weight_decay", weight_decay), *eps.items())
    for name, vals in per_param:
        if len(vals) != n:
            raise ValueError(f"{name} must have one value per parameter ({n}), got {len(vals)}")
    check_params_fit(params, starts, min(t.numel() for _, t in named), device)
    if runs is not None:
        runs.check_covers([(a, a + p.numel()) for a, p in zip(starts, params, strict=True)], device)
    if device.type == "cpu" and ok is not None:  # a host read: free off the GPU
        if not bool(ok):
            return
        ok = None
    kernel = device.type == "cpu" or (device.type == "cuda" and native.HAS_CUDA and ok is not None)
    if (
        kernel
        and native.use_native()
        and all(p.dtype == torch.float32 and p.is_contiguous() for p in params)
    ):
        # -lr and -lr * wd in double, then rounded: the alphas the torch path passes; on the
        # CPU +0.0 (no decay step at all) where weight_decay is not positive, as it skips it
        cuda = device.type == "cuda"
        nlw = [-a * w if w > 0 or cuda else 0.0 for a, w in zip(lr, weight_decay, strict=True)]
        coefs = {"nlr": [-a for a in lr], "nlw": nlw, **native.denominator_coefs(denom)}
        table = native.param_table(params, starts, coefs)
        native.launch("frozen_adam_update", device, table, ok=ok, exchanged=exchanged,
                      exp_avg=exp_avg, **native.denominator_args(denom),
                      precond=preconditioned)  # fmt: skip
        for p in params:  # written through raw pointers: see adam_update
            torch.autograd.graph.increment_version(p)
        return
    if runs is not None:
        exchanged = decode_runs(runs, torch.zeros_like(exp_avg))
    reference_frozen_adam_update(
        ok, exchanged, exp_avg, denom, params, starts, lr, weight_decay, preconditioned
    )


def lamb_frozen_update(
    exchanged: torch.Tensor | SignRuns,
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
    ok: torch.Tensor | None = None,
) -> torch.Tensor:
    """1-bit LAMB's compression-phase update after the exchange: one sweep over flat buffers.

    Layer ``k`` holds the values ``offsets[k]:offsets[k + 1]``; per value, with that layer's
    hyperparameters (``x = exchanged``, ``m = exp_avg``, ``d = sqrt(v) + eps`` of the frozen
    variance, computed from ``denom`` as the kernel reads ``v``, ``v_fresh = exp_avg_sq_fresh``,
    ``p = param``, ``u = update``)::

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
    ([`reference_lamb_frozen_update`][lightning_onebit.kernels.reference.reference_lamb_frozen_update]).

    Args:
        exchanged, exp_avg, exp_avg_sq_fresh, update: float32, contiguous, one device,
            at least ``offsets[-1]`` values each; ``exchanged`` may be
            [`SignRuns`][lightning_onebit.kernels.runs.SignRuns] holding every layer's values (CPU
            buffers).
        denom: a [Denominator][lightning_onebit.kernels.Denominator] of the layers (its
            ``exp_avg_sq`` like ``exp_avg``), its ``eps`` the layers' ``eps``.
        param: like them (a flat buffer), or one float32 contiguous tensor per layer of its
            ``offsets[k + 1] - offsets[k]`` values (any shape) on their device: each layer's
            parameter where it lies, read by both kernels from its own pointer, so that
            nothing copies the parameters into a flat buffer first; ``None`` when every
            ``weight_decay`` is 0.
        offsets: ``L + 1`` non-decreasing offsets.
        scaling, beta1, beta2, eps, weight_decay: ``L`` values each (``0 <= beta < 1``).
        preconditioned: ``x`` was exchanged divided by ``d``: the call scales it back first,
            ``x * d`` rounded to float32, as it reads ``x`` (``exchanged`` unchanged).
        ok: ``None``, or a one-element bool tensor on the buffers' device (an exchange's
            verdict, see [`CompressedAllreduce`][lightning_onebit.comm.flat.CompressedAllreduce]):
            when it is false the call writes ``u = 0`` and statistics ``1, 0, 0`` and leaves ``m``
            and ``v_fresh`` as they were, so ``p - lr * coeff * u`` leaves ``p`` as it was. On CUDA
            the kernel reads it on the device (no host synchronisation); elsewhere it is read
            on the host.
    """
    runs = exchanged if isinstance(exchanged, SignRuns) else None
    variance, _ = denominator_checks(denom)
    device, named = native.check("lamb_frozen_update", exchanged=exchanged, exp_avg=exp_avg,
                                 exp_avg_sq=variance, exp_avg_sq_fresh=exp_avg_sq_fresh,
                                 update=update, param=param, ok=ok)  # fmt: skip
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
    if denom.eps != [float(e) for e in eps]:
        raise ValueError("denom.eps must be the layers' eps (the kernel computes d with them)")
    if param is None and any(w != 0 for w in weight_decay):
        raise ValueError("param is required when a weight_decay is non-zero")
    starts, sizes = offsets[:-1], [b - a for a, b in itertools.pairwise(offsets)]
    params = None if param is None else check_per_segment("param", param, starts, sizes, device)
    if runs is not None:
        runs.check_covers([(offsets[0], offsets[-1])] if offsets else [], device)
        if not native.use_native():
            exchanged = decode_runs(runs, torch.zeros_like(exp_avg))
    on_gpu = device.type == "cuda" and native.HAS_CUDA and native.use_native()
    if ok is not None and not on_gpu and not bool(ok):  # a host read: free off the GPU
        update[: offsets[-1] if offsets else 0].zero_()
        stats = torch.zeros(n_layers, 3, dtype=torch.float64, device=device)
        stats[:, 0] = 1.0
        return stats
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
            preconditioned=preconditioned,
        )
    ob1, ob2 = [1 - b for b in beta1], [1 - b for b in beta2]  # in double, then rounded
    coefs = {"scaling": scaling, "beta1": beta1, "ob1": ob1, "beta2": beta2, "ob2": ob2}
    table = native.Table(sizes, {"params": params}, {"offsets": offsets},
                         {**coefs, "eps": eps, "wd": weight_decay})  # fmt: skip
    stats = torch.empty(n_layers, 3, dtype=torch.float64, device=device)
    if n_layers:
        native.launch("lamb_frozen_update", device, table, ok=ok, exchanged=exchanged,
                      exp_avg=exp_avg, exp_avg_sq=variance, dscale=denom.dscale,
                      exp_avg_sq_fresh=exp_avg_sq_fresh,
                      update=update, precond=preconditioned, stats=stats)  # fmt: skip
    return stats


def layer_step(
    update: torch.Tensor, params: list[torch.Tensor], starts: list[int], alpha: torch.Tensor
) -> None:
    """``p_j += alpha[j] * u_j`` for every parameter ``j``, ``u_j`` its values
    ``update[starts[j] : starts[j] + p_j.numel()]``: 1-bit LAMB's per-layer step on a GPU,
    ``alpha[j] = -lr_j * coeff_j`` computed on the device.

    On CUDA with fp32 contiguous parameters one kernel steps every parameter, where torch
    launches one per parameter, and writes the floats of ``p.addcmul_(u_j, alpha[j])``
    ([`reference_layer_step`][lightning_onebit.kernels.reference.reference_layer_step]; on CUDA one
    fused multiply-add per value) bit for bit. Elsewhere those torch ops run.

    Args:
        update: float32, contiguous.
        params: the parameters, on ``update``'s device.
        starts: per parameter, the offset of its values in ``update``.
        alpha: float32, contiguous, one value per parameter, on ``update``'s device (never read
            on the host: no synchronisation).

    Raises:
        TypeError, ValueError: on a wrong dtype, device, size or layout.
    """
    device, _ = native.check("layer_step", update=update, alpha=alpha)
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
        table = native.param_table(params, starts, {})
        native.launch("layer_step", device, table, update=update, alpha=alpha)
        for p in params:  # written through raw pointers: see adam_update
            torch.autograd.graph.increment_version(p)
        return
    reference_layer_step(update, params, starts, alpha)


def local_step(
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
    """0/1 Adam's local step (no exchange) in one sweep, taken only if every gradient value is
    finite; returns whether it was (nothing changes otherwise: the rank sits the step out).
    Parameter ``j`` holds the flat values ``starts[j]:starts[j] + params[j].numel()`` and has
    the coefficients ``beta[j]``, ``alpha[j]``, ``lr[j]`` and ``weight_decay[j]``. Per value, as
    the optimizer's torch ops::

        exp_avg = beta * exp_avg + alpha * grad       (mul_(beta).add_(g, alpha=alpha))
        u = exp_avg / d + weight_decay * p            (the decay only where weight_decay > 0)
        acc = acc - lr * u;  p = p - lr * u

    The gradient is a flat buffer or one tensor per parameter (``None``: zeros), as
    [`momentum_source`][lightning_onebit.kernels.sources.momentum_source]'s. On the CPU, with fp32
    contiguous parameters, the C++ kernel checks the gradients, then makes the one sweep (reads 5
    buffers, writes 3, where the torch ops make five sweeps and a copy of the parameters) with the
    torch ops' floats bit for bit; otherwise the torch ops run
    ([`reference_local_step`][lightning_onebit.kernels.reference.reference_local_step]).

    Args:
        exp_avg, acc: float32, contiguous, one device, covering every parameter: the
            momentum and the momentum accumulator.
        denom: a [Denominator][lightning_onebit.kernels.Denominator] with one ``eps`` per
            parameter: ``d = sqrt(v) + eps``, computed as the kernel reads ``v``.
        grad: like them (a flat buffer), or one entry per parameter (``None``: zeros).
        params: the parameters, updated in place.
        starts: each parameter's first flat index.
        beta, alpha, lr, weight_decay: one value per parameter.

    Raises:
        TypeError, ValueError: a tensor of another dtype, not contiguous, on another device, a
            parameter that does not fit or a gradient of another size; coefficient lists of
            other lengths.
    """
    variance, eps = denominator_checks(denom)
    device, named = native.check("local_step", exp_avg=exp_avg, exp_avg_sq=variance, acc=acc,
                                 grad=grad)  # fmt: skip
    sizes = [p.numel() for p in params]
    per_segment = {"sizes": sizes, "beta": beta, "alpha": alpha, "lr": lr,
                   "weight_decay": weight_decay, **eps}  # fmt: skip
    check_segments(named, starts, per_segment)
    check_params_fit(params, starts, min(t.numel() for _, t in named), device)
    grads = check_per_segment("grad", grad, starts, sizes, device, missing=True)
    if (
        device.type != "cpu"
        or not native.use_native()
        or not all(p.dtype == torch.float32 and p.is_contiguous() for p in params)
    ):
        return reference_local_step(exp_avg=exp_avg, grad=grads, denom=denom, acc=acc,
                                    params=params, starts=starts, beta=beta, alpha=alpha, lr=lr,
                                    weight_decay=weight_decay)  # fmt: skip
    # the decay's factor (+0.0: none, as the torch ops skip it) and -lr, rounded from double
    wd = [w if w > 0 else 0.0 for w in weight_decay]
    coefs = {"beta": beta, "alpha": alpha, "wd": wd, "nlr": [-a for a in lr],
             **native.denominator_coefs(denom)}  # fmt: skip
    table = native.segment_table(starts, sizes, {"grads": grads, "params": params}, coefs)
    ran = native.launch("local_step", device, table, exp_avg=exp_avg,
                        **native.denominator_args(denom), acc=acc)  # fmt: skip
    if not ran:
        return False
    for p in params:  # written through raw pointers: see adam_update
        torch.autograd.graph.increment_version(p)
    return True


def sync_update(
    *,
    exchanged: torch.Tensor | SignRuns,
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
    """0/1 Adam's update after a sync step's exchange, one sweep over flat buffers. Parameter
    ``j``'s values start at ``starts[j]``. Per value, as the optimizer's torch ops::

        exp_avg = (exchanged * d if preconditioned else exchanged) / -lrs
                  (0 where lrs <= 0, or floored is true: masked_fill_)
        synced += exchanged if preconditioned else exchanged / d         (add_, addcdiv_)
        p = synced;  acc = 0  (where acc is given)

    One sweep where the torch ops make five or more, writing torch's floats bit for bit on the
    same device: on the CPU the C++ kernel, on CUDA the CUDA kernel on the current stream (no
    host synchronisation), with the roundings of torch's CUDA kernels (its division by ``-lrs``
    is a multiplication by the reciprocal, taken in double and rounded to float). The kernel
    writes the parameters itself when every one is fp32 and contiguous, else they are copied
    from ``synced`` after it (cast to their dtype). Without a compiled kernel for the device
    the torch ops run
    ([`reference_sync_update`][lightning_onebit.kernels.reference.reference_sync_update]).

    Args:
        exchanged: the averaged accumulator, read only: float32, contiguous, covering every
            parameter; or [`SignRuns`][lightning_onebit.kernels.runs.SignRuns] holding every
            parameter's values (CPU buffers).
        denom: a [Denominator][lightning_onebit.kernels.Denominator] with one ``eps`` per
            parameter (its ``exp_avg_sq`` like ``exchanged``): ``d = sqrt(v) + eps``, computed as
            the kernel reads ``v``.
        exp_avg: like it: the momentum, written.
        synced: like it: the synchronised parameters (fp32), written.
        floored: bool, contiguous, as long: where the momentum is 0; or ``None``.
        acc: like ``exp_avg``: the momentum accumulator, cleared; or ``None`` (left as it is).
        params: the parameters, written.
        starts: each parameter's first flat index.
        lrs: per parameter the learning rate summed since the last sync.
        preconditioned: ``exchanged`` is in parameter units (divided by ``d``).

    Raises:
        TypeError, ValueError: a tensor of another dtype, not contiguous, on another device,
            or a parameter that does not fit; ``lrs`` of another length.
    """
    variance, eps = denominator_checks(denom)
    args = {"exchanged": exchanged, "exp_avg": exp_avg, "synced": synced}
    runs = exchanged if isinstance(exchanged, SignRuns) else None
    device, named = native.check("sync_update", **args, exp_avg_sq=variance, acc=acc,
                                 floored=floored)  # fmt: skip
    if len(starts) != len(params) or len(lrs) != len(params) or len(eps["eps"]) != len(params):
        raise ValueError(
            f"starts, lrs and denom.eps must have one value per parameter ({len(params)})"
        )
    check_params_fit(params, starts, min(t.numel() for _, t in named), device)
    if runs is not None:
        runs.check_covers([(a, a + p.numel()) for a, p in zip(starts, params, strict=True)], device)
    if not native.has_kernel(device) or not native.use_native():
        if runs is not None:
            exchanged = decode_runs(runs, torch.zeros_like(exp_avg))
        reference_sync_update(exchanged=exchanged, denom=denom, exp_avg=exp_avg, synced=synced,
                              floored=floored, acc=acc, params=params, starts=starts, lrs=lrs,
                              preconditioned=preconditioned)  # fmt: skip
        return
    direct = all(p.dtype == torch.float32 and p.is_contiguous() for p in params)
    # m's divisor -lrs rounded from double (the CPU's torch path), or on CUDA the reciprocal its
    # division multiplies by, 1.0 / -lrs taken in double and rounded once (overflow: -inf, as
    # torch's cast); +0.0 (the kernels' "m = 0", no step taken) where lrs <= 0
    if device.type == "cuda":
        coefs = {"inv": [1.0 / -a if a > 0 else 0.0 for a in lrs]}
    else:
        coefs = {"nl": [-a if a > 0 else 0.0 for a in lrs]}
    coefs.update(native.denominator_coefs(denom))
    table = native.param_table(params, starts, coefs, pointers=direct)
    native.launch("sync_update", device, table, **args, **native.denominator_args(denom),
                  acc=acc, floored=floored, precond=preconditioned)  # fmt: skip
    if direct:
        for p in params:  # written through raw pointers: see adam_update
            torch.autograd.graph.increment_version(p)
    else:
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
    device, _ = native.check("restore_unless", dst=dst, src=src, ok=ok)
    if device.type == "cuda" and native.HAS_CUDA:
        native.launch("restore_unless", device, ok=ok, dst=dst, src=src)
    else:
        reference_restore_unless(ok, dst, src)
