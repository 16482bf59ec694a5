"""Failure modes: a dead or stuck rank ends the others with an error within the timeout, and
runs are bitwise reproducible on CPU."""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing as mp
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_onebit.comm import CompressedAllreduce, NonFiniteError
from lightning_onebit.optim import OneBitAdam, OneBitLamb, ZeroOneAdam
from tests.helpers.dist import free_port, run_distributed


def _peer(rank: int, port: int, mode: str, q: mp.Queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=5))
    exchange = CompressedAllreduce(10_000)
    exchange(torch.randn(10_000))  # one good call together
    if rank == 1:
        if mode == "dies":
            os._exit(1)  # no goodbye: the socket closes under rank 0
        time.sleep(60)  # stuck: never reaches the next collective
        return
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning_onebit.comm.base").addHandler(handler)
    t0 = time.monotonic()
    try:
        exchange(torch.randn(10_000))
        q.put(("returned", time.monotonic() - t0, "", logged))
    except Exception as e:  # what the user sees
        q.put(("raised", time.monotonic() - t0, f"{type(e).__name__}: {e}", logged))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dies", "stuck"])
def test_dead_or_stuck_rank_ends_the_others_with_an_error(mode: str) -> None:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_peer, args=(r, port, mode, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        status, seconds, message, logged = q.get(timeout=60)  # the group timeout is 5 s
    finally:
        for p in procs:
            p.kill()
    print(f"\nrank 1 {mode}: rank 0 {status} after {seconds:.1f} s: {message[:200]}")
    assert status == "raised", "rank 0 returned from an exchange its peer never joined"
    assert "1-bit exchange failed" in message and "peer rank died, stopped" in message
    # logged before it is raised: a launcher may kill the rank before its traceback prints
    assert logged == [message.removeprefix("RuntimeError: ")]
    assert seconds < 30


def _train(rank: int, world: int, algo: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)  # same model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    make = {
        "onebit_adam": lambda p: OneBitAdam(p, lr=1e-2, freeze_step=5),
        "zero_one_adam": lambda p: ZeroOneAdam(p, lr=1e-2, var_freeze_step=5),
        "onebit_lamb": lambda p: OneBitLamb(p, lr=1e-2, freeze_step=5),
    }[algo]
    opt = make(model.parameters())
    gen = torch.Generator().manual_seed(100 + rank)  # different data per rank
    for _ in range(20):
        x = torch.randn(16, 32, generator=gen)
        loss = (model(x) - x[:, :8]).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["onebit_adam", "zero_one_adam", "onebit_lamb"])
def test_two_runs_with_the_same_seed_are_bitwise_identical(algo: str) -> None:
    a = run_distributed(_train, 2, algo)
    b = run_distributed(_train, 2, algo)
    for ra, rb in zip(a, b, strict=True):
        for k in ra:
            assert torch.equal(ra[k], rb[k]), f"{algo}: {k} differs between two identical runs"


def _nan_worker(rank: int, world: int, skip: bool) -> dict:
    """Three calls, NaN on rank 1 in the second; with ``skip`` the second call never happens."""
    gen = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(1000, generator=gen) for _ in range(3)]
    inputs[1][123] = float("nan") if rank == 1 else inputs[1][123]
    exchange = CompressedAllreduce(1000)
    seen = []
    for call, x in enumerate(inputs):
        if skip and call == 1:
            continue
        before = exchange.state_dict()
        try:
            out = exchange(x).clone()
            seen.append("ok")
        except NonFiniteError as e:
            seen.append(str(e))
            after = exchange.state_dict()
            unchanged = all(
                torch.equal(before[k], after[k]) for k in ("worker_error", "server_error")
            )
            seen.append(f"errors unchanged: {unchanged}")
    return {"seen": seen, "out": out, **exchange.state_dict()}


def test_nan_on_one_rank_stops_every_rank_in_the_same_call_and_changes_nothing() -> None:
    results = run_distributed(_nan_worker, 2, False)
    skipped = run_distributed(_nan_worker, 2, True)
    for r, ref in zip(results, skipped, strict=True):
        seen = r["seen"]
        assert seen[0] == "ok" and seen[-1] == "ok"
        assert "rank(s) [1] of 2 (call 2)" in seen[1], seen[1]
        assert seen[2] == "errors unchanged: True"
        # the call after the bad one gives bitwise what it gives when the bad call never happened
        for k in ("out", "worker_error", "server_error"):
            assert torch.equal(r[k], ref[k]), k
    assert results[0]["seen"][1] == results[1]["seen"][1]  # same error on every rank, no hang


def test_nan_single_process() -> None:
    with pytest.raises(NonFiniteError, match=r"rank\(s\) \[0\] of 1"):
        CompressedAllreduce(10)(torch.tensor([1.0] * 9 + [float("inf")]))


# --------------------------------------------------------------------------- skip and continue

# (algorithm, steps where rank 1's gradient gets a NaN): one per communicating kind of step
NAN_CASES = {
    "onebit_adam": [3, 13],  # warmup (fp32 average), compression (1-bit momentum)
    "zero_one_adam": [2, 5],  # variance step (fp32 average), 1-bit gradient step
    "onebit_lamb": [3, 13],  # warmup, compression
}


def _nan_skip_worker(rank: int, world: int, skip_batches: bool) -> dict:
    import warnings

    from tests.helpers.reference import _algo, flat_trainable, make_groups, make_params, set_grads

    out = {}
    for algo, bad in NAN_CASES.items():
        factory, _ = _algo(algo, 1, 0)
        params = make_params()
        opt = factory(make_groups(params))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for t in range(1, 21):
                if t in bad and skip_batches:
                    continue  # the reference: these batches never happened
                set_grads(params, rank, t)
                if t in bad and rank == 1:
                    next(p for p in params if p.grad is not None).grad.view(-1)[0] = float("nan")
                opt.step()
        out[algo] = {
            "params": flat_trainable(params),
            "skipped": opt.skipped_steps,
            "steps": opt.step_count,
            "warnings": [str(w.message) for w in caught if "skipped step" in str(w.message)],
        }
    return out


def test_nan_on_one_rank_skips_the_step_on_every_rank_as_if_the_batch_was_not_there() -> None:
    runs = run_distributed(_nan_skip_worker, 2, False)
    refs = run_distributed(_nan_skip_worker, 2, True)
    for algo, bad in NAN_CASES.items():
        for rank in range(2):
            r, ref = runs[rank][algo], refs[rank][algo]
            assert r["skipped"] == len(bad) and ref["skipped"] == 0, algo
            assert r["steps"] == ref["steps"] == 20 - len(bad), algo
            # said once, by rank 0, not once per rank
            assert len(r["warnings"]) == (len(bad) if rank == 0 else 0), (algo, r["warnings"])
            assert torch.isfinite(r["params"]).all(), algo
            # bitwise: the skipped steps changed nothing (moments, error buffers, counters)
            assert torch.equal(r["params"], ref["params"]), algo
        assert torch.equal(runs[0][algo]["params"], runs[1][algo]["params"]), algo


#: batches (of 28) with a NaN on rank 1 for the device verdict. 1-bit Adam / LAMB (switch at
#: step 10): a warmup step, the switch step (batch 11 is step 10), compressed steps, two in a
#: row, one at a rescale_variance all-reduce (every RESCALE_INTERVAL = 2 counted steps). 0/1
#: Adam (tests/helpers/reference.py's schedule; a dropped batch is no step): a variance step (batch 8),
#: a 1-bit gradient step (11: step 10), the switch step (16: step 14), sync steps (18: step 15;
#: 26: step 22) and a local step (25: step 21, sat out by rank 1 alone)
VERDICT_NAN = {
    "onebit_adam": [4, 11, 12, 15, 16, 21],
    "onebit_lamb": [4, 11, 12, 15, 16, 21],
    "zero_one_adam": [8, 11, 16, 18, 25, 26],
}
BATCHES = 28
#: the state dict's entries every algorithm has (the rest are its own counters)
_BASE_ENTRIES = {
    "step_count",
    "variance_updates",
    "phase",
    "skipped_steps",
    "comm_stats",
    "exchange",
}


def _device_verdict_worker(
    rank: int, world: int, algo: str, robust: bool, how: str, ranks_per_node: int | None = None
) -> dict:
    """BATCHES steps of ``algo`` with NaNs on rank 1 at VERDICT_NAN; ``how``: ``"device"`` (the
    verdict kept on the device, as on CUDA), ``"host"`` (read on the host) or ``"skip"`` (the
    reference: those batches never happened). ``ranks_per_node``: the hierarchical exchange."""
    import warnings

    from tests.helpers.reference import _algo, flat_trainable, make_groups, make_params, set_grads

    factory, _ = _algo(algo, 1, 0, robust=robust, ranks_per_node=ranks_per_node)
    params = make_params()
    opt = factory(make_groups(params))
    opt.verdict.on_cpu = how == "device"
    bad = VERDICT_NAN[algo]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(1, BATCHES + 1):
            if t in bad and how == "skip":
                continue
            set_grads(params, rank, t)
            if t in bad and rank == 1:
                next(p for p in params if p.grad is not None).grad.view(-1)[0] = float("nan")
            opt.step()
        state = opt.state_dict()  # (the last step's verdict is final here)
    return {
        "params": flat_trainable(params),
        "m": opt.flat.states["exp_avg"].clone(),
        "state": {k: v.clone() for k, v in opt.flat.states.items()},
        "counters": {k: v for k, v in state["onebit"].items() if k not in _BASE_ENTRIES},
        "errors": opt.flat.exchange.state_dict(),
        "device_verdict": opt.flat.exchange.device_verdict,
        "skipped": opt.skipped_steps,
        "steps": state["onebit"]["step_count"],
        "warnings": [
            str(w.message)
            for w in caught
            if "skipped step" in str(w.message) or "skips its local update" in str(w.message)
        ],
    }


def _errors(e: dict, k: str) -> torch.Tensor:
    """Error buffer ``k`` of an exchange's state dict (flat, bucketed or hierarchical)."""
    if "buckets" in e:
        return torch.cat([_errors(b, k) for b in e["buckets"]])
    return e[k] if k in e else _errors(e["shard"], k)


@pytest.mark.parametrize("robust", [False, True], ids=["deepspeed", "strategy_defaults"])
@pytest.mark.parametrize("algo", ["onebit_adam", "onebit_lamb", "zero_one_adam"])
def test_a_verdict_kept_on_the_device_drops_the_steps_exactly(algo: str, robust: bool) -> None:
    """The CUDA path's NaN handling (every step's verdict stays on the device; the update
    kernels, ``torch.where`` and the error buffers take it; the host learns it one step later,
    or at once on a switch step), run on the CPU: bit for bit the host's verdict (every flat
    state, error buffer and counter, the warnings), and for 1-bit Adam and 1-bit LAMB the run
    in which those batches never happened. (0/1 Adam's local step 21 is sat out by rank 1
    alone, its lr still counting: not the same as a batch that never happened.)"""
    device = run_distributed(_device_verdict_worker, 2, algo, robust, "device")
    host = run_distributed(_device_verdict_worker, 2, algo, robust, "host")
    n = len(VERDICT_NAN[algo])
    local = 1 if algo == "zero_one_adam" else 0  # (skipped by rank 1 only)
    for rank in range(2):
        d, h = device[rank], host[rank]
        assert d["device_verdict"] and not h["device_verdict"]
        assert d["skipped"] == h["skipped"] == n - local * (rank == 0)
        assert d["steps"] == h["steps"] == BATCHES - n + local
        said = [[w.partition(": non-finite values")[0] for w in x["warnings"]] for x in (d, h)]
        assert said[0] == said[1]  # (what the device's verdict says of the exchange differs)
        assert len(d["warnings"]) == (n - local if rank == 0 else local)
        # (rescale_variance: the device's reduce of step 24 waits for a step 25)
        rescale = ("grad_sq_updates", "grad_sq_count", "grad_sq_steps", "_rescale_due")
        assert {k: v for k, v in d["counters"].items() if k not in rescale} == {
            k: v for k, v in h["counters"].items() if k not in rescale
        }
        for k in d["state"]:
            assert torch.equal(d["state"][k], h["state"][k]), k
        assert torch.equal(d["params"], h["params"])
        for k in ("worker_error", "server_error"):
            assert torch.equal(_errors(d["errors"], k), _errors(h["errors"], k)), k
    if algo == "zero_one_adam":
        return
    ref = run_distributed(_device_verdict_worker, 2, algo, robust, "skip")
    for rank in range(2):
        d, r = device[rank], ref[rank]
        assert r["skipped"] == 0 and r["steps"] == d["steps"]
        for k in ("params", "m"):
            assert torch.isfinite(d[k]).all(), k
            assert torch.equal(d[k], r[k]), (k, (d[k] - r[k]).abs().max())
    assert torch.equal(device[0]["params"], device[1]["params"])


def test_a_freeze_between_steps_counts_only_the_steps_that_went_through() -> None:
    """A switch called between steps (the adaptive CompressionScheduler's) right after a step
    whose verdict is still on the device: it takes the verdict first, so the bias correction it
    folds into the moments counts the steps that went through, as with the host's verdict."""
    from tests.helpers.reference import flat_trainable, make_groups, make_params, set_grads

    out = []
    for device in (True, False):
        params = make_params()
        opt = OneBitAdam(make_groups(params), bias_correction=True, freeze_step=100)
        opt.verdict.on_cpu = device
        with pytest.warns(RuntimeWarning, match="skipped step 4"):
            for t in range(1, 5):
                set_grads(params, 0, t)
                if t == 4:
                    next(p for p in params if p.grad is not None).grad.view(-1)[0] = math.inf
                opt.step()
            opt.freeze()
        assert opt.step_count == 3 and opt.skipped_steps == 1
        out.append(
            (
                flat_trainable(params),
                opt.flat.states["exp_avg"].clone(),
                opt.flat.states["exp_avg_sq"],
            )
        )
    for a, b in zip(*out, strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["onebit_adam", "onebit_lamb", "zero_one_adam"])
def test_a_verdict_kept_on_the_device_with_the_hierarchical_exchange(algo: str) -> None:
    """The same on 2 nodes x 2 ranks (the two-level exchange, its inter-node error buffers put
    back on the device; the strategy's options): bit for bit the host's verdict."""
    device = run_distributed(_device_verdict_worker, 4, algo, True, "device", 2)
    host = run_distributed(_device_verdict_worker, 4, algo, True, "host", 2)
    n = len(VERDICT_NAN[algo])
    local = 1 if algo == "zero_one_adam" else 0
    for rank in range(4):
        d, h = device[rank], host[rank]
        assert d["device_verdict"] and not h["device_verdict"]
        assert d["skipped"] == h["skipped"] == n - local * (rank != 1)
        assert d["steps"] == h["steps"] == BATCHES - n + local
        for k in d["state"]:
            assert torch.equal(d["state"][k], h["state"][k]), k
        assert torch.equal(d["params"], h["params"])
        for k in ("worker_error", "server_error"):
            assert torch.equal(_errors(d["errors"], k), _errors(h["errors"], k)), k


def _local_nan_worker(rank: int, world: int, nan_at: int, skip: bool = False) -> dict:
    from tests.helpers.reference import flat_trainable, make_groups, make_params, set_grads

    params = make_params()
    # phase 2 from step 7; the local step interval doubles every step up to 4: steps 7, 8 and
    # 12 synchronise, 9-11 are local
    opt = ZeroOneAdam(
        make_groups(params),
        var_freeze_step=6,
        var_update_scaler=2,
        local_step_scaler=1,
        local_step_clipper=4,
    )
    hist = []
    for t in range(1, 13):
        if skip and t == nan_at:
            continue
        set_grads(params, rank, t)
        if t == nan_at and rank == 1:
            next(p for p in params if p.grad is not None).grad.view(-1)[0] = float("inf")
        warns = "skips its local update" if nan_at > 8 else "skipped step"
        with (
            pytest.warns(RuntimeWarning, match=warns)
            # a local skip: said by its rank; a skip on every rank: said once, by rank 0
            if t == nan_at and rank == (1 if nan_at > 8 else 0)
            else contextlib.nullcontext()
        ):
            opt.step()
        hist.append(flat_trainable(params))
    return {"hist": hist, "skipped": opt.skipped_steps, "m": opt.flat.states["exp_avg"].clone()}


def test_nan_in_a_local_step_of_zero_one_adam_is_dropped_by_that_rank_only() -> None:
    a, b = run_distributed(_local_nan_worker, 2, 9)
    assert (a["skipped"], b["skipped"]) == (0, 1)
    assert not torch.equal(a["hist"][8], b["hist"][8])  # step 9 is local: ranks differ
    for h in (a["hist"][-1], b["hist"][-1], a["m"]):  # step 12 synchronises
        assert torch.isfinite(h).all()
    assert torch.equal(a["hist"][-1], b["hist"][-1]) and torch.equal(a["m"], b["m"])


def test_nan_in_a_sync_step_of_zero_one_adam_drops_it_on_every_rank() -> None:
    bad = run_distributed(_local_nan_worker, 2, 8)
    ref = run_distributed(_local_nan_worker, 2, 8, True)  # that batch never happened
    assert [r["skipped"] for r in bad] == [1, 1]
    for a, b in zip(bad, ref, strict=True):
        assert torch.equal(a["hist"][-1], b["hist"][-1]) and torch.equal(a["m"], b["m"])
    for a in bad:
        assert torch.equal(a["hist"][7], a["hist"][6])  # the dropped step changed nothing
    # batch 9 became sync step 8: identical ranks after it
    assert torch.equal(bad[0]["hist"][8], bad[1]["hist"][8])
