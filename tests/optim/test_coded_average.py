"""``average_dtype="int4"``/``"int8"``: the optimizers average the steps' gradients in integer
codes with error feedback (``comm.QuantizedAllreduce``, each parameter starting a block of its
own), on real gloo groups. Checked against the same exchange applied by hand to the local
gradients and fed to an optimizer that averages nothing; bytes; exact resume (the error
buffers travel in the checkpoint); released at the switch; a NaN drops the step on every rank;
the settings that cannot work refused up front."""

from __future__ import annotations

import copy
import math
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_onebit import kernels
from lightning_onebit.comm import QuantizedAllreduce, start_average
from lightning_onebit.optim import OneBitAdam, OneBitLamb, ZeroOneAdam
from lightning_onebit.optim._coded_average import window_steps
from tests.helpers.dist import run_distributed

MAKERS: dict[str, Any] = {
    "onebit_adam": lambda params, **kw: OneBitAdam(params, lr=1e-2, freeze_step=6, **kw),
    "zero_one_adam": lambda params, **kw: ZeroOneAdam(params, lr=1e-2, var_freeze_step=6, **kw),
    "onebit_lamb": lambda params, **kw: OneBitLamb(params, lr=1e-2, freeze_step=6, **kw),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same on every rank; a LayerNorm's small tensors between matrices
    return torch.nn.Sequential(
        torch.nn.Linear(12, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 6)
    )


def _backward(model: torch.nn.Module, rank: int, t: int) -> None:
    gen = torch.Generator().manual_seed(100 * rank + t)  # different data per rank
    x = torch.randn(16, 12, generator=gen)
    model.zero_grad()
    (model(x) - x[:, :6]).square().mean().backward()


def _by_hand_worker(rank: int, world: int, algo: str, dtype: str) -> dict:
    """The optimizer's own coded average next to the same exchange applied by hand: at int4 the
    variance window's steps (2: steps 5 and 6) in int8, the errors carried over, and their
    squares alone the variance the switch freezes."""
    ours, ref = _model(), _model()
    window = 2 if dtype == "int4" else 0
    opt = MAKERS[algo](ours.parameters(), average_dtype=dtype, variance_window=window)
    twin = MAKERS[algo](ref.parameters(), average_warmup_grads=False)
    sizes = [p.numel() for p in ref.parameters()]
    coarse = QuantizedAllreduce(sum(sizes), bits=4 if dtype == "int4" else 8, segments=sizes)
    fine = QuantizedAllreduce(sum(sizes), bits=8, segments=sizes)
    b2 = opt.param_groups[0]["betas"][1]
    sums, weight = torch.zeros(sum(sizes), dtype=torch.float64), 0.0
    sent, per_call = [], []
    for t in range(6):  # the warmup: the switch after step 6
        _backward(ours, rank, t)
        opt.step()
        sent.append(opt.comm_stats["bytes_last_step"])
        _backward(ref, rank, t)
        flat = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
        hand = fine if t >= 6 - window else coarse
        if t == 6 - window:  # the same blocks: each value's error carried into int8
            fine.worker_error.copy_(coarse.worker_error)
            fine.server_error.copy_(coarse.server_error)
        hand(flat, out=flat)
        per_call.append(hand.bytes_per_call)
        if hand is fine and window:
            sums = b2 * sums + (1 - b2) * flat.double() ** 2
            weight = b2 * weight + (1 - b2)
        for p, g in zip(ref.parameters(), flat.split(sizes), strict=True):
            p.grad.copy_(g.view_as(p))
        twin.step()
    frozen = sums / weight * (1 - b2**6) if window else None  # Adam's uncorrected scale
    return {
        "ours": [p.detach().clone() for p in ours.parameters()],
        "ref": [p.detach().clone() for p in ref.parameters()],
        "sent": sent,
        "per_call": per_call,
        "variance": opt.variance.clone(),
        "frozen": frozen,
        "twin_variance": twin.variance.clone(),
    }


@pytest.mark.parametrize(
    ("algo", "dtype"),
    [
        ("onebit_adam", "int4"),
        ("zero_one_adam", "int4"),
        ("zero_one_adam", "int8"),
        ("onebit_lamb", "int4"),
    ],
)
def test_the_warmup_averages_in_codes_with_error_feedback(algo: str, dtype: str) -> None:
    results = run_distributed(_by_hand_worker, 2, algo, dtype)
    for r in results:
        for a, b, c in zip(r["ours"], r["ref"], results[0]["ours"], strict=True):
            assert torch.equal(a, b)  # bitwise the exchange applied by hand
            assert torch.equal(a, c)  # and the same on every rank
        # the exchange's records, and the byte per tensor that says which have a gradient
        assert r["sent"] == [n + 2 * (2 - 1) * 6 // 2 for n in r["per_call"]]
        # each tensor in whole blocks of 256: 1792 values, padded to 2048, 1024 per rank
        bits = [4] * 4 + [8] * 2 if dtype == "int4" else [8] * 6
        assert r["per_call"] == [2 * (4 + kernels.row_bytes(1024, b, 256)) for b in bits]
        if r["frozen"] is not None:  # the window's estimate, frozen (float64 reference)
            torch.testing.assert_close(r["variance"].double(), r["frozen"], rtol=1e-5, atol=0)
            assert not torch.allclose(r["variance"], r["twin_variance"], rtol=1e-2)
        else:
            assert torch.equal(r["variance"], r["twin_variance"])


def _resume_worker(rank: int, world: int) -> dict:
    def run(steps: range, model: torch.nn.Module, opt: OneBitAdam) -> None:
        for t in steps:
            _backward(model, rank, t)
            opt.step()

    whole = _model()
    opt = OneBitAdam(whole.parameters(), lr=1e-2, freeze_step=8, average_dtype="int4")
    run(range(6), whole, opt)
    # a checkpoint after step 3: the shared state and this rank's own (its error buffers)
    first = _model()
    a = OneBitAdam(first.parameters(), lr=1e-2, freeze_step=8, average_dtype="int4")
    run(range(3), first, a)
    shared, mine = copy.deepcopy(a.state_dict()), copy.deepcopy(a.rank_state_dict())
    errors_saved = mine["onebit"]["coded_average"] is not None
    resumed = copy.deepcopy(first)
    b = OneBitAdam(resumed.parameters(), lr=1e-2, freeze_step=8, average_dtype="int4")
    b.load_state_dict(shared)
    b.load_rank_state_dict(mine)
    run(range(3, 6), resumed, b)
    # without this rank's errors (another rank's file, or none): not the same run
    lost = copy.deepcopy(first)
    c = OneBitAdam(lost.parameters(), lr=1e-2, freeze_step=8, average_dtype="int4")
    c.load_state_dict({**shared, "onebit": {**shared["onebit"], "coded_average": None}})
    run(range(3, 6), lost, c)
    run(range(6, 10), whole, opt)  # past the switch: the coded average is let go
    return {
        "errors_saved": errors_saved,
        "resumed": [p.detach().clone() for p in resumed.parameters()],
        "lost": [p.detach().clone() for p in lost.parameters()],
        "released": not opt.coded_average.exchanges and opt.coded_average.state() is None,
    }


def _resume_reference_worker(rank: int, world: int) -> list[torch.Tensor]:
    model = _model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=8, average_dtype="int4")
    for t in range(6):
        _backward(model, rank, t)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_a_resumed_warmup_continues_exactly_and_the_switch_lets_the_average_go() -> None:
    results = run_distributed(_resume_worker, 2)
    whole = run_distributed(_resume_reference_worker, 2)
    for r, w in zip(results, whole, strict=True):
        assert r["errors_saved"] and r["released"]
        assert all(torch.equal(a, b) for a, b in zip(r["resumed"], w, strict=True))
        assert not all(torch.equal(a, b) for a, b in zip(r["lost"], w, strict=True))


def _nan_worker(rank: int, world: int) -> dict:
    model = _model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=8, average_dtype="int4")
    kept = []
    for t in range(4):
        _backward(model, rank, t)
        if t == 2 and rank == 1:
            next(model.parameters()).grad[0, 0] = float("nan")
        before = copy.deepcopy(opt.rank_state_dict()["onebit"]["coded_average"])
        opt.step()
        after = opt.rank_state_dict()["onebit"]["coded_average"]
        kept.append(
            before is not None and torch.equal(before["worker_error"], after["worker_error"])
        )
    return {
        "skipped": opt.skipped_steps,
        "step_count": opt.step_count,
        "kept": kept,
        "params": [p.detach().clone() for p in model.parameters()],
    }


def test_a_nan_on_one_rank_drops_the_step_on_every_rank_with_the_errors_unchanged() -> None:
    results = run_distributed(_nan_worker, 2)
    for r in results:
        assert r["skipped"] == 1 and r["step_count"] == 3
        assert r["kept"] == [False, False, True, False]  # (step 0: no errors before it)
        assert all(
            torch.equal(a, b) for a, b in zip(r["params"], results[0]["params"], strict=True)
        )


def test_settings_that_cannot_average_in_codes_are_refused() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="average_warmup_grads=True"):
        OneBitAdam(params, average_dtype="int4", average_warmup_grads=False)
    with pytest.raises(ValueError, match=r"hierarchical=False"):
        OneBitAdam(params, average_dtype="int8", hierarchical=True)
    assert OneBitAdam(params, average_dtype=torch.int4).average_dtype == torch.int4
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="QuantizedAllreduce"):
            start_average(torch.zeros(4), torch.int4)


def _window_resume_worker(rank: int, world: int) -> dict:
    """freeze_step 9, variance_window 4: steps 6-9 in int8. A checkpoint after step 7 (inside
    the window: its estimate and the int8 errors saved) resumed, run past the switch."""

    def make(model: torch.nn.Module) -> OneBitAdam:
        return OneBitAdam(
            model.parameters(), lr=1e-2, freeze_step=9, average_dtype="int4", variance_window=4
        )

    def run(steps: range, model: torch.nn.Module, opt: OneBitAdam) -> None:
        for t in steps:
            _backward(model, rank, t)
            opt.step()

    whole = _model()
    opt = make(whole)
    run(range(12), whole, opt)
    first = _model()
    a = make(first)
    run(range(7), first, a)
    shared, mine = copy.deepcopy(a.state_dict()), copy.deepcopy(a.rank_state_dict())
    saved = shared["onebit"]["window_variance"]
    resumed = copy.deepcopy(first)
    b = make(resumed)
    b.load_state_dict(shared)
    b.load_rank_state_dict(mine)
    run(range(7, 12), resumed, b)
    # without the window's estimate: the variance frozen from two window steps, not four
    lost = copy.deepcopy(first)
    c = make(lost)
    c.load_state_dict({**shared, "onebit": {**shared["onebit"], "window_variance": None}})
    c.load_rank_state_dict(mine)
    run(range(7, 12), lost, c)
    return {
        "saved": saved is not None and saved["weights"].numel() == 6,
        "whole": [p.detach().clone() for p in whole.parameters()] + [opt.variance.clone()],
        "resumed": [p.detach().clone() for p in resumed.parameters()] + [b.variance.clone()],
        "lost": [p.detach().clone() for p in lost.parameters()] + [c.variance.clone()],
        "released": opt.window_variance.state() is None,
    }


def test_a_warmup_resumed_inside_the_variance_window_continues_exactly() -> None:
    for r in run_distributed(_window_resume_worker, 2):
        assert r["saved"] and r["released"]
        assert all(torch.equal(a, b) for a, b in zip(r["resumed"], r["whole"], strict=True))
        assert not torch.equal(r["lost"][-1], r["whole"][-1])


def test_variance_window_settings_that_cannot_work_are_refused() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    for bad in (1.0, -0.1, -2, "a third", True):
        with pytest.raises(ValueError, match="variance_window must be"):
            OneBitAdam(params, average_dtype="int4", variance_window=bad)
    with pytest.raises(ValueError, match="applies to average_dtype='int4'"):
        ZeroOneAdam(params, average_dtype="int8", variance_window=0.25)
    with pytest.raises(ValueError, match="applies to average_dtype='int4'"):
        OneBitLamb(params, variance_window=5)
    for fine in (None, 0, 0.0, 0.5, 7):
        assert (
            OneBitAdam(params, average_dtype="int4", variance_window=fine).variance_window == fine
        )


def test_the_default_window_is_the_steps_the_variance_remembers() -> None:
    assert window_steps(None, 60, 0.95) == 20  # 1 / (1 - beta2)
    assert window_steps(None, 40, 0.999) == 40  # at most the warmup
    assert window_steps(None, 40, 1.0) == 40
    assert window_steps(0.25, 60, 0.95) == 15 and window_steps(7, 60, 0.95) == 7
    assert window_steps(100, 60, 0.9) == 60 and window_steps(0, 60, 0.9) == 0


def _overlap_worker(rank: int, world: int, algo: str) -> dict:
    """The same warmup with the coded average in step() and overlapped with backward in several
    buckets (the variance window's int8 steps, a NaN on one rank at step 4 in one bucket), to
    the switch (after it the 1-bit exchange's buckets have scales of their own)."""
    out: dict[str, Any] = {}
    for name, cap_mb in (("whole", None), ("buckets", 0.001)):
        model = _model()
        opt = MAKERS[algo](model.parameters(), average_dtype="int4", variance_window=2)
        if cap_mb is not None:
            opt.overlap_with_backward(cap_mb)
        started, exchanges, kept, coded = [], [], [], []
        threads: list[str] = []
        start = opt.coded_average.start

        def recorded(k: int, start: Any = start, threads: list[str] = threads) -> None:
            threads.append(threading.current_thread().name)
            start(k)

        opt.coded_average.start = recorded  # type: ignore[method-assign]
        for t in range(7):  # the switch after step 6 (one step dropped)
            threads.clear()
            poison = None
            if t == 3 and rank == world - 1:  # in backward, where the overlap reads it
                poison = model[1].bias.register_hook(lambda g: g.index_fill(0, _FIRST, math.nan))
            _backward(model, rank, t)
            if poison is not None:
                poison.remove()
            before = copy.deepcopy(opt.coded_average.state())
            opt.step()
            coded.append(bool(threads))  # an average in codes, started by backward or step()
            # the buckets backward started: on the overlap's thread (from the second step on,
            # once the hooks are in)
            started.append(bool(threads) and all(n.startswith("onebit-exchange") for n in threads))
            exchanges.append(len(opt.coded_average.exchanges))
            if t == 3:
                kept.append(_same_state(before, opt.coded_average.state()))
        out[name] = {
            "params": [p.detach().clone() for p in model.parameters()],
            "variance": opt.variance.clone(),
            "skipped": opt.skipped_steps,
            "started": started,
            "exchanges": exchanges,
            "kept": kept,
            "coded": coded,
        }
    return out


_FIRST = torch.tensor([0])


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize(
    ("algo", "world"), [("onebit_adam", 2), ("zero_one_adam", 3), ("onebit_lamb", 2)]
)
def test_the_coded_average_overlapped_with_backward_gives_the_same_bits(
    algo: str, world: int
) -> None:
    results = run_distributed(_overlap_worker, world, algo)
    for r in results:
        whole, buckets = r["whole"], r["buckets"]
        assert all(
            torch.equal(a, b) for a, b in zip(whole["params"], buckets["params"], strict=True)
        )
        assert torch.equal(whole["variance"], buckets["variance"])
        assert whole["skipped"] == buckets["skipped"] == 1
        assert whole["kept"] == buckets["kept"] == [True]  # the NaN's step: errors unchanged
        # backward started the buckets of every step averaged in codes (0/1 Adam: its variance
        # steps) from the second on (once the hooks are in), the dropped one's too
        assert whole["coded"] == buckets["coded"] and sum(buckets["coded"]) >= 5
        assert buckets["started"] == [False, *buckets["coded"][1:]] and not any(whole["started"])
        assert buckets["exchanges"][1] >= 2 and whole["exchanges"][1] == 1
        for a, b in zip(buckets["params"], results[0]["buckets"]["params"], strict=True):
            assert torch.equal(a, b)
