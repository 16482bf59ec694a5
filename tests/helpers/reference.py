"""The reference implementations the optimizer tests compare with, and their test problem.

The references are written straight from the papers' update rules (Algorithm 1 of each paper,
as the optimizers' module docstrings give it), one parameter at a time, in float64, and share no
code with ``lightning_onebit.optim``. The compression is simulated here too (two-stage,
error-compensated: docs/how-it-works.md, "The compressed allreduce"), for any number of ranks, so
the same simulation checks ``W = 1`` (``test_optim.py``) and ``W = 2, 4`` (``test_optim_dist.py``).

The test problem: five parameters in two groups; one is frozen (requires_grad=False) and one has
grad=None on some steps (on some ranks). Gradients are a deterministic function of (rank, step,
parameter, current value), so the implementation (float32) and the simulation (float64) see the
same problem.
"""

from __future__ import annotations

import io
import itertools
import math

import torch

from lightning_onebit.optim import OneBitAdam, OneBitLamb, ZeroOneAdam
from lightning_onebit.optim._rescale import RESCALE_MIN_BETA2

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
    """Rank ``rank``'s gradients. In one process they are zeros where :func:`grad_of` gives
    None: a gradient missing on every rank makes the optimizers skip the parameter (as torch's
    Adam does), which the references here do not model; with several ranks (where ranks differ)
    a missing gradient counts as zeros."""
    single = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    for k, p in enumerate(params):
        if not p.requires_grad:
            continue
        g = grad_of(rank, step, k, p.detach())
        if g is None and single:
            g = torch.zeros_like(p, dtype=torch.float64)
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


class SimExchange:
    """All W ranks of the error-compensated two-stage 1-bit allreduce of the flat trainable
    parameters, in float64: one exchange per param group (its own scale and error buffers);
    with ``ranks_per_node`` (L > 1, several nodes) the two-level one (``SimHierarchical``)."""

    def __init__(self, world: int, ranks_per_node: int | None = None) -> None:
        sizes = [sum(math.prod(SHAPES[k]) for k in TRAINABLE if k in idx) for idx, _ in GROUPS]
        bounds = itertools.pairwise(itertools.accumulate([0, *sizes]))
        self.bounds = [(a, b) for a, b in bounds if b > a]
        two_level = ranks_per_node is not None and 1 < ranks_per_node < world
        self.parts = [
            SimHierarchical(b - a, world // ranks_per_node, ranks_per_node)
            if two_level
            else _SimExchangeOne(b - a, world)
            for a, b in self.bounds
        ]

    def reset(self) -> None:
        for part in self.parts:
            part.reset()

    def __call__(self, xs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(
            [
                part([x[a:b] for x in xs])
                for part, (a, b) in zip(self.parts, self.bounds, strict=True)
            ]
        )


class _SimExchangeOne:
    """One error-compensated two-stage 1-bit allreduce over all W ranks, in float64."""

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


class SimHierarchical:
    """The two-level exchange over ``nodes`` nodes of ``local`` ranks (ranks numbered node by
    node), in float64: the node's exact mean, cut into ``local`` shards (each a multiple of
    ``8 * nodes`` values, zero-padded); shard ``k`` goes through the one-level exchange among
    the nodes (its own error buffers); every rank gets every shard."""

    def __init__(self, n: int, nodes: int, local: int) -> None:
        self.n, self.nodes, self.local = n, nodes, local
        self.shard = -(-n // (8 * nodes * local)) * 8 * nodes
        self.shards = [_SimExchangeOne(self.shard, nodes) for _ in range(local)]

    def reset(self) -> None:
        for ex in self.shards:
            ex.reset()

    def __call__(self, xs: list[torch.Tensor]) -> torch.Tensor:
        ll, sh = self.local, self.shard
        means = []
        for node in range(self.nodes):
            mean = torch.zeros(ll * sh, dtype=torch.float64)
            mean[: self.n] = sum(xs[node * ll + i].double() for i in range(ll)) / ll
            means.append(mean)
        out = torch.cat(
            [ex([m[k * sh : (k + 1) * sh] for m in means]) for k, ex in enumerate(self.shards)]
        )
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
    return params, zeros, hp


def _group_of(j: int) -> int:
    """Param group of the ``j``-th trainable parameter."""
    return next(i for i, (idx, _) in enumerate(GROUPS) if TRAINABLE[j] in idx)


def _floor_(v: list[list[torch.Tensor]], floor: float, to_mean: bool = False) -> list[torch.Tensor]:
    """Every rank's variance raised to ``floor**2`` times the larger of its tensor's mean
    variance and its group's (``to_mean``: where below that, to that mean itself); returns where
    it was raised (per tensor)."""
    raised: list[torch.Tensor] = [torch.zeros_like(x, dtype=torch.bool) for x in v[0]]
    for gi in range(len(GROUPS)):
        js = [j for j in range(len(v[0])) if _group_of(j) == gi]
        group = float(torch.cat([v[0][j].reshape(-1) for j in js]).mean())
        for j in js:
            mean = max(float(v[0][j].mean()), group)
            low = mean * floor**2
            if floor > 0:
                raised[j] = v[0][j] <= low
            for vr in v:
                vr[j] = torch.where(raised[j], mean, vr[j]) if to_mean else vr[j].clamp(min=low)
    return raised


class SimRescale:
    """``rescale_variance`` in float64. Before the switch: a running mean square (``beta`` per
    update, bias-corrected) of the averaged gradients of every variance update. At the switch:
    ``A_j``, the mean of tensor ``j``'s bias-corrected variance, and ``s_j`` = that running
    mean square over ``A_j``. After it each rank sums ``g**2`` per tensor; when a step may
    reduce and ``interval`` steps have passed, the ranks' mean ``M_j`` of their per-tensor mean
    squares is fed, as ``M_j * s_j / M_ref_j`` (``M_ref``: the first reduce's), to the ratio
    ``r_j = A_j(now) / A_j(switch)`` of a ``beta2`` average over ``k`` variance updates, ``n``
    steps more (``beta2`` at least ``RESCALE_MIN_BETA2``; ``on=False``: off)."""

    def __init__(
        self,
        world: int,
        ntensors: int,
        on: bool,
        interval: int = 1,
        beta: float = 0.9,
        beta2: float = 0.999,
    ) -> None:
        self.on, self.interval, self.beta = on, interval, beta
        self.beta2 = max(beta2, RESCALE_MIN_BETA2)
        self.tot = [[0.0] * ntensors for _ in range(world)]
        self.steps = 0
        self.recent, self.weight = [0.0] * ntensors, 0.0
        self.scale, self.r, self.k, self.updates = [0.0] * ntensors, [1.0] * ntensors, 0, 0

    def warmup(self, gbar: list[torch.Tensor]) -> None:
        """A variance update with the averaged gradients ``gbar``."""
        ms = [float((g.double() ** 2).mean()) for g in gbar]
        self.recent = [
            self.beta * a + (1 - self.beta) * x for a, x in zip(self.recent, ms, strict=True)
        ]
        self.weight = 1 - (1 - self.weight) * self.beta

    def switch(self, v: list[torch.Tensor], bc2: float, k: int) -> None:
        """At the switch: ``v`` the variance before the bias correction is folded in, ``bc2``
        that correction, ``k`` the variance updates."""
        a = [float(x.double().mean()) / bc2 for x in v]
        glob = [x / self.weight for x in self.recent] if self.weight > 0 else a
        self.scale = [g / x if x > 0 else 0.0 for g, x in zip(glob, a, strict=True)]
        self.k = k

    def add(self, grads: list[list[torch.Tensor] | None]) -> None:
        """One step: every rank's gradients (``None``: a rank that sat the step out)."""
        for r, gs in enumerate(grads):
            if gs is not None:
                self.tot[r] = [
                    a + float((g.double() ** 2).sum()) for a, g in zip(self.tot[r], gs, strict=True)
                ]
        self.steps += 1

    def reduce(self, numels: list[int]) -> None:
        if self.steps < self.interval:
            return
        w, n = len(self.tot), self.steps
        mean = [
            sum(self.tot[r][j] / (max(x, 1) * n) for r in range(w)) / w
            for j, x in enumerate(numels)
        ]
        self.tot = [[0.0] * len(numels) for _ in range(w)]
        self.steps = 0
        if self.updates == 0:
            self.scale = [s / m if m > 0 else 0.0 for s, m in zip(self.scale, mean, strict=True)]
        fed = [m * s if s > 0 else 1.0 for m, s in zip(mean, self.scale, strict=True)]
        b2, k = self.beta2, self.k
        before, after = 1 - b2**k, 1 - b2 ** (k + n)
        self.r = [
            (b2**n * before * r + (1 - b2**n) * f) / after for r, f in zip(self.r, fed, strict=True)
        ]
        self.k += n
        self.updates += 1

    def scaled(self, v: list[torch.Tensor]) -> list[torch.Tensor]:
        """The variance the frozen phase preconditions with."""
        if not self.on or self.updates == 0:
            return v
        return [x * r for x, r in zip(v, self.r, strict=True)]


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
    ranks_per_node: int | None = None,
    rescale: bool = False,
) -> list[list[torch.Tensor]]:
    """Rank-by-rank 1-bit Adam; returns the flat parameters of every rank after every step.

    ``bias_correction``: Adam's in warmup, folded into m and v at the freeze; ``floor``: the
    frozen variance raised to ``floor**2`` times its group's mean; ``preconditioned``: the
    momentum is exchanged as ``m / (sqrt(v) + eps)``; ``rescale``: ``rescale_variance``
    (:class:`SimRescale`)."""
    b1, b2 = betas
    p, zeros, hp = _start(world)
    m, v = zeros(), zeros()
    ex = SimExchange(world, ranks_per_node)
    rs = SimRescale(world, len(p[0]), rescale, RESCALE_INTERVAL, beta2=b2)
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
            if rescale:
                rs.warmup(gbar)
        else:  # local momentum, compressed average of the momentum, frozen v
            d = [x.sqrt() + eps for x in rs.scaled(v[0])]
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
                elif t > freeze_step:
                    u = m[r][j] / d[j]
                else:
                    u = (m[r][j] / bc1) / ((v[r][j] / bc2).sqrt() + eps)
                p[r][j] = p[r][j] - lr * (u + hp[j]["weight_decay"] * p[r][j])
        if t > freeze_step and rescale:
            rs.add(grads)
            rs.reduce([x.numel() for x in p[0]])
        if t == freeze_step:
            if rescale:
                rs.switch(v[0], 1 - b2**t, t)
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
    ranks_per_node: int | None = None,
    rescale: bool = False,
) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Rank-by-rank 0/1 Adam; returns the per-step flat parameters and the sync steps.

    ``bias_correction``: m by steps, v by variance updates, folded in at the freeze; ``floor``:
    the variance floored after every variance update; ``preconditioned``: gradients exchanged
    as ``g / (sqrt(v) + eps)``, the accumulator in parameter units; ``rescale``:
    ``rescale_variance`` (phase 2: summed on every step, reduced on sync steps)."""
    b1, b2 = betas
    p, zeros, hp = _start(world)
    m, v, acc = zeros(), zeros(), zeros()
    rs = SimRescale(world, len(p[0]), rescale, RESCALE_INTERVAL, beta2=b2)
    lrs = [[0.0] * len(hp) for _ in range(world)]  # per rank, per parameter (= per group)
    ex = SimExchange(world, ranks_per_node)
    var_interval, var_counter, local_interval, local_counter = 1, 0, 1, 0
    k = 0  # variance updates
    floored = [torch.zeros_like(x, dtype=torch.bool) for x in p[0]]  # at the freeze
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
                if rescale:
                    rs.warmup(gbar)
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
                if rescale:
                    rs.switch(v[0], 1 - b2 ** max(k, 1), k)
                for r in range(world):
                    m[r] = [x / bc1 for x in m[r]]
                    v[r] = [x / bc2 for x in v[r]]
                floored = _floor_(v, floor)
            synced.append(t)
        else:
            vs = rs.scaled(v[0])
            for r in range(world):
                for j in range(len(p[r])):
                    lr = hp[j]["lr"]
                    m[r][j] = b1 * m[r][j] + (1 - b1) * grads[r][j]
                    lrs[r][j] += lr
                    u = m[r][j] / (vs[j].sqrt() + eps) + hp[j]["weight_decay"] * p[r][j]
                    p[r][j] = p[r][j] - lr * u
                    acc[r][j] = acc[r][j] - lr * u
            if rescale:
                rs.add(grads)
            if t % local_interval == 0:
                denom = [x.sqrt() + eps for x in vs]
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
                        # (no momentum where the variance was floored at the freeze)
                        m[r][j] = torch.where(floored[j], 0.0, -step * denom[j] / lrs[r][j])
                        p[r][j] = p[r][j] + step
                        acc[r][j] = torch.zeros_like(acc[r][j])
                        lrs[r][j] = 0.0
                synced.append(t)
                if rescale:
                    rs.reduce([x.numel() for x in p[0]])
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
    ranks_per_node: int | None = None,
    trust_ratio: str = "fresh_variance",
) -> list[list[torch.Tensor]]:
    """Rank-by-rank 1-bit LAMB; returns the flat parameters of every rank after every step
    (``bias_correction``/``floor``/``preconditioned`` as in :func:`simulate_onebit_adam`;
    ``trust_ratio`` as ``OneBitLamb``'s)."""
    b1, b2 = betas
    p, zeros, hp = _start(world)
    m, v, v_fresh = zeros(), zeros(), zeros()
    P = len(hp)
    coeff_freeze = [[0.0] * P for _ in range(world)]
    last_factor = [[1.0] * P for _ in range(world)]
    ratio_ref = [[0.0] * P for _ in range(world)]
    scaling = None
    ex = SimExchange(world, ranks_per_node)
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
                _floor_(v, floor, to_mean=True)
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
                    last = last_factor[r][j]
                    factor = float((denom / (v_fresh[r][j].sqrt() + eps)).max())
                    if wd > 0:
                        ratio = min(1.0, float(u_prelim.norm() / u.norm()))
                        factor = factor * ratio + (1.0 - ratio)
                    factor = min(max(factor, factor_min), factor_max)
                    factor = min(factor, last * (1 + factor_threshold))
                    factor = max(factor, last * (1 - factor_threshold))
                    pn, un = float(p[r][j].norm()), float(u.norm())
                    if trust_ratio == "update_norm" and pn > 0 and un > 0:  # the step's growth
                        if ratio_ref[r][j] == 0.0:
                            ratio_ref[r][j] = pn / un
                        factor = min(factor, factor_max * (pn / un) / ratio_ref[r][j])
                    last_factor[r][j] = factor
                    p[r][j] = p[r][j] - hp[j]["lr"] * coeff_freeze[r][j] * factor * u
        history.append([torch.cat([x.reshape(-1) for x in p[r]]) for r in range(world)])
    return history


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


#: DeepSpeed's arithmetic (the three optimizers' robustness options off)
DEEPSPEED = {"deepspeed_compatible": True}


#: what OneBitStrategy builds from a torch Adam/AdamW (a floor high enough to bite here)
ROBUST = {"bias_correction": True, "variance_floor": 0.5, "preconditioned_exchange": True}
#: ... and rescale_variance (1-bit Adam, 0/1 Adam), all-reduced every RESCALE_INTERVAL steps
#: (``rescale_interval``, set to act within these short runs)
RESCALE_INTERVAL = 2


SIM_ROBUST = {"bias_correction": True, "floor": 0.5, "preconditioned": True}


def _rescaled(opt):
    opt.rescale_interval = RESCALE_INTERVAL
    return opt


def _algo(
    algo: str, world: int, steps: int, robust: bool = False, ranks_per_node: int | None = None
):
    """(optimizer factory, simulated history) for one algorithm through both phases, with
    DeepSpeed's arithmetic or with bias correction, variance floor and preconditioned exchange;
    with ``ranks_per_node``, the hierarchical exchange (nodes of that many ranks)."""
    kw, sim = (dict(ROBUST), dict(SIM_ROBUST)) if robust else (dict(DEEPSPEED), {})
    if ranks_per_node is not None:
        kw.update(hierarchical=True, ranks_per_node=ranks_per_node)
        sim["ranks_per_node"] = ranks_per_node
    if robust and algo != "onebit_lamb":
        kw["rescale_variance"], sim["rescale"] = True, True
    rescaled = _rescaled
    if algo == "onebit_adam":
        return (
            lambda g: rescaled(OneBitAdam(g, freeze_step=10, **kw)),
            simulate_onebit_adam(world, steps, freeze_step=10, **sim),
        )
    if algo == "zero_one_adam":
        hp = dict(
            var_freeze_step=14, var_update_scaler=3, local_step_scaler=5, local_step_clipper=4
        )
        hist, _ = simulate_zero_one_adam(world, steps, **hp, **sim)
        return lambda g: rescaled(ZeroOneAdam(g, **hp, **kw)), hist
    if algo == "onebit_lamb":
        if robust:  # the steps bounded by their norms (a factor_max low enough to bind here)
            kw["trust_ratio"] = sim["trust_ratio"] = "update_norm"
            kw["factor_max"] = sim["factor_max"] = 1.05
        return (
            lambda g: OneBitLamb(g, freeze_step=10, **kw),
            simulate_onebit_lamb(world, steps, freeze_step=10, **sim),
        )
    raise ValueError(algo)


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
    # rescale_variance: its running mean squares and reference (13: after the reference), and
    # 0/1 Adam's sums of local steps between two syncs (23)
    "onebit_adam_rescaled": (
        lambda g: _rescaled(OneBitAdam(g, freeze_step=8, rescale_variance=True)),
        20,
        [4, 13],
    ),
    "zero_one_adam_rescaled": (
        lambda g: _rescaled(
            ZeroOneAdam(
                g,
                var_freeze_step=12,
                var_update_scaler=2,
                local_step_scaler=3,
                local_step_clipper=4,
                rescale_variance=True,
            )
        ),
        30,
        [9, 23],
    ),
    # a floor high enough to bite: the floors kept for the local phase's momentum (23)
    "zero_one_adam_floored": (
        lambda g: ZeroOneAdam(
            g,
            var_freeze_step=12,
            var_update_scaler=2,
            local_step_scaler=3,
            local_step_clipper=4,
            variance_floor=0.5,
        ),
        30,
        [23],
    ),
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
