"""Overlap of the compressed exchange with backward (``optimizer.overlap_with_backward``).

Real backward passes on 2 gloo ranks: the buckets started by the communication thread while
backward runs give bitwise the parameters of the same buckets exchanged inside ``step()``, one
bucket gives bitwise the plain single exchange, the warmup's bucketed fp32 average is the plain
one (and a bf16/fp16 one is DDP's compress hooks' average), a NaN on one rank still drops the whole step on
every rank exactly, and a backward whose step never came is forgotten.
"""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_onebit.optim import OneBitAdam, OneBitLamb, ZeroOneAdam
from tests.helpers.dist import run_distributed

STEPS = 12
FACTORIES = {
    "onebit_adam": lambda p: OneBitAdam(p, lr=1e-2, freeze_step=3),
    "zero_one_adam": lambda p: ZeroOneAdam(
        p, lr=1e-2, var_freeze_step=8, var_update_scaler=2, local_step_scaler=3
    ),
    "onebit_lamb": lambda p: OneBitLamb(p, lr=1e-2, freeze_step=3, weight_decay=0.01),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 10),
    )


def _batch(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + t)
    return torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)


def _train(
    rank: int,
    world: int,
    algo: str,
    cap_mb: float | None,
    paused: bool,
    nan_at: int = -1,
    skip: bool = False,
    extra_backward_at: int = -1,
    device_verdict: bool = False,
) -> dict:
    model = _model()
    opt = FACTORIES[algo](model.parameters())
    opt.verdict.on_cpu = device_verdict  # (the CUDA path's NaN handling)
    if cap_mb is not None:
        opt.overlap_with_backward(cap_mb)
        opt.overlap_paused = paused
    started, hist = [], []
    for t in range(1, STEPS + 1):
        if skip and t == nan_at:
            continue
        x, y = _batch(rank, t)
        if t == extra_backward_at:  # a backward whose step never comes (e.g. a skipped batch)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x * 3), y).backward()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if t == nan_at and rank == 1:  # a NaN gradient for the first parameter only: one bucket
            loss = loss + next(model.parameters()).sum() * float("nan")
        loss.backward()
        if opt.overlap is not None:
            started.append(opt.overlap._next)  # buckets the thread took during backward
        opt.step()
        hist.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
    buckets = len(opt.flat.exchange) if hasattr(opt.flat.exchange, "buckets") else 1
    return {"hist": torch.stack(hist), "started": started, "buckets": buckets}


@pytest.mark.parametrize("algo", list(FACTORIES))
def test_buckets_started_during_backward_equal_buckets_started_in_step(algo: str) -> None:
    live = run_distributed(_train, 2, algo, 0.01, False)
    late = run_distributed(_train, 2, algo, 0.01, True)
    assert live[0]["buckets"] == 3, live[0]["buckets"]
    assert max(live[0]["started"]) == live[0]["buckets"], live[0]["started"]  # all overlapped
    assert live[0]["started"][1] == live[0]["buckets"]  # warmup's fp32 average too (step 1 builds)
    assert max(late[0]["started"]) == 0  # paused: nothing ran during backward
    if algo == "zero_one_adam":  # phase 2 (steps 9-12) synchronises every step here
        assert live[0]["started"][8:] == [live[0]["buckets"]] * 4, live[0]["started"]
    for a, b in zip(live, late, strict=True):
        assert torch.isfinite(a["hist"]).all()
        assert torch.equal(a["hist"], b["hist"])
    if algo != "zero_one_adam":  # (its local steps differ across ranks by design)
        assert torch.equal(live[0]["hist"], live[1]["hist"])


def test_one_bucket_is_the_plain_exchange() -> None:
    one = run_distributed(_train, 2, "onebit_adam", 1e6, False)
    plain = run_distributed(_train, 2, "onebit_adam", None, False)
    assert one[0]["buckets"] == 1
    for a, b in zip(one, plain, strict=True):
        assert torch.equal(a["hist"], b["hist"])


def test_overlapped_warmup_average_is_the_plain_average() -> None:
    # with 2 ranks a sum is exact whatever the bucketing: warmup steps (1..3) must be bitwise
    # those of one all_reduce of the whole gradient
    live = run_distributed(_train, 2, "onebit_adam", 0.01, False)
    plain = run_distributed(_train, 2, "onebit_adam", None, False)
    assert live[0]["started"][1:3] == [live[0]["buckets"]] * 2  # (hooks exist from step 2 on)
    for a, b in zip(live, plain, strict=True):
        assert torch.equal(a["hist"][:3], b["hist"][:3])
        assert not torch.equal(a["hist"][3:], b["hist"][3:])  # then each bucket has its scale


def _half_warmup(rank: int, world: int, dtype: torch.dtype, cap_mb: float | None) -> dict:
    """Two warmup steps averaged in ``dtype``; the local gradients and the parameters."""
    model = _model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=5, average_dtype=dtype)
    if cap_mb is not None:
        opt.overlap_with_backward(cap_mb)
    grads, started = [], []
    for t in (1, 2):
        x, y = _batch(rank, t)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        started.append(opt.overlap._next if opt.overlap is not None else 0)
        opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    bytes_ = opt.comm_stats["bytes_last_step"]
    return {"grads": grads, "params": params, "bytes": bytes_, "started": started}


@pytest.mark.parametrize("cap_mb", [None, 0.01], ids=["in_step", "overlapped"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_warmup_average(dtype: torch.dtype, cap_mb: float | None) -> None:
    # the warmup equals one process stepping on (g0 / 2 + g1 / 2) computed in `dtype`, as DDP's
    # bf16/fp16 compress hooks do (a sum of two values rounds once, in any order: bitwise)
    runs = run_distributed(_half_warmup, 2, dtype, cap_mb)
    ref_model = _model()
    ref = OneBitAdam(ref_model.parameters(), lr=1e-2, freeze_step=5)
    for t in range(2):
        pairs = zip(runs[0]["grads"][t], runs[1]["grads"][t], strict=True)
        for p, (g0, g1) in zip(ref_model.parameters(), pairs, strict=True):
            p.grad = (g0.to(dtype).div(2) + g1.to(dtype).div(2)).float()
        ref.step()
    if cap_mb is not None:  # step 2's average ran bucket by bucket during backward
        assert runs[0]["started"][1] == 3, runs[0]["started"]
    for r in runs:
        for a, b in zip(r["params"], ref_model.parameters(), strict=True):
            assert torch.equal(a, b)
        numel = sum(p.numel() for p in ref_model.parameters())
        # ring allreduce of 2-byte values: 2 (W-1)/W * 2 B each; and one byte per parameter,
        # the ranks' agreement on which parameters none of them has a gradient for
        assert r["bytes"] == numel * 2 + len(r["params"])
    # and the rounding is real: fp32 averages differ from these
    fp32 = run_distributed(_half_warmup, 2, torch.float32, cap_mb)
    assert not all(
        torch.equal(a, b) for a, b in zip(fp32[0]["params"], runs[0]["params"], strict=True)
    )


def test_average_dtype_is_checked() -> None:
    with pytest.raises(ValueError, match="average_dtype must be"):
        OneBitAdam([torch.nn.Parameter(torch.zeros(3))], average_dtype=torch.float64)
    opt = ZeroOneAdam([torch.nn.Parameter(torch.zeros(3))], average_dtype="bf16")
    assert opt.average_dtype == torch.bfloat16


@pytest.mark.parametrize("device_verdict", [False, True], ids=["host", "device_verdict"])
@pytest.mark.parametrize("nan_at", [2, 7], ids=["warmup", "compression"])
def test_nan_with_overlap_drops_the_step_exactly(nan_at: int, device_verdict: bool) -> None:
    """(device_verdict: every bucket's verdict on the device, as on CUDA: a NaN in one bucket
    puts back the error buffers of the buckets that were fine.)"""
    bad = run_distributed(_train, 2, "onebit_adam", 0.01, False, nan_at, False, -1, device_verdict)
    ref = run_distributed(_train, 2, "onebit_adam", 0.01, False, nan_at, True)
    for a, b in zip(bad, ref, strict=True):
        assert a["buckets"] > 1
        assert torch.equal(a["hist"][-1], b["hist"][-1])
        assert torch.isfinite(a["hist"]).all()


def test_a_backward_without_its_step_is_forgotten() -> None:
    extra = run_distributed(_train, 2, "onebit_adam", 0.01, False, -1, False, 6)
    plain = run_distributed(_train, 2, "onebit_adam", 0.01, False)
    for a, b in zip(extra, plain, strict=True):
        assert torch.equal(a["hist"], b["hist"])


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [(OneBitAdam, {"freeze_step": 1}), (ZeroOneAdam, {"var_freeze_step": 1})],
    ids=["onebit_adam", "zero_one_adam"],
)
def test_backward_reads_the_gradients_for_the_exchange_before_it_returns(
    cls: type, kwargs: dict
) -> None:
    """The hook that completes a bucket runs every part of the bucket's exchange that reads
    its gradients (where autograd left them): the source and, on the CPU, its compression,
    which computes the source as it reads it; not the communication thread: a later backward
    (a step that never came, gradient accumulation) or ``zero_grad`` replaces ``.grad`` while
    the thread may still be busy with the previous one, and a read of ``.grad`` racing with
    that write can crash the process. With the thread held busy, backward returns with every
    bucket's source computed and compressed on backward's own thread. ``step()`` reads the
    gradients again, on its own thread, for the error update of each bucket (one worker error
    buffer): gradients edited in between are refused there, naming the cause, rather than
    mixed into the error feedback. 0/1 Adam: its sync steps (every step of its local phase at
    ``local_step_interval`` 1)."""
    from lightning_onebit import kernels

    models = [_model(), _model()]
    opts = [cls(m.parameters(), lr=1e-2, **kwargs) for m in models]
    for model, opt in zip(models, opts, strict=True):
        opt.overlap_with_backward(0.01)
        for t in (1, 2, 3):  # warmup, then compression steps (the thread exists from step 2)
            x, y = _batch(0, t)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    model, opt = models[0], opts[0]
    sources, compressions = [], []
    source, compress = opt.overlap.source, kernels.worker_compress

    def watched(*args, **kwargs):
        compressions.append(threading.current_thread())
        return compress(*args, **kwargs)

    opt.overlap.source = lambda s: (sources.append(threading.current_thread()), source(s))[1]
    kernels.worker_compress = watched
    gate = threading.Event()
    opt.overlap._pool.submit(gate.wait)  # the thread is busy until the gate opens
    buckets = len(opt.overlap.bounds)
    try:
        x, y = _batch(0, 4)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        assert opt.overlap._next == buckets  # every bucket handed over
        assert sources == [threading.main_thread()] * buckets
        assert compressions == [threading.main_thread()] * buckets
        for p in model.parameters():
            p.grad.fill_(float("nan"))  # (what a racing write would leave)
    finally:
        gate.set()
        kernels.worker_compress = compress
    with pytest.raises(RuntimeError, match="changed between its compression and its error"):
        opt.step()
    assert sources == [threading.main_thread()] * buckets  # none in step()


def test_overlap_arguments_are_checked() -> None:
    opt = OneBitAdam([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        opt.overlap_with_backward(0)
    opt.overlap_with_backward(1.0)
    assert opt.overlaps_backward
    opt.overlap_with_backward(None)
    assert not opt.overlaps_backward


def test_first_bucket_is_small_like_ddps() -> None:
    # 10 parameters of 0.4 MB: the first bucket (the last parameters) closes once it passes
    # 1 MiB (3 of them), the second takes the other 7 (2.8 MB < 25 MiB)
    params = [torch.nn.Parameter(torch.zeros(100_000)) for _ in range(10)]
    opt = OneBitAdam(params)
    opt.overlap_with_backward(25.0)
    opt._rebuild_if_stale()
    sizes = [hi - lo for lo, hi in opt.overlap.bounds]
    assert sizes == [300_000, 700_000], sizes
    assert opt.overlap.bounds[0][1] == 1_000_000  # exchanged first: the end of the layout
