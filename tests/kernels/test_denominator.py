"""The frozen variance's denominator computed by the kernels as they read ``v``
([Denominator][lightning_onebit.kernels.Denominator]): every kernel that takes one gives, bit for
bit, the floats of its torch twin fed the buffer ``d = sqrt(v) * dscale + eps`` (each operation
rounded on its own), with per-segment ``eps`` and with and without a scale row; on the CPU
(AVX2 and the portable path are compared in ``test_kernels.py``) and on CUDA where there is one.
"""

from __future__ import annotations

import pytest
import torch

from lightning_onebit import kernels as K
from lightning_onebit.kernels import native

#: segment sizes around the 8-value vectors and the kernels' 8192-value blocks
SIZES = [1, 7, 8, 9, 31, 8192 + 5, 3, 20_000]

DEVICES = ["cpu"]
if torch.cuda.is_available() and K.HAS_CUDA:
    DEVICES.append("cuda")

pytestmark = pytest.mark.skipif(not native.HAS_CPP, reason="needs the compiled kernels")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _case(seed: int, scaled: bool, device: str):
    """Fresh random inputs: a variance with exact zeros and tiny values, per-segment eps over
    six decades and (``scaled``) a scale row; returns the Denominator, its d buffer made with
    torch ops, the starts and the sizes."""
    gen = torch.Generator().manual_seed(seed)
    starts = [0]
    for s in SIZES[:-1]:
        starts.append(starts[-1] + s)
    n = starts[-1] + SIZES[-1]
    v = torch.rand(n, generator=gen) ** 4 * 1e-4
    v[::13] = 0.0
    eps = [10 ** (-10 + 6 * a) for a in torch.rand(len(SIZES), generator=gen).tolist()]
    dscale = (0.25 + 2 * torch.rand(len(SIZES), generator=gen)) if scaled else None
    v = v.to(device)
    dscale = None if dscale is None else dscale.to(device)
    den = K.Denominator(v, eps, dscale)
    d = den.write(torch.full_like(v, float("nan")), starts, SIZES)
    return den, d, starts, list(SIZES)


def _torch_d(v: torch.Tensor, eps: list[float], dscale, starts, sizes) -> torch.Tensor:
    """d as the formula says, from scratch: the correctly rounded float32 square root (float64,
    rounded once), times the scale (float32), plus eps (float32), each rounded."""
    d = torch.empty_like(v)
    for k, (lo, n) in enumerate(zip(starts, sizes, strict=True)):
        r = torch.sqrt(v[lo : lo + n].double()).float()
        if dscale is not None:
            r = r * dscale[k]
        d[lo : lo + n] = r + torch.tensor(eps[k], dtype=torch.float32, device=v.device)
    return d


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaled", [False, True])
def test_the_d_buffer_is_the_formula(device: str, scaled: bool) -> None:
    den, d, starts, sizes = _case(1 + scaled, scaled, device)
    assert _same_bits(d, _torch_d(den.exp_avg_sq, den.eps, den.dscale, starts, sizes))
    assert torch.isfinite(d).all() and (d > 0).all()


def _flat_like(d: torch.Tensor, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(d.numel(), generator=gen) * scale).to(d.device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaled", [False, True])
def test_momentum_source_and_its_compression(device: str, scaled: bool) -> None:
    den, d, starts, sizes = _case(3 + scaled, scaled, device)
    m, g = _flat_like(d, 4, 1e-3), _flat_like(d, 5, 1e-3)
    beta, alpha = [0.9] * len(sizes), [0.1] * len(sizes)
    got, want = torch.empty_like(m), torch.empty_like(m)
    K.momentum_source(m, g, den, got, starts, sizes, beta, alpha)
    torch.mul(m, 0.9, out=want)  # the twin's ops, fed the d buffer
    for k, (lo, n) in enumerate(zip(starts, sizes, strict=True)):
        s = slice(lo, lo + n)
        torch.mul(m[s], beta[k], out=want[s]).add_(g[s], alpha=alpha[k]).div_(d[s])
    assert _same_bits(got, want)
    # compressed as read: the bits, scale and error of compressing the written values
    n_pad = -(-m.numel() // 16) * 16
    results = []
    for src in (K.MomentumSource(m, g, den, torch.empty_like(m), starts, sizes, beta, alpha), want):
        e = torch.zeros(n_pad, device=m.device)
        bits = torch.zeros(2, n_pad // 16, dtype=torch.uint8, device=m.device)
        scale = torch.zeros(1, device=m.device)
        K.worker_compress(src, e, bits, scale)
        results.append((e, bits, scale))
    (e1, b1, s1), (e2, b2, s2) = results
    assert _same_bits(e1, e2) and torch.equal(b1, b2) and _same_bits(s1, s2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("preconditioned", [False, True])
def test_local_source(device: str, scaled: bool, preconditioned: bool) -> None:
    den, d, starts, sizes = _case(7 + scaled, scaled, device)
    m, g, p, acc = (_flat_like(d, 8 + i, 1e-2) for i in range(4))
    hp = {
        "beta": [0.9] * len(sizes),
        "alpha": [0.1] * len(sizes),
        "lr": [1e-3 * (k + 1) for k in range(len(sizes))],
        "weight_decay": [0.01 if k % 2 else 0.0 for k in range(len(sizes))],
    }
    args = dict(exp_avg=m, grad=g, param=p, acc=acc, starts=starts, sizes=sizes, **hp,
                preconditioned=preconditioned)  # fmt: skip
    got = torch.empty_like(m)
    K.local_source(denom=den, out=got, **args)
    want = torch.empty_like(m)
    K.reference_local_source(denom=den, out=want, **args)
    assert _same_bits(got, want)
    if device == "cpu":  # the twin fed the d buffer: as the kernel was before it took v
        again = torch.empty_like(m)
        for k, (lo, n) in enumerate(zip(starts, sizes, strict=True)):
            s = slice(lo, lo + n)
            x = torch.mul(m[s], hp["beta"][k], out=again[s]).add_(g[s], alpha=hp["alpha"][k])
            w = hp["weight_decay"][k]
            if preconditioned:
                x.div_(d[s])
                if w > 0:
                    x.add_(p[s], alpha=w)
            elif w > 0:
                x.addcmul_(p[s], d[s], value=w)
            x.mul_(-hp["lr"][k])
            x.add_(acc[s]) if preconditioned else x.addcmul_(acc[s], d[s])
        assert _same_bits(got, again)
    src = K.LocalSource(denom=den, out=torch.empty_like(m), **args)
    n_pad = -(-m.numel() // 16) * 16
    results = []
    for x in (src, want):
        e = torch.zeros(n_pad, device=m.device)
        bits = torch.zeros(2, n_pad // 16, dtype=torch.uint8, device=m.device)
        scale = torch.zeros(1, device=m.device)
        K.worker_compress(x, e, bits, scale)
        results.append((e, bits, scale))
    (e1, b1, s1), (e2, b2, s2) = results
    assert _same_bits(e1, e2) and torch.equal(b1, b2) and _same_bits(s1, s2)


def _params(d: torch.Tensor, starts, sizes, seed: int) -> list[torch.Tensor]:
    flat = _flat_like(d, seed, 0.1)
    return [flat[lo : lo + n].clone() for lo, n in zip(starts, sizes, strict=True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("preconditioned", [False, True])
def test_frozen_adam_update(device: str, scaled: bool, preconditioned: bool) -> None:
    den, d, starts, sizes = _case(11 + scaled, scaled, device)
    x = _flat_like(d, 12, 1e-3)
    lr = [1e-3 * (k + 1) for k in range(len(sizes))]
    wd = [0.01 if k % 2 else 0.0 for k in range(len(sizes))]
    ok = torch.ones(1, dtype=torch.bool, device=device) if device == "cuda" else None
    outs = []
    for fn in (K.frozen_adam_update, K.reference_frozen_adam_update):
        m, ps = torch.zeros_like(x), _params(d, starts, sizes, 13)
        fn(ok, x, m, den, ps, starts, lr, wd, preconditioned)
        outs.append((m, ps))
    (m1, p1), (m2, p2) = outs
    assert _same_bits(m1, m2)
    assert all(_same_bits(a, b) for a, b in zip(p1, p2, strict=True))
    if preconditioned:  # m = x * d, d the buffer's
        assert _same_bits(m1, x * d)


@pytest.mark.parametrize("scaled", [False, True])
def test_local_step(scaled: bool) -> None:
    den, d, starts, sizes = _case(17 + scaled, scaled, "cpu")
    g = _flat_like(d, 18, 1e-3)
    hp = {
        "beta": [0.9] * len(sizes),
        "alpha": [0.1] * len(sizes),
        "lr": [1e-3 * (k + 1) for k in range(len(sizes))],
        "weight_decay": [0.01 if k % 2 else 0.0 for k in range(len(sizes))],
    }
    outs = []
    for fn in (K.local_step, K.reference_local_step):
        m, acc = _flat_like(d, 19, 1e-3), _flat_like(d, 20, 1e-3)
        ps = _params(d, starts, sizes, 21)
        assert fn(exp_avg=m, grad=g, denom=den, acc=acc, params=ps, starts=starts, **hp)
        outs.append((m, acc, ps))
    (m1, a1, p1), (m2, a2, p2) = outs
    assert _same_bits(m1, m2) and _same_bits(a1, a2)
    assert all(_same_bits(a, b) for a, b in zip(p1, p2, strict=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("preconditioned", [False, True])
def test_sync_update(device: str, scaled: bool, preconditioned: bool) -> None:
    den, d, starts, sizes = _case(23 + scaled, scaled, device)
    x = _flat_like(d, 24, 1e-3)
    lrs = [1e-3 * k for k in range(len(sizes))]  # (the first: no step since the last sync)
    floored = torch.zeros(x.numel(), dtype=torch.bool, device=device)
    floored[::17] = True
    outs = []
    for fn in (K.sync_update, K.reference_sync_update):
        m, synced, acc = torch.zeros_like(x), _flat_like(d, 25, 0.1), _flat_like(d, 26)
        ps = _params(d, starts, sizes, 27)
        fn(exchanged=x, denom=den, exp_avg=m, synced=synced, floored=floored, acc=acc,
           params=ps, starts=starts, lrs=lrs, preconditioned=preconditioned)  # fmt: skip
        outs.append((m, synced, acc, ps))
    for a, b in zip(outs[0][:3], outs[1][:3], strict=True):
        assert _same_bits(a, b)
    assert all(_same_bits(a, b) for a, b in zip(outs[0][3], outs[1][3], strict=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("preconditioned", [False, True])
def test_lamb_frozen_update(device: str, scaled: bool, preconditioned: bool) -> None:
    den, d, starts, sizes = _case(29 + scaled, scaled, device)
    offsets = [*starts, starts[-1] + sizes[-1]]
    x = _flat_like(d, 30, 1e-3)
    hp = {
        "scaling": [0.5 + 0.1 * k for k in range(len(sizes))],
        "beta1": [0.9] * len(sizes),
        "beta2": [0.99] * len(sizes),
        "eps": den.eps,
        "weight_decay": [0.0] * len(sizes),
    }
    m, vf, u = _flat_like(d, 31, 1e-3), _flat_like(d, 32).abs_() * 1e-6, torch.empty_like(x)
    stats = K.lamb_frozen_update(x, m.clone(), den, vf.clone(), None, u, offsets, **hp,
                                 preconditioned=preconditioned)  # fmt: skip
    # u = m_new / d with m_new = x (times d) / scaling, each rounded: the d buffer's floats
    for k, (lo, n) in enumerate(zip(starts, sizes, strict=True)):
        s = slice(lo, lo + n)
        xs = x[s] * d[s] if preconditioned else x[s]
        m_new = xs / torch.full_like(xs, hp["scaling"][k])
        assert _same_bits(u[s], m_new / d[s]), k
    ref = K.reference_lamb_frozen_update(x, m.clone(), den, vf.clone(), None, torch.empty_like(x),
                                         offsets, **hp,
                                         preconditioned=preconditioned)  # fmt: skip
    torch.testing.assert_close(stats, ref, rtol=1e-5, atol=0.0)


def test_denominator_checks() -> None:
    v = torch.ones(8)
    with pytest.raises(ValueError, match="one value per segment"):
        K.Denominator(v, [1e-8, 1e-8], torch.ones(3))
    with pytest.raises(TypeError, match="float32"):
        K.Denominator(v.double(), [1e-8])
    with pytest.raises(TypeError, match="Denominator"):
        K.frozen_adam_update(None, v, v.clone(), v, [v.clone()], [0], [1e-3], [0.0], False)
    with pytest.raises(ValueError, match="one value per parameter"):
        K.frozen_adam_update(
            None,
            v,
            v.clone(),
            K.Denominator(v, [1e-8, 1e-8]),
            [v.clone()],
            [0],
            [1e-3],
            [0.0],
            False,
        )
