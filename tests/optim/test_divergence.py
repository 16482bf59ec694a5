"""A diverging compression phase is named while it happens (``OneBitOptimizer.divergence``).

On 2 gloo ranks, each algorithm switches after step 3; then its learning rate is multiplied by
``blow_up`` (100 for the Adams, 1000 for LAMB, whose steps are relative to the parameter: the
parameters grow past 10x within tens of steps; 1: a healthy run). The watch checks
every 2 steps. Diverging: one warning, from rank 0 only, naming a parameter and the step, and
with ``on_divergence="raise"`` a ``DivergenceError`` on every rank in the same step. Healthy:
60 steps, no warning. And the watch itself, on fresh random tensors: the growth of one tensor
among others is found with its index and ratio, a NaN counts, a tensor that was ~0 is measured
against 1% of the largest RMS, a check asked for at once (the end of a fit) finds a growth
between two periodic checks.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_onebit.optim import (
    DivergenceError,
    DivergenceWatch,
    OneBitAdam,
    OneBitLamb,
    ZeroOneAdam,
)
from tests.helpers.dist import run_distributed

ALGORITHMS = {
    "onebit_adam": (OneBitAdam, {"freeze_step": 3}),
    "zero_one_adam": (ZeroOneAdam, {"var_freeze_step": 3, "local_step_scaler": 1000}),
    "onebit_lamb": (OneBitLamb, {"freeze_step": 3}),
}

BLOW_UP = {"onebit_adam": 100.0, "zero_one_adam": 100.0, "onebit_lamb": 1000.0}


def _train(
    rank: int, world_size: int, algorithm: str, blow_up: float, action: str, steps: int
) -> dict:
    cls, kw = ALGORITHMS[algorithm]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = cls(model.parameters(), lr=1e-3, **kw)
    opt.param_names = {p: n for n, p in model.named_parameters()}
    opt.divergence.every = 2
    opt.on_divergence = action
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(256, 16, generator=g)
    y = x[:, :4].sin()
    raised = None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(1, steps + 1):
            if step == 4:  # the first compression step
                for group in opt.param_groups:
                    group["lr"] *= blow_up
            i = (step * 16) % 256
            torch.nn.functional.mse_loss(model(x[i : i + 16]), y[i : i + 16]).backward()
            try:
                opt.step()
            except DivergenceError as err:
                raised = (opt.step_count, str(err))
                break
            opt.zero_grad()
    caught = [str(w.message) for w in seen if "diverging" in str(w.message)]
    opt.close()
    return {"warnings": caught, "raised": raised, "phase": str(opt.phase)}


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_a_diverging_compression_phase_warns_once_naming_the_parameter(algorithm: str) -> None:
    records = run_distributed(_train, 2, algorithm, BLOW_UP[algorithm], "warn", 40)
    (message,) = records[0]["warnings"]
    assert not records[1]["warnings"]  # (one message for every rank)
    phase = "local" if algorithm == "zero_one_adam" else "compression"
    assert f"the {phase} phase is diverging: " in message
    assert any(f"{n}.weight (" in message or f"{n}.bias (" in message for n in ("0", "2")), message
    first = 4 if algorithm == "zero_one_adam" else 3  # (0/1 Adam: its first synchronisation)
    assert f"x its RMS of step {first} at step" in message and "a smaller learning rate" in message
    switch = "var_freeze_step" if algorithm == "zero_one_adam" else "freeze_step"
    assert f"a later switch (a larger {switch})" in message
    assert records[0]["raised"] is None


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["onebit_adam", "onebit_lamb"])
def test_on_divergence_raise_stops_every_rank_in_the_same_step(algorithm: str) -> None:
    records = run_distributed(_train, 2, algorithm, BLOW_UP[algorithm], "raise", 40)
    steps = {r["raised"][0] for r in records if r["raised"] is not None}
    assert len(steps) == 1 and all(r["raised"] is not None for r in records), records
    assert "on_divergence='raise'" in records[0]["raised"][1]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_a_healthy_compression_phase_is_not_named(algorithm: str) -> None:
    for r in run_distributed(_train, 2, algorithm, 1.0, "raise", 60):
        assert r["raised"] is None and not r["warnings"] and r["phase"] != "warmup"


def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(n, generator=g) * s for n, s in ((64, 1.0), (8, 0.1), (256, 0.5), (4, 1e-6))
    ]


@pytest.mark.parametrize("seed", range(3))
def test_the_watch_finds_the_tensor_that_grew(seed: int) -> None:
    params = _tensors(seed)
    watch = DivergenceWatch(growth=10.0, every=1)
    assert watch.check(params, 10) is None  # the reference
    k = seed + 1 if seed < 2 else 0
    for p in params:
        p.mul_(1.5)  # everyone grows a little
    params[k].mul_(20.0)
    found = watch.check(params, 11)
    assert found is not None and found.index == k and (found.step, found.since) == (11, 10)
    assert found.ratio == pytest.approx(30.0, rel=1e-5)


def test_the_watch_measures_a_tensor_that_was_0_against_the_largest_rms() -> None:
    params = _tensors(0)
    largest = max(float(p.square().mean().sqrt()) for p in params)
    watch = DivergenceWatch(growth=10.0, every=1)
    watch.check(params, 1)
    params[3].fill_(0.05 * largest)  # from 1e-6: 5x the floor (1% of the largest), not 5e4x
    assert watch.check(params, 2) is None
    params[3].fill_(0.2 * largest)
    found = watch.check(params, 3)
    assert found is not None and found.index == 3 and found.ratio == pytest.approx(20.0, rel=1e-5)


def test_a_nan_counts_and_checks_come_every_steps() -> None:
    params = _tensors(1)
    watch = DivergenceWatch(growth=10.0, every=4)
    watch.check(params, 5)
    params[2][0] = float("nan")
    assert watch.check(params, 6) is None  # not due until step 9
    found = watch.check(params, 9)
    assert found is not None and found.ratio == float("inf")


def test_a_check_now_finds_a_growth_between_two_periodic_checks() -> None:
    params = _tensors(2)
    watch = DivergenceWatch(growth=10.0, every=16)
    watch.check(params, 60)
    params[0].mul_(40.0)  # blown up after the check of step 60, before that of step 76
    assert watch.check(params, 70) is None  # not due
    found = watch.check(params, 70, now=True)  # the end of the run
    assert found is not None and found.index == 0 and found.step == 70
    assert found.ratio == pytest.approx(40.0, rel=1e-5)


def test_the_end_of_a_fit_names_a_blow_up_of_its_last_steps() -> None:
    """The optimizer's ``watch_divergence(now=True)`` (what the strategies call at teardown)
    warns even under ``on_divergence="raise"``, and not in the warmup."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = OneBitLamb(model.parameters(), lr=1e-3, freeze_step=3)
    opt.on_divergence = "raise"
    for _ in range(6):
        model(torch.randn(16, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.watch_divergence(now=True)  # healthy: nothing to say
        assert not seen
        with torch.no_grad():
            model.weight.mul_(100.0)
        opt.watch_divergence(now=True)
    (message,) = [str(w.message) for w in seen]
    assert "is diverging: param_groups[0][0] (4, 8)" in message and "at step 6" in message
    warmup = OneBitLamb(torch.nn.Linear(2, 2).parameters(), freeze_step=100)
    warmup.watch_divergence(now=True)  # nothing to check before the first step or the switch
    opt.close()
    warmup.close()


def test_the_strategies_teardown_asks_for_the_last_check() -> None:
    from lightning_onebit._integration.lifecycle import teardown_steps

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = OneBitLamb(model.parameters(), lr=1e-3, freeze_step=2)
    for _ in range(4):
        model(torch.randn(16, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        model.bias.mul_(1e4)  # after the watch's reference (step 3), before its next check
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with teardown_steps([opt]):
            pass
    assert any("is diverging: param_groups[0][1] (4,)" in str(w.message) for w in seen), seen


def test_the_strategies_offer_on_divergence() -> None:
    from lightning_onebit import OneBitFabricStrategy, OneBitStrategy

    for cls in (OneBitStrategy, OneBitFabricStrategy):
        assert cls(on_divergence="raise").options.on_divergence == "raise"
        with pytest.raises(ValueError, match=r"on_divergence must be one of \['warn', 'raise'\]"):
            cls(on_divergence="stop")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_watch_on_cuda_finds_the_growth_one_check_later_without_waiting() -> None:
    params = [p.cuda() for p in _tensors(2)]
    watch = DivergenceWatch(growth=10.0, every=1)
    assert watch.check(params, 1) is None  # the reference
    params[1].mul_(50.0)
    assert watch.check(params, 2) is None  # the verdict is on its way to the host
    assert watch.pending is not None and watch.pending[2] is not None  # (a CUDA event)
    found = watch.check(params, 3)
    assert found is not None and found.index == 1 and found.step == 2
    assert found.ratio == pytest.approx(50.0, rel=1e-4)
