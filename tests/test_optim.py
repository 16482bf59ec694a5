"""Single-process tests of the 1-bit optimizers, and the references the multi-process tests use.

The references below are written straight from the update rules (DESIGN.md §3), one parameter
at a time, in float64, and share no code with ``lightning_onebit.optim``. The compression is
simulated here too (two-stage, error-compensated, DESIGN.md §2), for any number of ranks, so the
same simulation checks ``W = 1`` here and ``W = 2, 4`` in ``test_optim_dist.py``.
"""

from __future__ import annotations

import copy
import io
import math
import subprocess
import sys
import warnings

import pytest
import torch

from lightning_onebit.comm import NonFiniteError
from lightning_onebit.optim import OneBitAdam, OneBitLamb, ZeroOneAdam

# --------------------------------------------------------------------------- the test problem
#
# Five parameters in two groups; one is frozen (requires_grad=False) and one has grad=None on
# some steps (on some ranks). Gradients are a deterministic function of (rank, step, parameter,
# current value), so the implementation (float32) and the simulation (float64) see the same
# problem.

SHAPES = [(6, 5), (5,), (4,), (3, 4), (7,)]
FROZEN = 2  # index of the requires_grad=False parameter
SOMETIMES_NONE = 4  # index of the parameter whose grad is None on some steps
GROUPS = [  # parameter indices, hyperparameter overrides
    ([0, 1], {"lr": 0.01, "weight_decay": 0.0}),
    ([2, 3, 4], {"lr": 0.02, "weight_decay": 0.1}),
]
TRAINABLE = [k for idx, _ in GROUPS for k in idx if k != FROZEN]  # flat layout order


def initial_params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]


def _targets() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]


TARGETS = _targets()


def grad_of(rank: int, step: int, k: int, p: torch.Tensor) -> torch.Tensor | None:
    """Rank ``rank``'s gradient of parameter ``k`` at step ``step`` (float64), or None."""
    if k == SOMETIMES_NONE and (step + rank) % 5 == 0:
        return None
    g = torch.Generator().manual_seed(100_000 * step + 100 * rank + k)
    noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
    return (p.double() - TARGETS[k]) * (0.5 + 0.3 * k) + 0.5 * noise + 0.2 * (rank - 1.5)


def make_params() -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(t.float()) for t in initial_params()]
    params[FROZEN].requires_grad_(False)
    return params


def make_groups(params: list[torch.nn.Parameter], **extra: dict) -> list[dict]:
    return [
        {"params": [params[k] for k in idx], **hp, **extra.get(str(i), {})}
        for i, (idx, hp) in enumerate(GROUPS)
    ]


def set_grads(params: list[torch.nn.Parameter], rank: int, step: int) -> None:
    for k, p in enumerate(params):
        if not p.requires_grad:
            continue
        g = grad_of(rank, step, k, p.detach())
        p.grad = None if g is None else g.float()


def flat_trainable(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([params[k].detach().double().reshape(-1) for k in TRAINABLE])


def hparams_of(k: int) -> dict:
    for idx, hp in GROUPS:
        if k in idx:
            return hp
    raise KeyError(k)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# --------------------------------------------------------------------------- simulated 1-bit exchange


class SimExchange:
    """All W ranks of the error-compensated two-stage 1-bit allreduce, in float64."""

    def __init__(self, n: int, world: int) -> None:
        self.n, self.w = n, world
        self.n_pad = -(-n // (8 * world)) * 8 * world
        self.m = self.n_pad // world
        self.reset()

    def reset(self) -> None:
        self.worker_err = [torch.zeros(self.n_pad, dtype=torch.float64) for _ in range(self.w)]
        self.server_err = [torch.zeros(self.m, dtype=torch.float64) for _ in range(self.w)]

    def __call__(self, xs: list[torch.Tensor]) -> torch.Tensor:
        w, m = self.w, self.m
        signs, scales = [], []
        for i, x in enumerate(xs):  # stage 1: every worker compresses its whole buffer
            y = self.worker_err[i].clone()
            y[: self.n] += x
            s = y.norm() / math.sqrt(self.n_pad)
            sign = torch.where(y >= 0, 1.0, -1.0).double()
            self.worker_err[i] = y - s * sign
            signs.append(sign)
            scales.append(s)
        out = torch.empty(self.n_pad, dtype=torch.float64)
        for j in range(w):  # stage 2: rank j averages chunk j and compresses it again
            c = sum(scales[i] / w * signs[i][j * m : (j + 1) * m] for i in range(w))
            c = c + self.server_err[j]
            s = c.norm() / math.sqrt(m)
            sign = torch.where(c >= 0, 1.0, -1.0).double()
            self.server_err[j] = c - s * sign
            out[j * m : (j + 1) * m] = s * sign
        return out[: self.n]


def _split(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, o = [], 0
    for t in like:
        out.append(flat[o : o + t.numel()].view_as(t).clone())
        o += t.numel()
    return out


def _local_grads(
    world: int, step: int, params: list[list[torch.Tensor]]
) -> list[list[torch.Tensor]]:
    """Per rank, per trainable parameter (zeros where the gradient is None)."""
    out = []
    for r in range(world):
        gs = []
        for j, k in enumerate(TRAINABLE):
            g = grad_of(r, step, k, params[r][j])
            gs.append(torch.zeros_like(params[r][j]) if g is None else g)
        out.append(gs)
    return out


def _mean(grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    w = len(grads)
    return [sum(grads[r][j] for r in range(w)) / w for j in range(len(grads[0]))]


def _start(world: int):
    p0 = initial_params()
    params = [[p0[k].clone() for k in TRAINABLE] for _ in range(world)]
    zeros = lambda: [[torch.zeros_like(t) for t in params[0]] for _ in range(world)]  # noqa: E731
    hp = [hparams_of(k) for k in TRAINABLE]
    n = sum(t.numel() for t in params[0])
    return params, zeros, hp, n


def _group_of(j: int) -> int:
    """Param group of the ``j``-th trainable parameter."""
    return next(i for i, (idx, _) in enumerate(GROUPS) if TRAINABLE[j] in idx)


def _floor_(v: list[list[torch.Tensor]], floor: float) -> None:
    """Every rank's variance raised to ``floor**2`` times the larger of its tensor's mean
    variance and its group's."""
    for gi in range(len(GROUPS)):
        js = [j for j in range(len(v[0])) if _group_of(j) == gi]
        group = float(torch.cat([v[0][j].reshape(-1) for j in js]).mean()) * floor**2
        for j in js:
            low = max(float(v[0][j].mean()) * floor**2, group)
            for vr in v:
                vr[j] = vr[j].clamp(min=low)


def simulate_onebit_adam(
    world: int,
    steps: int,
    freeze_step: int,
    lrs=None,
    betas=(0.9, 0.999),
    eps=1e-8,
    bias_correction: bool = False,
    floor: float = 0.0,
    preconditioned: bool = False,
) -> list[list[torch.Tensor]]:
    """Rank-by-rank 1-bit Adam; returns the flat parameters of every rank after every step.

    ``bias_correction``: Adam's in warmup, folded into m and v at the freeze; ``floor``: the
    frozen variance raised to ``floor**2`` times its group's mean; ``preconditioned``: the
    momentum is exchanged as ``m / (sqrt(v) + eps)``."""
    b1, b2 = betas
    p, zeros, hp, n = _start(world)
    m, v = zeros(), zeros()
    ex = SimExchange(n, world)
    history = []
    for t in range(1, steps + 1):
        grads = _local_grads(world, t, p)
        direction = None
        if t <= freeze_step:  # warmup: Adam on the averaged gradient
            gbar = _mean(grads)
            for r in range(world):
                for j in range(len(gbar)):
                    m[r][j] = b1 * m[r][j] + (1 - b1) * gbar[j]
                    v[r][j] = b2 * v[r][j] + (1 - b2) * gbar[j] ** 2
        else:  # local momentum, compressed average of the momentum, frozen v
            d = [x.sqrt() + eps for x in v[0]]
            for r in range(world):
                for j in range(len(grads[r])):
                    m[r][j] = b1 * m[r][j] + (1 - b1) * grads[r][j]
            if preconditioned:
                xs = [
                    torch.cat([(m[r][j] / d[j]).reshape(-1) for j in range(len(d))])
                    for r in range(world)
                ]
                direction = _split(ex(xs), d)
                m = [[direction[j] * d[j] for j in range(len(d))] for _ in range(world)]
            else:
                avg = ex([torch.cat([x.reshape(-1) for x in m[r]]) for r in range(world)])
                for r in range(world):
                    m[r] = _split(avg, m[r])
        bc1, bc2 = (1 - b1**t, 1 - b2**t) if bias_correction and t <= freeze_step else (1, 1)
        for r in range(world):
            for j in range(len(p[r])):
                lr = hp[j]["lr"] if lrs is None else lrs[t - 1][j]
                if direction is not None:
                    u = direction[j]
                else:
                    u = (m[r][j] / bc1) / ((v[r][j] / bc2).sqrt() + eps)
                p[r][j] = p[r][j] - lr * (u + hp[j]["weight_decay"] * p[r][j])
        if t == freeze_step:
            for r in range(world):
                m[r] = [x / bc1 for x in m[r]]
                v[r] = [x / bc2 for x in v[r]]
            _floor_(v, floor)
        history.append([torch.cat([x.reshape(-1) for x in p[r]]) for r in range(world)])
    return history


def simulate_zero_one_adam(
    world: int,
    steps: int,
    var_freeze_step: int,
    var_update_scaler: int,
    local_step_scaler: int,
    local_step_clipper: int,
    betas=(0.9, 0.999),
    eps=1e-8,
    bias_correction: bool = False,
    floor: float = 0.0,
    preconditioned: bool = False,
) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Rank-by-rank 0/1 Adam; returns the per-step flat parameters and the sync steps.

    ``bias_correction``: m by steps, v by variance updates, folded in at the freeze; ``floor``:
    the variance floored after every variance update; ``preconditioned``: gradients exchanged
    as ``g / (sqrt(v) + eps)``, the accumulator in parameter units."""
    b1, b2 = betas
    p, zeros, hp, n = _start(world)
    m, v, acc = zeros(), zeros(), zeros()
    lrs = [[0.0] * len(hp) for _ in range(world)]  # per rank, per parameter (= per group)
    ex = SimExchange(n, world)
    var_interval, var_counter, local_interval, local_counter = 1, 0, 1, 0
    k = 0  # variance updates
    history, synced = [], []
    for t in range(1, steps + 1):
        grads = _local_grads(world, t, p)
        if t <= var_freeze_step:
            if t % var_interval == 0:  # variance step: exact average, both moments
                k += 1
                gbar = _mean(grads)
                for r in range(world):
                    for j in range(len(gbar)):
                        v[r][j] = b2 * v[r][j] + (1 - b2) * gbar[j] ** 2
                        m[r][j] = b1 * m[r][j] + (1 - b1) * gbar[j]
            else:  # 1-bit average of the gradient, momentum only
                d = [x.sqrt() + eps if preconditioned else torch.ones_like(x) for x in v[0]]
                xs = [
                    torch.cat([(grads[r][j] / d[j]).reshape(-1) for j in range(len(d))])
                    for r in range(world)
                ]
                avg = _split(ex(xs), grads[0])
                avg = [a * dj for a, dj in zip(avg, d, strict=True)]
                for r in range(world):
                    for j in range(len(avg)):
                        m[r][j] = b1 * m[r][j] + (1 - b1) * avg[j]
            bc1, bc2 = (1 - b1**t, 1 - b2 ** max(k, 1)) if bias_correction else (1, 1)
            for r in range(world):
                for j in range(len(p[r])):
                    u = (m[r][j] / bc1) / ((v[r][j] / bc2).sqrt() + eps)
                    p[r][j] = p[r][j] - hp[j]["lr"] * (u + hp[j]["weight_decay"] * p[r][j])
            if t % var_interval == 0:
                _floor_(v, floor)
                var_counter += 1
                if var_counter == var_update_scaler:
                    var_counter, var_interval = 0, var_interval * 2
            if t == var_freeze_step:
                ex.reset()
                for r in range(world):
                    m[r] = [x / bc1 for x in m[r]]
                    v[r] = [x / bc2 for x in v[r]]
                _floor_(v, floor)
            synced.append(t)
        else:
            for r in range(world):
                for j in range(len(p[r])):
                    lr = hp[j]["lr"]
                    m[r][j] = b1 * m[r][j] + (1 - b1) * grads[r][j]
                    lrs[r][j] += lr
                    u = m[r][j] / (v[r][j].sqrt() + eps) + hp[j]["weight_decay"] * p[r][j]
                    p[r][j] = p[r][j] - lr * u
                    acc[r][j] = acc[r][j] - lr * u
            if t % local_interval == 0:
                denom = [x.sqrt() + eps for x in v[0]]
                scale = [torch.ones_like(x) for x in denom] if preconditioned else denom
                for r in range(world):
                    p[r] = [p[r][j] - acc[r][j] for j in range(len(p[r]))]
                avg = _split(
                    ex(
                        [
                            torch.cat(
                                [(acc[r][j] * scale[j]).reshape(-1) for j in range(len(denom))]
                            )
                            for r in range(world)
                        ]
                    ),
                    denom,
                )
                for r in range(world):
                    for j in range(len(p[r])):
                        step = avg[j] / scale[j]  # in parameter units
                        m[r][j] = -step * denom[j] / lrs[r][j]
                        p[r][j] = p[r][j] + step
                        acc[r][j] = torch.zeros_like(acc[r][j])
                        lrs[r][j] = 0.0
                synced.append(t)
            local_counter += 1
            if local_counter == local_step_scaler:
                local_counter, local_interval = 0, min(local_step_clipper, 2 * local_interval)
        history.append([torch.cat([x.reshape(-1) for x in p[r]]) for r in range(world)])
    return history, synced


def simulate_onebit_lamb(
    world: int,
    steps: int,
    freeze_step: int,
    betas=(0.9, 0.999),
    eps=1e-8,
    max_coeff=10.0,
    min_coeff=0.01,
    coeff_beta=0.9,
    factor_max=4.0,
    factor_min=0.5,
    factor_threshold=0.1,
    bias_correction: bool = False,
    floor: float = 0.0,
    preconditioned: bool = False,
) -> list[list[torch.Tensor]]:
    """Rank-by-rank 1-bit LAMB; returns the flat parameters of every rank after every step
    (``bias_correction``/``floor``/``preconditioned`` as in :func:`simulate_onebit_adam`)."""
    b1, b2 = betas
    p, zeros, hp, n = _start(world)
    m, v, v_fresh = zeros(), zeros(), zeros()
    P = len(hp)
    coeff_freeze = [[0.0] * P for _ in range(world)]
    last_factor = [[1.0] * P for _ in range(world)]
    scaling = None
    ex = SimExchange(n, world)
    history = []
    for t in range(1, steps + 1):
        grads = _local_grads(world, t, p)
        if t <= freeze_step:
            gbar = _mean(grads)
            bc1, bc2 = (1 - b1**t, 1 - b2**t) if bias_correction else (1, 1)
            for r in range(world):
                for j in range(P):
                    m[r][j] = b1 * m[r][j] + (1 - b1) * gbar[j]
                    v[r][j] = b2 * v[r][j] + (1 - b2) * gbar[j] ** 2
                    u = (m[r][j] / bc1) / ((v[r][j] / bc2).sqrt() + eps)
                    u = u + hp[j]["weight_decay"] * p[r][j]
                    pn, un = float(p[r][j].norm()), float(u.norm())
                    coeff = 1.0
                    if pn > 0 and un > 0:
                        coeff = min(max(pn / un, min_coeff), max_coeff)
                        coeff_freeze[r][j] = (
                            coeff_beta * coeff_freeze[r][j] + (1 - coeff_beta) * coeff
                        )
                    p[r][j] = p[r][j] - hp[j]["lr"] * coeff * u
            if t == freeze_step:
                for r in range(world):
                    m[r] = [x / bc1 for x in m[r]]
                    v[r] = [x / bc2 for x in v[r]]
                _floor_(v, floor)
                v_fresh = [[x.clone() for x in v[r]] for r in range(world)]
        else:
            d = [x.sqrt() + eps if preconditioned else torch.ones_like(x) for x in v[0]]
            if scaling is None:  # from the momentum at the end of warmup (same on every rank)
                rms = [
                    float((x / dj).norm()) / math.sqrt(x.numel())
                    for x, dj in zip(m[0], d, strict=True)
                ]
                scaling = [sum(rms) / P / s for s in rms]
            m_last = [[x.clone() for x in m[r]] for r in range(world)]
            for r in range(world):
                for j in range(P):
                    m[r][j] = (b1 * m[r][j] + (1 - b1) * grads[r][j]) * scaling[j] / d[j]
            avg = ex([torch.cat([x.reshape(-1) for x in m[r]]) for r in range(world)])
            for r in range(world):
                m[r] = [x * d[j] / scaling[j] for j, x in enumerate(_split(avg, m[r]))]
                for j in range(P):
                    g_rec = (m[r][j] - b1 * m_last[r][j]) / (1 - b1)
                    v_fresh[r][j] = b2 * v_fresh[r][j] + (1 - b2) * g_rec**2
                    denom = v[r][j].sqrt() + eps
                    u_prelim = m[r][j] / denom
                    wd = hp[j]["weight_decay"]
                    u = u_prelim + wd * p[r][j]
                    factor = float((denom / (v_fresh[r][j].sqrt() + eps)).max())
                    if wd > 0:
                        ratio = min(1.0, float(u_prelim.norm() / u.norm()))
                        factor = factor * ratio + (1.0 - ratio)
                    factor = min(max(factor, factor_min), factor_max)
                    factor = min(factor, last_factor[r][j] * (1 + factor_threshold))
                    factor = max(factor, last_factor[r][j] * (1 - factor_threshold))
                    last_factor[r][j] = factor
                    p[r][j] = p[r][j] - hp[j]["lr"] * coeff_freeze[r][j] * factor * u
        history.append([torch.cat([x.reshape(-1) for x in p[r]]) for r in range(world)])
    return history


# --------------------------------------------------------------------------- W = 1: equal to the references


def _run(opt_factory, steps: int, rank: int = 0, sched=None) -> tuple[list[torch.Tensor], list]:
    params = make_params()
    opt = opt_factory(make_groups(params))
    scheduler = sched(opt) if sched else None
    hist = []
    for t in range(1, steps + 1):
        set_grads(params, rank, t)
        opt.step()
        if scheduler:
            scheduler.step()
        hist.append(flat_trainable(params))
    return hist, params


def test_onebit_adam_warmup_is_adam_without_bias_correction() -> None:
    """100 warmup steps with an LR schedule: equal to plain (no bias correction) Adam."""
    steps, gamma = 100, 0.97
    sched = lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma)  # noqa: E731
    hist, params = _run(lambda g: OneBitAdam(g, freeze_step=10**6), steps, sched=sched)
    lrs = [[hparams_of(k)["lr"] * gamma ** (t - 1) for k in TRAINABLE] for t in range(1, steps + 1)]
    ref = simulate_onebit_adam(1, steps, freeze_step=10**6, lrs=lrs)
    p0 = flat_trainable(make_params())
    errs = [rel_err(h, r[0]) for h, r in zip(hist, ref, strict=True)]
    assert max(errs) <= 1e-6, max(errs)
    assert rel_err(hist[-1] - p0, ref[-1][0] - p0) <= 1e-5  # the displacement too, not just p
    assert torch.equal(params[FROZEN], initial_params()[FROZEN].float())  # frozen untouched


def test_onebit_lamb_warmup_is_lamb() -> None:
    hist, _ = _run(lambda g: OneBitLamb(g, freeze_step=10**6), 100)
    ref = simulate_onebit_lamb(1, 100, freeze_step=10**6)
    errs = [rel_err(h, r[0]) for h, r in zip(hist, ref, strict=True)]
    assert max(errs) <= 1e-6, max(errs)


@pytest.mark.parametrize("robust", [False, True], ids=["deepspeed", "robust"])
@pytest.mark.parametrize("algo", ["onebit_adam", "zero_one_adam", "onebit_lamb"])
def test_single_process_compression_matches_simulation(algo: str, robust: bool) -> None:
    """W = 1 still compresses (no communication): the same math as the rank simulation."""
    steps = 40
    opt, ref = _algo(algo, 1, steps, robust)
    hist, _ = _run(opt, steps)
    errs = [rel_err(h, r[0]) for h, r in zip(hist, ref, strict=True)]
    assert max(errs) <= 1e-5, max(errs)


#: DeepSpeed's arithmetic (the three optimizers' robustness options off)
DEEPSPEED = {"variance_floor": 0.0, "preconditioned_exchange": False}
#: what OneBitStrategy builds from a torch Adam/AdamW (a floor high enough to bite here)
ROBUST = {"bias_correction": True, "variance_floor": 0.5, "preconditioned_exchange": True}
SIM_ROBUST = {"bias_correction": True, "floor": 0.5, "preconditioned": True}


def _algo(algo: str, world: int, steps: int, robust: bool = False):
    """(optimizer factory, simulated history) for one algorithm through both phases, with
    DeepSpeed's arithmetic or with bias correction, variance floor and preconditioned exchange."""
    kw, sim = (dict(ROBUST), dict(SIM_ROBUST)) if robust else (dict(DEEPSPEED), {})
    if algo == "onebit_adam":
        return (
            lambda g: OneBitAdam(g, freeze_step=10, **kw),
            simulate_onebit_adam(world, steps, freeze_step=10, **sim),
        )
    if algo == "zero_one_adam":
        hp = dict(
            var_freeze_step=14, var_update_scaler=3, local_step_scaler=5, local_step_clipper=4
        )
        hist, _ = simulate_zero_one_adam(world, steps, **hp, **sim)
        return lambda g: ZeroOneAdam(g, **hp, **kw), hist
    if algo == "onebit_lamb":
        return (
            lambda g: OneBitLamb(g, freeze_step=10, **kw),
            simulate_onebit_lamb(world, steps, freeze_step=10, **sim),
        )
    raise ValueError(algo)


# --------------------------------------------------------------------------- checkpoints


CKPT_CASES = {
    # name: (factory, steps, save points) — save points inside each phase
    "onebit_adam": (lambda g: OneBitAdam(g, freeze_step=8), 20, [4, 13]),
    "zero_one_adam": (
        lambda g: ZeroOneAdam(
            g, var_freeze_step=12, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4
        ),
        30,
        [9, 23],  # 9: var_interval 4, a non-variance step next; 23: mid local-step interval
    ),
    "onebit_lamb": (lambda g: OneBitLamb(g, freeze_step=8, weight_decay=0.01), 20, [4, 13]),
}


def _roundtrip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def run_with_restart(factory, steps: int, save_at: int | None, rank: int = 0) -> list[torch.Tensor]:
    """Train ``steps`` steps; if ``save_at``, rebuild params and optimizer from a checkpoint there."""
    params = make_params()
    opt = factory(make_groups(params))
    hist = []
    for t in range(1, steps + 1):
        set_grads(params, rank, t)
        opt.step()
        hist.append(flat_trainable(params))
        if t == save_at:
            saved_p = _roundtrip([p.detach().clone() for p in params])
            saved_o = _roundtrip(opt.state_dict())
            params = make_params()  # fresh objects, initial values
            with torch.no_grad():
                for p, s in zip(params, saved_p, strict=True):
                    p.copy_(s)
            opt = factory(make_groups(params))
            opt.load_state_dict(saved_o)
    return hist


@pytest.mark.parametrize("algo", sorted(CKPT_CASES))
def test_checkpoint_round_trip_is_bitwise(algo: str) -> None:
    factory, steps, save_points = CKPT_CASES[algo]
    straight = run_with_restart(factory, steps, None)
    for save_at in save_points:
        resumed = run_with_restart(factory, steps, save_at)
        for t, (a, b) in enumerate(zip(straight, resumed, strict=True), 1):
            assert torch.equal(a, b), f"{algo}: differs at step {t} after a restart at {save_at}"


def test_checkpoint_carries_phase_counters_and_error_buffers() -> None:
    params = make_params()
    opt = ZeroOneAdam(
        make_groups(params), var_freeze_step=12, var_update_scaler=2, local_step_scaler=3
    )
    for t in range(1, 18):
        set_grads(params, 0, t)
        opt.step()
    sd = opt.state_dict()["onebit"]
    assert sd["phase"] == "local" and sd["step_count"] == 17
    assert sd["var_interval"] == opt.var_interval > 1
    assert sd["local_step_interval"] == 2 and sd["local_step_counter"] == 2
    assert sd["exchange"]["worker_error"].abs().sum() > 0
    assert any(lr > 0 for lr in sd["lrs"])  # mid local interval: accumulated learning rates
    params = make_params()
    lamb = OneBitLamb(make_groups(params), freeze_step=2)
    for t in range(1, 5):
        set_grads(params, 0, t)
        lamb.step()
    state = lamb.state_dict()
    p_state = next(iter(state["state"].values()))
    assert {
        "exp_avg",
        "exp_avg_sq",
        "exp_avg_sq_fresh",
        "lamb_coeff_freeze",
        "last_factor",
        "scaling_coeff",
    } <= set(p_state)
    assert state["onebit"]["scaling_coeff_ready"] is True


# --------------------------------------------------------------------------- phases and API


def test_phase_switch_is_driven_by_step_count_or_freeze() -> None:
    params = make_params()
    opt = OneBitAdam(make_groups(params), freeze_step=3)
    phases = []
    for t in range(1, 6):
        assert opt.expects_averaged_grads == (t <= 3)
        set_grads(params, 0, t)
        opt.step()
        phases.append(opt.phase)
    assert phases == ["warmup", "warmup", "compression", "compression", "compression"]

    opt = OneBitLamb(make_groups(make_params()), freeze_step=100)
    opt.freeze()  # before any step: compression from step 1
    assert opt.phase == "compression" and not opt.expects_averaged_grads
    opt.freeze()  # idempotent
    assert opt.phase == "compression"


def test_zero_one_adam_variance_schedule() -> None:
    """Variance steps: every step until var_update_scaler of them, then every 2nd, 4th, ..."""
    params = make_params()
    opt = ZeroOneAdam(make_groups(params), var_freeze_step=20, var_update_scaler=3)
    variance_steps = []
    for t in range(1, 26):
        if opt.expects_averaged_grads:
            variance_steps.append(t)
        set_grads(params, 0, t)
        opt.step()
    assert variance_steps == [1, 2, 3, 4, 6, 8, 12, 16, 20]
    assert opt.phase == "local" and opt.var_interval == 8


def test_exp_avg_mask_keeps_masked_momentum_and_params_fixed() -> None:
    params = make_params()
    mask = torch.ones(SHAPES[0])
    mask[:, :2] = 0
    groups = make_groups(params)
    with pytest.raises(ValueError, match="put the masked parameter in its own group"):
        OneBitAdam([{**groups[0], "exp_avg_mask": mask}, groups[1]]).step()
    groups = [
        {"params": [params[0]], "lr": 0.01, "exp_avg_mask": mask},
        {"params": [params[1]], "lr": 0.01},
        groups[1],
    ]
    opt = OneBitAdam(groups, freeze_step=3)
    for t in range(1, 4):
        set_grads(params, 0, t)
        opt.step()
    before = params[0].detach().clone()
    for t in range(4, 10):
        set_grads(params, 0, t)
        opt.step()
    exp_avg = opt.state[params[0]]["exp_avg"]
    assert torch.all(exp_avg[:, :2] == 0)
    assert torch.equal(params[0][:, :2], before[:, :2])  # weight_decay 0 in group 0
    assert not torch.equal(params[0][:, 2:], before[:, 2:])


def test_state_views_share_the_flat_buffers() -> None:
    params = make_params()
    opt = OneBitAdam(make_groups(params), freeze_step=3)
    set_grads(params, 0, 1)
    opt.step()
    a, b = opt.state[params[0]]["exp_avg"], opt.state[params[1]]["exp_avg"]
    assert a.shape == params[0].shape
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert FROZEN not in [i for i, p in enumerate(params) if p in opt.state]


def test_comm_stats_single_process_are_zero_but_counted() -> None:
    params = make_params()
    opt = OneBitAdam(make_groups(params), freeze_step=2)
    for t in range(1, 5):
        set_grads(params, 0, t)
        opt.step()
    assert opt.comm_stats == {"bytes_last_step": 0, "bytes_total": 0, "fp32_equiv_total": 0}


def test_closure_and_plain_module() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    opt = OneBitAdam(model.parameters(), lr=0.05, freeze_step=5)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    first = float(opt.step(closure).detach())
    for _ in range(30):
        last = float(opt.step(closure).detach())
    assert last < first


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (OneBitAdam, {"lr": -1.0}, r"lr must be a number in \(0.0, inf\), got -1.0"),
        (
            OneBitAdam,
            {"betas": (0.9, 1.0)},
            r"betas\[1\] must be a number in \[0.0, 1.0\), got 1.0",
        ),
        (OneBitAdam, {"betas": (0.9,)}, r"betas must be a pair"),
        (OneBitAdam, {"eps": float("nan")}, r"eps must be a number"),
        (OneBitAdam, {"weight_decay": -0.1}, r"weight_decay must be .*got -0.1"),
        (OneBitAdam, {"freeze_step": -1}, r"freeze_step must be an integer >= 0, got -1"),
        (OneBitAdam, {"freeze_step": 1.5}, r"freeze_step must be an integer"),
        (OneBitAdam, {"amsgrad": True}, r"amsgrad"),
        (
            ZeroOneAdam,
            {"var_update_scaler": 0},
            r"var_update_scaler must be an integer >= 1, got 0",
        ),
        (ZeroOneAdam, {"local_step_scaler": 0}, r"local_step_scaler must be an integer >= 1"),
        (ZeroOneAdam, {"local_step_clipper": 0}, r"local_step_clipper must be an integer >= 1"),
        (ZeroOneAdam, {"var_freeze_step": -5}, r"var_freeze_step must be an integer >= 0"),
        (ZeroOneAdam, {"amsgrad": True}, r"amsgrad"),
        (OneBitLamb, {"max_coeff": 0.0}, r"max_coeff must be a number in \(0.0, inf\]"),
        (OneBitLamb, {"min_coeff": 20.0}, r"min_coeff must be a number in \(0.0, 10.0\], got 20.0"),
        (OneBitLamb, {"coeff_beta": 1.0}, r"coeff_beta must be a number in \[0.0, 1.0\)"),
        (OneBitLamb, {"factor_max": 0.5}, r"factor_max must be a number in \[1.0, inf\]"),
        (OneBitLamb, {"factor_min": 0.0}, r"factor_min must be a number in \(0.0, 1.0\]"),
        (OneBitLamb, {"factor_threshold": -1}, r"factor_threshold must be"),
    ],
)
def test_bad_hyperparameters_are_rejected(cls, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        cls([torch.nn.Parameter(torch.zeros(3))], **kwargs)


def test_group_overrides_are_validated() -> None:
    with pytest.raises(ValueError, match="lr must be"):
        OneBitAdam([{"params": [torch.nn.Parameter(torch.zeros(3))], "lr": -1}])


def test_complex_and_sparse_are_rejected() -> None:
    with pytest.raises(ValueError, match="complex"):
        OneBitAdam([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))])
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = ZeroOneAdam(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()


def test_parameters_on_several_devices_or_none_trainable_are_rejected() -> None:
    p = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    opt = OneBitAdam([p])
    with pytest.raises(ValueError, match="no parameters with requires_grad=True"):
        opt.step()


def test_load_state_dict_keeps_fp32_state_for_low_precision_params() -> None:
    p = torch.nn.Parameter(torch.randn(10, dtype=torch.bfloat16))
    opt = OneBitAdam([p], freeze_step=2)
    for _ in range(3):
        p.grad = torch.randn(10, dtype=torch.bfloat16)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    opt2 = OneBitAdam([p], freeze_step=2)
    opt2.load_state_dict(sd)
    p.grad = torch.randn(10, dtype=torch.bfloat16)
    opt2.step()
    assert opt2.state[p]["exp_avg"].dtype == torch.float32
    assert opt2.step_count == 4 and opt2.phase == "compression"


def test_freezing_a_young_variance_warns() -> None:
    p = torch.nn.Parameter(torch.ones(4))
    opt = OneBitAdam([p], freeze_step=3)  # beta2 = 0.999: 0.3% of steady state after 3 steps
    young = r"variance of 3 update\(s\) with beta2=0.999.*bias_correction=True.*693"
    with pytest.warns(RuntimeWarning, match=young):
        for _ in range(3):
            p.grad = torch.ones(4)
            opt.step()
    for quiet in (
        OneBitAdam([p], freeze_step=20, betas=(0.9, 0.95)),  # 64% after 20 steps: no warning
        OneBitAdam([p], freeze_step=3, bias_correction=True),  # unbiased: nothing to say
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(20):
                p.grad = torch.ones(4)
                quiet.step()
        assert quiet.phase == "compression"


def test_zero_one_adam_warns_of_a_young_variance_in_phase_one_counting_updates() -> None:
    """0/1 Adam preconditions its 1-bit gradient steps with the variance from step 2 of phase 1
    on: the warning fires at the first such step and counts variance updates, not steps."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = ZeroOneAdam([p], var_freeze_step=100, var_update_scaler=2)  # variance steps 1, 2, 4
    with pytest.warns(RuntimeWarning, match=r"variance of 2 update\(s\)") as record:
        for _ in range(5):
            p.grad = torch.ones(4)
            opt.step()
    assert opt.phase == "variance" and opt.variance_updates == 3
    assert len([w for w in record if "update(s)" in str(w.message)]) == 1  # once per run


# --------------------------------------------------------------------------- ordinary models' needs


@pytest.mark.parametrize("algo", ["onebit_adam", "zero_one_adam"])
def test_bias_corrected_warmup_is_torch_adamw(algo: str) -> None:
    """With bias_correction=True the steps that average full-precision gradients are torch's
    AdamW, step for step (0/1 Adam: every step is a variance step while var_interval is 1)."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s)) for s in [(7, 3), (5,), (33,)]]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    hp = {"lr": 3e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.05}
    if algo == "onebit_adam":
        opt = OneBitAdam(ps, freeze_step=10**6, bias_correction=True, **hp)
    else:
        opt = ZeroOneAdam(
            ps, var_freeze_step=10**6, var_update_scaler=10**6, bias_correction=True, **hp
        )
    torch_opt = torch.optim.AdamW(ref, **hp)
    for _ in range(60):
        for p, q in zip(ps, ref, strict=True):
            q.grad = torch.randn_like(q) * (1 + q.detach().abs())
            p.grad = q.grad.clone()
        opt.step()
        torch_opt.step()
    for p, q in zip(ps, ref, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("algo", ["onebit_adam", "zero_one_adam", "onebit_lamb"])
def test_zero_gradient_coordinates_stay_put_after_the_switch(algo: str) -> None:
    """A tensor that never gets a gradient (a conv bias before BatchNorm, a dead unit) next to
    ordinary ones: with DeepSpeed's arithmetic its 1-bit momentum of +-scale over sqrt(0) + eps
    throws it to ~lr * scale / eps; with the defaults it moves at most a few Adam steps, and the
    floor names it."""
    cls = {"onebit_adam": OneBitAdam, "zero_one_adam": ZeroOneAdam, "onebit_lamb": OneBitLamb}[algo]
    switch = {"zero_one_adam": "var_freeze_step"}.get(algo, "freeze_step")

    def run(**kw):
        torch.manual_seed(0)
        live, dead = torch.nn.Parameter(torch.randn(64)), torch.nn.Parameter(torch.zeros(8))
        opt = cls([live, dead], lr=1e-2, **{switch: 10}, **kw)
        opt.param_names = {live: "live", dead: "dead.bias"}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # young variance, skipped steps
            for _ in range(40):
                live.grad = live.detach() - 1 + 0.3 * torch.randn(64)
                dead.grad = torch.zeros(8)
                try:
                    opt.step()
                except Exception:  # NonFiniteError: diverged
                    return float("inf"), opt
        return float(dead.detach().abs().max()), opt

    moved, opt = run()
    assert moved <= 30 * 1e-2, moved  # 30 compression steps of at most ~lr each
    assert opt.floored == {"dead.bias (8,)": 8}
    if algo != "onebit_lamb":  # (LAMB's trust ratio happens to tame it on this problem)
        exploded, _ = run(variance_floor=0.0, preconditioned_exchange=False)
        assert exploded > 1e3 * moved, (exploded, moved)


def test_divergence_error_names_the_causes_it_can_see() -> None:
    """DeepSpeed's arithmetic on a run with a zero-gradient tensor and a young variance: the
    diverged error names both (and what to pass), not only "lower the learning rate"."""
    live, dead = torch.nn.Parameter(torch.randn(64)), torch.nn.Parameter(torch.zeros(8))
    opt = OneBitAdam([live, dead], freeze_step=5, variance_floor=0.0, preconditioned_exchange=False)
    opt.param_names = {live: "live", dead: "dead.bias"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(5):
            live.grad, dead.grad = torch.randn(64), torch.zeros(8)
            opt.step()
        with pytest.raises(NonFiniteError) as info:
            for _ in range(opt.max_consecutive_skips):
                live.grad, dead.grad = torch.full((64,), float("nan")), torch.zeros(8)
                opt.step()
    msg = str(info.value)
    assert "8 coordinates have a variance ~0 (dead.bias (8,): 8)" in msg
    assert "variance_floor=0.01" in msg and "holds 0% of its steady state" in msg
    assert "bias_correction=True" in msg and "lower the learning rate" in msg
    # with the defaults and bias correction, only the generic advice remains
    assert OneBitAdam([live], bias_correction=True)._divergence_hint() == (
        "lower the learning rate or check the data"
    )


@pytest.mark.parametrize("pre", [True, False])
def test_decoupled_weight_decay_of_frozen_steps_is_exact_to_rounding(pre: bool) -> None:
    """1-bit Adam's frozen steps. At ``lr * weight_decay = 1e-7`` a float32 factor ``1 - lr * wd`` is 1 - 1.19e-7 (+19% of
    the decay, every step); the decay must be what float64 arithmetic rounded to float32 after
    each step gives. beta1 = 0 and zero gradients after the warmup step: the frozen steps move
    the parameters by their decay alone."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.rand(50_000) * 1.5 + 0.5)
    opt = OneBitAdam(
        [p],
        lr=1e-3,
        weight_decay=1e-4,
        betas=(0.0, 0.999),
        freeze_step=1,
        preconditioned_exchange=pre,
    )
    p.grad = torch.ones_like(p)
    opt.step()  # warmup
    ref = p.detach().clone()
    for _ in range(300):
        p.grad = torch.zeros_like(p)
        opt.step()
        ref = (ref.double() * (1 - 1e-7)).float()
    assert opt.phase == "compression"
    assert (p.detach() != ref).float().mean() < 1e-3  # ties aside, bitwise


def test_the_optimizers_need_no_lightning() -> None:
    """``import lightning_onebit.optim`` (and the package) in a Python where ``lightning`` cannot
    be imported: the optimizers train, the strategy is left out, nothing imports Lightning."""
    code = (
        "import sys\n"
        "sys.modules['lightning'] = None  # import lightning -> ModuleNotFoundError\n"
        "import torch, lightning_onebit\n"
        "from lightning_onebit.optim import OneBitAdam\n"
        "p = torch.nn.Parameter(torch.ones(8))\n"
        "opt = OneBitAdam([p], lr=0.1, freeze_step=1)\n"
        "for _ in range(3):\n"
        "    p.grad = torch.ones(8); opt.step()\n"
        "assert opt.phase == 'compression' and not hasattr(lightning_onebit, 'OneBitStrategy')\n"
        "assert not any(m.startswith(('lightning.', 'pytorch_lightning')) for m in sys.modules)\n"
        "print('ok', lightning_onebit.__version__)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stderr[-2000:]
