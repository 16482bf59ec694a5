"""Single-process tests of the 1-bit optimizers, against the float64 references of
``tests/helpers/reference.py`` (which ``test_optim_dist.py`` uses for W = 2, 4 too)."""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest
import torch

from lightning_onebit.comm import CompressedAllreduce, NonFiniteError
from lightning_onebit.optim import OneBitAdam, OneBitLamb, OneBitOptimizer, Phase, ZeroOneAdam
from lightning_onebit.optim._ops import update_norm_cap
from lightning_onebit.optim._variance import divergence_hint
from tests.helpers.reference import (
    CKPT_CASES,
    FROZEN,
    SHAPES,
    TRAINABLE,
    _algo,
    _run,
    flat_trainable,
    hparams_of,
    initial_params,
    make_groups,
    make_params,
    rel_err,
    run_with_restart,
    set_grads,
    simulate_onebit_adam,
    simulate_onebit_lamb,
)

# --------------------------------------------------------------------------- W = 1: equal to the references


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


@pytest.mark.parametrize("seed", range(3))
def test_the_update_norm_cap_bounds_each_steps_growth(seed: int) -> None:
    """``update_norm_cap`` against a float64 loop on fresh random norms: the reference is set
    where it was 0, a factor is at most ``cap`` times the ratio over it, undefined layers keep
    theirs."""
    g = torch.Generator().manual_seed(seed)
    n = 12
    p_norm, u_norm = torch.rand(n, generator=g) * 3, torch.rand(n, generator=g) * 3
    p_norm[0], u_norm[1] = 0.0, 0.0  # undefined ratios
    ref = torch.where(torch.rand(n, generator=g) < 0.5, 0.0, torch.rand(n, generator=g) * 2)
    factor = 0.5 + 3.5 * torch.rand(n, generator=g)
    want_ref, want = ref.double().clone(), []
    for k in range(n):
        pn, un, f = float(p_norm[k]), float(u_norm[k]), float(factor[k])
        if pn > 0 and un > 0:
            if want_ref[k] <= 0:
                want_ref[k] = pn / un
            f = min(f, 4.0 * pn / un / float(want_ref[k]))
        want.append(f)
    got = update_norm_cap(factor, p_norm, u_norm, ref, 4.0, None)
    f64 = torch.float64
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=f64), rtol=1e-5, atol=0)
    torch.testing.assert_close(ref.double(), want_ref, rtol=1e-6, atol=0)
    assert not torch.equal(got, factor)  # (the case does cap factors)
    before = ref.clone()  # a non-finite step: every factor and reference stays
    kept = update_norm_cap(factor, p_norm, u_norm, ref, 4.0, torch.zeros(n, dtype=torch.bool))
    assert torch.equal(ref, before) and torch.equal(kept, factor)


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


# --------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("algo", sorted(CKPT_CASES))
def test_checkpoint_round_trip_is_bitwise(algo: str) -> None:
    factory, steps, save_points = CKPT_CASES[algo]
    straight = run_with_restart(factory, steps, None)
    for save_at in save_points:
        resumed = run_with_restart(factory, steps, save_at)
        for t, (a, b) in enumerate(zip(straight, resumed, strict=True), 1):
            assert torch.equal(a, b), f"{algo}: differs at step {t} after a restart at {save_at}"


@pytest.mark.parametrize("beta2", [0.999, 0.95])
@pytest.mark.parametrize("algo", ["onebit_adam", "zero_one_adam"])
def test_rescale_variance_follows_adams_variance(algo: str, beta2: float) -> None:
    """rescale_variance on fresh random gradients whose scale per tensor changes after the
    switch (x4, x0.5, x1): each tensor's factor r is a float64 replay of the rule (averaged
    with beta2 0.99 where the optimizer's is shorter) and, at beta2 0.999, follows the mean of
    the variance torch's Adam keeps over the same gradients (one rank: the local gradients are
    the averaged ones); without the rescale the 1-bit steps of the grown tensor grow with its
    gradients."""
    torch.manual_seed(7)
    shapes = [(300,), (20, 10), (50,)]
    growth = [4.0, 0.5, 1.0]
    freeze, steps, ref_at = 20, 80, 10  # the first reduce: the first 10 frozen steps
    b2 = max(beta2, 0.99)  # the rule's

    def run(rescale: bool):
        ps = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        kw = dict(
            rescale_variance=rescale,
            bias_correction=True,
            lr=1e-3,
            betas=(0.9, beta2),
            variance_floor=0.0,
        )
        if algo == "onebit_adam":
            opt = OneBitAdam(ps, freeze_step=freeze, **kw)
        else:  # a variance update every step of phase 1, a sync (and a reduce) every step
            # of phase 2: the steps of 1-bit Adam
            opt = ZeroOneAdam(
                ps,
                var_freeze_step=freeze,
                compressed_variance_phase=False,
                local_step_clipper=1,
                **kw,
            )
        gen = torch.Generator().manual_seed(1)
        moves, grads = [], []
        for t in range(1, steps + 1):
            # the scale ramps from 1 to its growth factor over the 20 steps after the reference
            ramp = min(max(t - freeze - ref_at, 0) / 20, 1.0)
            gs = [
                (1 + (c - 1) * ramp) * torch.randn(s, generator=gen, dtype=torch.float64)
                for s, c in zip(shapes, growth, strict=True)
            ]
            before = [p.detach().clone() for p in ps]
            for p, g in zip(ps, gs, strict=True):
                p.grad = g.float()
            opt.step()
            moves.append(
                [float((p.detach() - b).abs().mean()) for p, b in zip(ps, before, strict=True)]
            )
            grads.append([(g.float().double() ** 2) for g in gs])
        return opt, moves, grads

    opt, moves, grads = run(True)
    ms = [[float(g.mean()) for g in gs] for gs in grads]
    # the rule in float64: the warmup's running mean square (0.9 per step), Adam's mean
    # variance at the switch, then a reduce every 10 steps
    recent, weight = [0.0] * 3, 0.0
    for t in range(freeze):
        recent = [0.9 * a + 0.1 * x for a, x in zip(recent, ms[t], strict=True)]
        weight = 1 - (1 - weight) * 0.9
    adam = [torch.zeros(s, dtype=torch.float64) for s in shapes]  # torch Adam's v

    def adam_mean(t: int) -> list[float]:
        return [float(v.mean()) / (1 - beta2**t) for v in adam]

    for t in range(freeze):
        adam = [beta2 * v + (1 - beta2) * g for v, g in zip(adam, grads[t], strict=True)]
    at_switch = adam_mean(freeze)
    scale = [r / weight / a for r, a in zip(recent, at_switch, strict=True)]
    r, k = [1.0] * 3, freeze
    for t0 in range(freeze, steps - 9, 10):
        mean = [sum(ms[t][j] for t in range(t0, t0 + 10)) / 10 for j in range(3)]
        if t0 == freeze:
            scale = [s / m for s, m in zip(scale, mean, strict=True)]
        before, after = 1 - b2**k, 1 - b2 ** (k + 10)
        r = [
            (b2**10 * before * x + (1 - b2**10) * m * s) / after
            for x, m, s in zip(r, mean, scale, strict=True)
        ]
        k += 10
    got = opt.rescale.scales(opt.flat).tolist()
    assert got == pytest.approx(r, rel=1e-5)
    assert got[0] > 2.5 and got[1] < 0.9 and 0.85 < got[2] < 1.15, got
    if beta2 == 0.999:  # Adam's own variance over the same steps, per tensor
        for t in range(freeze, steps):
            adam = [beta2 * v + (1 - beta2) * g for v, g in zip(adam, grads[t], strict=True)]
        want = [now / then for now, then in zip(adam_mean(steps), at_switch, strict=True)]
        assert got == pytest.approx(want, rel=0.1), (got, want)
    _, plain, _ = run(False)
    switch = sum(m[0] for m in moves[freeze + 2 : freeze + ref_at]) / (ref_at - 2)
    late = sum(m[0] for m in moves[-10:]) / 10
    late_plain = sum(m[0] for m in plain[-10:]) / 10
    assert late < 2.5 * switch, (late, switch)  # as Adam's: the variance grew too
    assert late_plain > 3.0 * switch, (late_plain, switch)  # frozen: grows with the gradients


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
    assert type(sd["phase"]) is str  # a plain string: loads with torch.load(weights_only=True)
    assert opt.phase is Phase.LOCAL and f"{opt.phase}" == "local"
    assert sd["var_interval"] == opt.var_interval > 1
    assert sd["local_step_interval"] == 2 and sd["local_step_counter"] == 2
    buckets = sd["exchange"]["buckets"]  # one exchange (scale, error buffers) per param group
    assert len(buckets) == 2 and all(b["worker_error"].abs().sum() > 0 for b in buckets)
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


def test_a_subclass_must_implement_the_step_and_the_exchange_source() -> None:
    class Incomplete(OneBitOptimizer):
        OPTIONS = ()

        def _step(self) -> None:
            pass

    with pytest.raises(TypeError, match="_exchange_source"):
        Incomplete([torch.nn.Parameter(torch.zeros(1))], {"lr": 1e-3, "betas": (0.9, 0.999),
                   "eps": 1e-8, "weight_decay": 0.0})  # fmt: skip


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
    assert set(opt.comm_stats) >= {"bytes_last_step", "bytes_total", "fp32_equiv_total"}
    assert not any(opt.comm_stats.values()), opt.comm_stats


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
        (OneBitAdam, {"lr": -1.0}, r"lr must be a number in \[0.0, inf\), got -1.0"),
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
        (OneBitLamb, {"trust_ratio": "max"}, r"trust_ratio must be one of \['fresh_variance', "),
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


@pytest.mark.parametrize(
    "case", ["onebit_adam", "zero_one_adam", "zero_one_adam_fp32_phase_1", "zero_one_adam_paper"]
)
def test_bias_corrected_warmup_is_torch_adamw(case: str) -> None:
    """With bias_correction=True the steps that average full-precision gradients are torch's
    AdamW, step for step (0/1 Adam: every step is a variance step while var_interval is 1, and
    with compressed_variance_phase=False, what the strategy builds, whatever the interval). The
    paper's phase 1 at var_update_scaler=2 (1-bit gradient steps from step 3) differs."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s)) for s in [(7, 3), (5,), (33,)]]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    hp = {"lr": 3e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.05}
    if case == "onebit_adam":
        opt = OneBitAdam(ps, freeze_step=10**6, bias_correction=True, **hp)
    else:
        scaler = 10**6 if case == "zero_one_adam" else 2
        compressed = case != "zero_one_adam_fp32_phase_1"
        opt = ZeroOneAdam(
            ps, var_freeze_step=10**6, var_update_scaler=scaler, bias_correction=True,
            compressed_variance_phase=compressed, **hp,
        )  # fmt: skip
    torch_opt = torch.optim.AdamW(ref, **hp)
    for _ in range(60):
        for p, q in zip(ps, ref, strict=True):
            q.grad = torch.randn_like(q) * (1 + q.detach().abs())
            p.grad = q.grad.clone()
        opt.step()
        torch_opt.step()
    if case == "zero_one_adam_paper":
        assert max((p - q).abs().max().item() for p, q in zip(ps, ref, strict=True)) > 1e-2
        return
    for p, q in zip(ps, ref, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-6, atol=2e-6)
    # the interval did double (to every 2nd, 4th, ... step), and still every step was fp32
    assert case != "zero_one_adam_fp32_phase_1" or opt.var_interval > 1


@pytest.mark.parametrize("cls", [OneBitAdam, ZeroOneAdam, OneBitLamb])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("stride", [1, 3, 64])
def test_variance_as_frozen_is_what_the_switch_keeps(
    cls: type[OneBitOptimizer], bias_correction: bool, stride: int
) -> None:
    """What the adaptive switch compares, ``variance_as_frozen(stride)``, is the strided sample
    of the second moment exactly as ``freeze()`` leaves it (bias correction folded in per group,
    with two groups of different beta2 and step counts), and the moment as stored without bias
    correction; the optimizer itself is not changed by it."""
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(s)) for s in [(7, 3), (5,)]]
    b = [torch.nn.Parameter(torch.randn(s)) for s in [(33,), (4, 4)]]
    groups = [{"params": a, "betas": (0.9, 0.999)}, {"params": b, "betas": (0.8, 0.95)}]
    kw = {"compressed_variance_phase": False} if cls is ZeroOneAdam else {}  # (the strategy's)
    opt = cls(groups, lr=1e-3, bias_correction=bias_correction, **kw)
    opt.switch_step = 10**6
    for k in range(7):
        if k == 3:  # a third group joins later: its correction counts its own updates
            c = torch.nn.Parameter(torch.randn(9))
            opt.add_param_group({"params": [c], "betas": (0.85, 0.99)})
        for p in [q for g in opt.param_groups for q in g["params"]]:
            p.grad = torch.randn_like(p) * (1 + p.detach().abs())
        opt.step()
    stored = opt.variance.clone()
    sample = opt.variance_as_frozen(stride)
    assert torch.equal(opt.variance, stored)  # (a copy)
    assert sample.shape == stored[::stride].shape
    if not bias_correction:
        assert torch.equal(sample, stored[::stride])
    else:
        assert not torch.equal(sample, stored[::stride])
    opt.freeze()
    assert torch.equal(sample, opt.variance[::stride])


@pytest.mark.parametrize("case", ["onebit_adam", "zero_one_adam_fp32_phase_1"])
def test_a_group_added_mid_warmup_is_torch_adamw_from_its_first_step(case: str) -> None:
    """A param group added after step 20 (a fine-tuning callback unfreezing a backbone): torch's
    AdamW counts each parameter's own steps, so the group's bias correction starts at 1, and so
    does ours (before: the run's step count, a first step half of AdamW's)."""
    torch.manual_seed(0)
    head = [torch.nn.Parameter(torch.randn(s)) for s in [(7, 3), (5,)]]
    body = [torch.nn.Parameter(torch.randn(s)) for s in [(33,), (4, 4)]]
    ref_head = [torch.nn.Parameter(p.detach().clone()) for p in head]
    ref_body = [torch.nn.Parameter(p.detach().clone()) for p in body]
    hp = {"lr": 3e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.05}
    if case == "onebit_adam":
        opt = OneBitAdam(head, freeze_step=10**6, bias_correction=True, **hp)
    else:
        opt = ZeroOneAdam(
            head, var_freeze_step=10**6, bias_correction=True, compressed_variance_phase=False, **hp
        )
    torch_opt = torch.optim.AdamW(ref_head, **hp)
    for t in range(40):
        if t == 20:
            opt.add_param_group({"params": body, "lr": 1e-2})
            torch_opt.add_param_group({"params": ref_body, "lr": 1e-2})
        n = len(head) + (len(body) if t >= 20 else 0)
        for p, q in zip((head + body)[:n], (ref_head + ref_body)[:n], strict=True):
            q.grad = torch.randn_like(q) * (1 + q.detach().abs())
            p.grad = q.grad.clone()
        opt.step()
        torch_opt.step()
    assert opt.param_groups[1]["joined_at"] == (20, 20)
    for p, q in zip(head + body, ref_head + ref_body, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-6, atol=2e-6)
    # the group's counters travel in the checkpoint (they are part of the param group)
    again = type(opt)([torch.nn.Parameter(p.detach().clone()) for p in head], **hp)
    again.add_param_group({"params": [torch.nn.Parameter(p.detach().clone()) for p in body]})
    again.load_state_dict(opt.state_dict())
    assert again.param_groups[1]["joined_at"] == (20, 20)


@pytest.mark.parametrize(
    "algo, kw",
    [
        ("onebit_adam", {"freeze_step": 3}),
        ("onebit_lamb", {"freeze_step": 3}),
        ("zero_one_adam", {"var_freeze_step": 3, "compressed_variance_phase": False}),
        ("zero_one_adam", {"var_freeze_step": 100}),  # 1-bit gradient steps in phase 1
    ],
)
@pytest.mark.parametrize("how", ["add_param_group", "requires_grad"])
def test_parameters_that_join_after_the_switch_are_refused_before_any_change(
    algo: str, kw: dict, how: str
) -> None:
    """A parameter made trainable once the variance is frozen has none to be preconditioned by
    (its first 1-bit steps would be lr * scale / eps): the step refuses it, names it and says
    what to do, and changes nothing."""
    cls = {"onebit_adam": OneBitAdam, "zero_one_adam": ZeroOneAdam, "onebit_lamb": OneBitLamb}[algo]
    torch.manual_seed(0)
    head = torch.nn.Parameter(torch.randn(16))
    body = torch.nn.Parameter(torch.randn(8), requires_grad=how == "add_param_group")
    opt = cls([head] if how == "add_param_group" else [head, body], lr=1e-2, **kw)
    opt.param_names = {head: "head.weight", body: "backbone.weight"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # young variance (DeepSpeed's arithmetic)
        for _ in range(5):
            head.grad = torch.randn(16)
            opt.step()
    if how == "add_param_group":
        opt.add_param_group({"params": [body]})
    else:
        body.requires_grad_(True)
    before = (head.detach().clone(), body.detach().clone(), opt.state_dict())
    head.grad, body.grad = torch.randn(16), torch.randn(8)
    with pytest.raises(ValueError, match=r"1 parameter\(s\) became trainable at step 6") as err:
        opt.step()
    msg = str(err.value)
    assert "backbone.weight (8,)" in msg and "head.weight" not in msg, msg
    assert "BackboneFinetuning" in msg and f"the optimizer's {opt.SWITCH_OPTION}" in msg, msg
    assert torch.equal(head, before[0]) and torch.equal(body, before[1])
    assert opt.step_count == 5 and opt.state_dict()["state"].keys() == before[2]["state"].keys()


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
    assert "variance_floor=0.01" in msg and "holds 0.5% of its steady state" in msg  # 1 - 0.999**5
    assert "bias_correction=True" in msg and "lower the learning rate" in msg
    # with the defaults and bias correction, only the generic advice remains
    assert divergence_hint(OneBitAdam([live], bias_correction=True)) == (
        "lower the learning rate or check the data"
    )


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


@pytest.mark.parametrize("overlap", [False, True], ids=["in_step", "overlapped"])
def test_each_param_group_is_exchanged_with_its_own_scale(overlap: bool) -> None:
    """A group of small values (biases, norms) next to one of weights: its 1-bit momentum is
    +-its own scale, exactly as a CompressedAllreduce of that group alone, not +-the weights'
    scale (with one scale for all groups the biases would get 100x their own magnitude)."""
    torch.manual_seed(0)
    w, b = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.zeros(16))
    groups = [{"params": [w]}, {"params": [b], "weight_decay": 0.0}]
    opt = OneBitAdam(groups, lr=1e-3, freeze_step=3, preconditioned_exchange=False)
    warnings.filterwarnings("ignore", "OneBitAdam: the 1-bit steps are preconditioned")
    if overlap:
        opt.overlap_with_backward(1000.0)  # one bucket would hold everything
    sizes, refs = (64, 16), [CompressedAllreduce(n) for n in (64, 16)]
    for t in range(1, 6):
        w.grad, b.grad = torch.randn(8, 8), 1e-3 * torch.randn(16)
        m = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in (w, b)]) if t > 1 else 0
        local = 0.9 * m + 0.1 * torch.cat([w.grad.reshape(-1), b.grad])
        opt.step()
        got = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in (w, b)])
        if t <= 3:  # warmup: Adam on the (here local) gradient
            torch.testing.assert_close(got, local)
            continue
        want = torch.cat(
            [ex(part.clone()) for ex, part in zip(refs, local.split(sizes), strict=True)]
        )
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        assert got[64:].abs().max() < 1e-3  # the biases' own scale (all groups: ~0.05)
    assert sorted(opt.flat.exchange.bounds) == [(0, 64), (64, 80)]
    opt.overlap_with_backward(None)


@pytest.mark.parametrize("preconditioned", [False, True])
def test_frozen_steps_decay_the_weights_exactly(preconditioned: bool) -> None:
    """1-bit Adam's decoupled weight decay after the switch is ``p -= lr * wd * p`` rounded once:
    over 500 steps at ``lr * wd = 1e-6`` the weights shrink as in float64 (within 0.3%), where
    the float32 factor ``p * (1 - lr * wd)`` decays 1.5% too much. (0/1 Adam and
    1-bit LAMB add ``wd * p`` to the update, as the warmup's fused Adam does.)"""
    torch.manual_seed(0)
    n, steps, lr, wd = 100_000, 500, 1e-3, 1e-3
    p = torch.nn.Parameter(torch.randn(n))
    group = {"params": [p], "exp_avg_mask": torch.zeros(n)}  # the momentum moves nothing
    opt = OneBitAdam(
        [group], lr=lr, weight_decay=wd, freeze_step=1, preconditioned_exchange=preconditioned
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a young variance
        p.grad = torch.randn(n)
        opt.step()  # the warmup step
        start = p.detach().double().clone()
        for _ in range(steps):
            p.grad = torch.randn(n)
            opt.step()
    assert opt.phase is Phase.COMPRESSION
    want = start.abs().sum() * (1 - (1 - lr * wd) ** steps)
    got = (start - p.detach().double()).abs().sum()
    assert abs(float(got / want) - 1) < 3e-3, float(got / want)
