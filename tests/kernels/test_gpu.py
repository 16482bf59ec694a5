"""The GPU path: skipped without a CUDA GPU; ``scripts/gpu_check.sh`` runs them.

Written by construction (no GPU where they were written): every test compares the GPU against
the CPU code that the rest of the suite checks, on the same inputs.
"""

from __future__ import annotations

import itertools
import math
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_onebit import kernels as K
from lightning_onebit.comm import BucketedAllreduce, CompressedAllreduce
from lightning_onebit.optim import OneBitAdam, OneBitLamb, ZeroOneAdam

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not (GPUS and K.HAS_CUDA), reason="needs a CUDA GPU (and CUDA kernels)"),
]
CLASSES = {"onebit_adam": OneBitAdam, "zero_one_adam": ZeroOneAdam, "onebit_lamb": OneBitLamb}


def test_exchange_on_gpu_equals_cpu_bitwise() -> None:
    """W = 1 (no process group): the whole exchange, error feedback over 5 calls, in one buffer
    and in buckets, is bit for bit the CPU's."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(10_007, generator=gen) for _ in range(5)]
    for make in (
        lambda d: CompressedAllreduce(10_007, device=d),
        lambda d: BucketedAllreduce([(0, 4_000), (4_000, 10_007)], device=d),
    ):
        cpu, gpu = make("cpu"), make("cuda")
        for x in xs:
            a, b = cpu(x.clone()), gpu(x.cuda())
            assert torch.equal(a, b.cpu())


# --------------------------------------------------------------------------- fused updates
# The CUDA kernels of adam_update / lamb_frozen_update against the CPU kernels, on the CPU tests'
# cases (tests/kernels/test_kernels.py: sizes 0, 1, 3, 5, 8, 77, 20_000, 70_000, gaps between parameters,
# random per-parameter hyperparameters, decay on some) and on sizes around the CUDA chunk
# (4096 values) with more chunks than the grid cap (1024 blocks), so the grid-stride loops wrap.
BIG_SIZES = [0, 5, 4096, 4097, 1, 5_000_003, 0, 77]


def _cpu_cases():
    import tests.kernels.test_kernels as T  # (imported here, as _fit does: `tests` is not a package)

    return T


def _on(bufs: dict, device: str) -> dict:
    return {k: (None if v is None else _to(v, device)) for k, v in bufs.items()}


def _to(v: torch.Tensor | K.Denominator, device: str) -> torch.Tensor | K.Denominator:
    """A tensor, or a Denominator's tensors, on ``device``."""
    if isinstance(v, K.Denominator):
        dscale = None if v.dscale is None else v.dscale.to(device)
        return K.Denominator(v.exp_avg_sq.to(device), v.eps, dscale)
    return v.to(device)


def _fed(d: torch.Tensor | None, segments: int) -> K.Denominator | None:
    """A Denominator whose kernels read exactly the buffer ``d`` (as test_kernels' ``_fed``):
    ``v = d * d``, ``eps`` 0 (the correctly rounded square root of ``fl(d * d)`` is ``d``)."""
    return None if d is None else K.Denominator(d * d, [0.0] * segments)


def _refuse(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the pure-torch path ran instead of the CUDA kernel")


@pytest.mark.parametrize("update_variance", [False, True])
@pytest.mark.parametrize("sizes", ["cpu_tests", "big"])
def test_adam_update_cuda_equals_cpu_bitwise(
    sizes: str, update_variance: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every moment and parameter value (gaps between parameters untouched) is the CPU
    kernel's, bit for bit: the same float32 operations in the same order, no FMA."""
    T = _cpu_cases()
    bufs, params, starts, hp = T._adam_case(
        31 + update_variance, sizes=T.ADAM_SIZES if sizes == "cpu_tests" else BIG_SIZES
    )
    (b_cpu, p_cpu) = T._adam_run(K.adam_update, (bufs, params, starts, hp), update_variance)
    monkeypatch.setattr(K.updates, "reference_adam_update", _refuse)
    gpu_case = (_on(bufs, "cuda"), [p.cuda() for p in params], starts, hp)
    (b_gpu, p_gpu) = T._adam_run(K.adam_update, gpu_case, update_variance)
    for k in b_cpu:
        assert torch.equal(b_gpu[k].cpu(), b_cpu[k]), k
    for j, (a, b) in enumerate(zip(p_gpu, p_cpu, strict=True)):
        assert torch.equal(a.cpu(), b), f"params[{j}] ({b.numel()} values)"


@pytest.mark.parametrize("update_variance", [False, True])
def test_adam_update_cuda_per_parameter_gradients_equal_the_flat_buffer_bitwise(
    update_variance: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA kernel reading each parameter's gradient where it lies (every third ``None``:
    zeros) writes the floats of the CPU kernel on the flat buffer, bit for bit."""
    T = _cpu_cases()
    case = T._adam_case(41 + update_variance, sizes=BIG_SIZES)
    grads, flat_bufs = T._per_parameter_grads(case)
    _, params, starts, hp = case
    b_cpu, p_cpu = T._adam_run(K.adam_update, (flat_bufs, params, starts, hp), update_variance)
    monkeypatch.setattr(K.updates, "reference_adam_update", _refuse)
    m, v = flat_bufs["exp_avg"].cuda(), flat_bufs["exp_avg_sq"].cuda()
    ps = [p.cuda() for p in params]
    g_gpu = [None if g is None else g.cuda() for g in grads]
    K.adam_update(g_gpu, m, v, ps, starts, **hp, update_variance=update_variance)
    assert torch.equal(m.cpu(), b_cpu["exp_avg"]) and torch.equal(v.cpu(), b_cpu["exp_avg_sq"])
    for j, (a, b) in enumerate(zip(ps, p_cpu, strict=True)):
        assert torch.equal(a.cpu(), b), f"params[{j}] ({b.numel()} values)"


def test_adam_update_cuda_other_dtypes() -> None:
    """A bf16 parameter (or one in a call with fp32 ones) takes the pure-torch path on both
    devices, as on the CPU: equal to the CPU's up to torch's rounding on each device."""
    T = _cpu_cases()
    for dtypes in ([torch.bfloat16] * 2, [torch.float32, torch.bfloat16]):
        bufs, params, starts, hp = T._adam_case(12, sizes=[1000, 24])
        params = [p.to(dt) for p, dt in zip(params, dtypes, strict=True)]
        b_cpu, p_cpu = T._adam_run(K.adam_update, (bufs, params, starts, hp), True)
        gpu_case = (_on(bufs, "cuda"), [p.cuda() for p in params], starts, hp)
        b_gpu, p_gpu = T._adam_run(K.adam_update, gpu_case, True)
        for k in b_cpu:
            torch.testing.assert_close(b_gpu[k].cpu(), b_cpu[k], rtol=2e-6, atol=5e-7)
        for a, b, b0 in zip(p_gpu, p_cpu, params, strict=True):
            assert a.dtype == b0.dtype and not torch.equal(a.cpu(), b0)  # updated
            torch.testing.assert_close(a.cpu(), b)


def _assert_lamb_stats(s_gpu: torch.Tensor, s_cpu: torch.Tensor, sizes: list[int]) -> None:
    """Max ratios bitwise (a max does not depend on the order); the float64 sums of squares
    within twice the worst-case rounding of summing n exact squares, (n - 1) * 2**-53 relative
    each way (the CPU and the GPU add them in different orders)."""
    assert s_gpu.device.type == "cuda" and s_gpu.dtype == torch.float64
    s_gpu = s_gpu.cpu()
    assert s_gpu.shape == s_cpu.shape == (len(sizes), 3)
    assert torch.equal(s_gpu[:, 0], s_cpu[:, 0]), "max ratio"
    for k, n in enumerate(sizes):
        tol = 2.0 * max(n - 1, 0) * 2.0**-53 * 1.001
        for c in (1, 2):
            a, b = float(s_gpu[k, c]), float(s_cpu[k, c])
            assert abs(a - b) <= tol * abs(b), f"layer {k} ({n} values), stat {c}: {a!r} vs {b!r}"


@pytest.mark.parametrize("decay", [False, True])
@pytest.mark.parametrize("sizes", ["cpu_tests", "big"])
def test_lamb_frozen_update_cuda_equals_cpu(
    sizes: str, decay: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """m, v_fresh and u bit for bit the CPU kernel's; stats as _assert_lamb_stats (empty layers:
    1, 0, 0). With decay, each layer's parameter in storage of its own (what the optimizer
    passes: read where it lies) gives the flat parameter's floats and stats bit for bit."""
    T = _cpu_cases()
    layer_sizes = T.LAMB_SIZES if sizes == "cpu_tests" else BIG_SIZES
    bufs, offsets, hp = T._lamb_case(41 + decay, decay, layer_sizes)
    b_cpu, s_cpu = T._lamb_run(K.lamb_frozen_update, bufs, offsets, hp)
    monkeypatch.setattr(K.updates, "reference_lamb_frozen_update", _refuse)
    b_gpu, s_gpu = T._lamb_run(K.lamb_frozen_update, _on(bufs, "cuda"), offsets, hp)
    for k in ("exp_avg", "exp_avg_sq_fresh", "update"):
        assert torch.equal(b_gpu[k].cpu(), b_cpu[k]), k
    _assert_lamb_stats(s_gpu, s_cpu, layer_sizes)
    if decay:
        layers = T._lamb_layers(_on(bufs, "cuda"), offsets, hp)[0]
        kept = [p.clone() for p in layers["param"]]
        with _NoHostSync():
            b_lay, s_lay = T._lamb_run(K.lamb_frozen_update, layers, offsets, hp)
        for k in ("exp_avg", "exp_avg_sq_fresh", "update"):
            assert torch.equal(b_lay[k], b_gpu[k]), k
        assert torch.equal(s_lay, s_gpu)
        assert all(torch.equal(a, b) for a, b in zip(layers["param"], kept, strict=True))


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many float32 steps apart (0 where equal)."""
    ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
    ia = torch.where(ia < 0, -(2**31) - ia, ia)  # monotone order across the sign
    ib = torch.where(ib < 0, -(2**31) - ib, ib)
    return (ia - ib).abs()


@pytest.mark.parametrize("precond", [False, True])
@pytest.mark.parametrize("sizes", ["cpu_tests", "big"])
def test_frozen_adam_update_cuda_equals_cpu(sizes: str, precond: bool) -> None:
    """1-bit Adam's fused compression-phase update against the CPU's torch ops: m bit for bit
    (a multiply or a copy), every parameter within one float32 step (the kernel rounds as the
    CPU's add_/addcdiv_ were measured to round on x86: fma for add_ with alpha; bit for bit
    there). A false verdict on the device: nothing written."""
    T = _cpu_cases()
    case = T._frozen_case(71 + precond, T.ADAM_SIZES if sizes == "cpu_tests" else BIG_SIZES)
    m_cpu, p_cpu = T.frozen_run(case, torch.ones(1, dtype=torch.bool), precond)
    x, m, d, params, starts, lr, wd = case
    gcase = (x.cuda(), m.cuda(), d.cuda(), [p.cuda() for p in params], starts, lr, wd)
    torch.cuda.set_sync_debug_mode("error")
    try:
        m_gpu, p_gpu = T.frozen_run(gcase, torch.ones(1, dtype=torch.bool, device="cuda"), precond)
        m_no, p_no = T.frozen_run(gcase, torch.zeros(1, dtype=torch.bool, device="cuda"), precond)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(m_gpu.cpu(), m_cpu)
    same = total = 0
    for j, (a, b) in enumerate(zip(p_gpu, p_cpu, strict=True)):
        apart = _ulps_apart(a.cpu(), b)
        assert apart.numel() == 0 or int(apart.max()) <= 1, f"params[{j}]: {int(apart.max())} ulps"
        same, total = same + int((apart == 0).sum()), total + apart.numel()
    print(f"\nfrozen_adam_update: {same} of {total} parameter values bit for bit the CPU's")
    assert torch.equal(m_no.cpu(), m)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(p_no, params, strict=True))


def test_a_false_verdict_on_the_device_writes_nothing() -> None:
    """lamb_frozen_update: ok true is the call without a verdict, bit for bit; false leaves m
    and v_fresh, zeroes u and gives stats 1, 0, 0. adam_update: true is the call without,
    false writes nothing. restore_unless copies only when false. All without a host
    synchronisation."""
    T = _cpu_cases()
    case = T._adam_case(91)
    gcase = (_on(case[0], "cuda"), [p.cuda() for p in case[1]], *case[2:])
    ref_adam = T._adam_run(K.adam_update, gcase, True)
    bufs, offsets, hp = T._lamb_case(81, True)
    g = _on(bufs, "cuda")
    yes = torch.ones(1, dtype=torch.bool, device="cuda")
    no = torch.zeros(1, dtype=torch.bool, device="cuda")
    ref, s_ref = T._lamb_run(K.lamb_frozen_update, g, offsets, hp)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got, s_got = T._lamb_run(
            lambda *a, **k: K.lamb_frozen_update(*a, **k, ok=yes), g, offsets, hp
        )
        bad, s_bad = T._lamb_run(
            lambda *a, **k: K.lamb_frozen_update(*a, **k, ok=no), g, offsets, hp
        )
        adam_yes = T._adam_run(lambda *a, **k: K.adam_update(*a, **k, ok=yes), gcase, True)
        adam_no = T._adam_run(lambda *a, **k: K.adam_update(*a, **k, ok=no), gcase, True)
        dst, src = torch.randn(1001, device="cuda"), torch.randn(1001, device="cuda")
        keep = dst.clone()
        K.restore_unless(yes, dst, src)
        kept = dst.clone()
        K.restore_unless(no, dst, src)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for k in ("exp_avg", "exp_avg_sq_fresh", "update"):
        assert torch.equal(got[k], ref[k]), k
    assert torch.equal(s_got, s_ref)
    for k in ("exp_avg", "exp_avg_sq_fresh"):
        assert torch.equal(bad[k], g[k]), k
    assert not bad["update"][: offsets[-1]].any()
    want = torch.tensor([[1.0, 0.0, 0.0]] * (len(offsets) - 1), dtype=torch.float64)
    assert torch.equal(s_bad.cpu(), want)
    assert torch.equal(kept, keep) and torch.equal(dst, src)
    for k in gcase[0]:
        assert torch.equal(adam_yes[0][k], ref_adam[0][k]), k
        assert torch.equal(adam_no[0][k], gcase[0][k]), k
    for a, b in zip(adam_yes[1], ref_adam[1], strict=True):
        assert torch.equal(a, b)
    assert all(torch.equal(a, p) for a, p in zip(adam_no[1], gcase[1], strict=True))


def _fused_updates_on(device: str, seed: int):
    """Both fused updates on `device` (CPU cases, fresh seeds), results on the CPU."""
    T = _cpu_cases()
    bufs, params, starts, hp = T._adam_case(seed)
    adam = T._adam_run(K.adam_update, (_on(bufs, device), [p.to(device) for p in params],
                                       starts, hp), True)  # fmt: skip
    lbufs, offsets, lhp = T._lamb_case(seed + 1, True)
    lamb = T._lamb_run(K.lamb_frozen_update, _on(lbufs, device), offsets, lhp)
    return (
        [t.cpu() for t in (*adam[0].values(), *adam[1])],
        [lamb[0][k].cpu() for k in ("exp_avg", "exp_avg_sq_fresh", "update")],
        lamb[1],
    )


def test_fused_updates_on_a_side_stream_without_host_sync() -> None:
    """Launched on the caller's current stream (a side stream here), with no host
    synchronisation (the hyperparameters travel from pinned memory): same bits as the CPU."""
    T = _cpu_cases()
    cpu = _fused_updates_on("cpu", 51)
    bufs, params, starts, hp = T._adam_case(51)
    lbufs, offsets, lhp = T._lamb_case(52, True)
    g_bufs, g_params, g_lbufs = _on(bufs, "cuda"), [p.cuda() for p in params], _on(lbufs, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda.set_sync_debug_mode("error")
        try:
            K.adam_update(*g_bufs.values(), g_params, starts, **hp)
            stats = K.lamb_frozen_update(*g_lbufs.values(), offsets, **lhp)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(side)
    adam = [t.cpu() for t in (*g_bufs.values(), *g_params)]
    lamb = [g_lbufs[k].cpu() for k in ("exp_avg", "exp_avg_sq_fresh", "update")]
    assert all(torch.equal(a, b) for a, b in zip(adam, cpu[0], strict=True)), "adam"
    assert all(torch.equal(a, b) for a, b in zip(lamb, cpu[1], strict=True)), "lamb"
    _assert_lamb_stats(stats, cpu[2], T.LAMB_SIZES)


@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
def test_fused_updates_on_the_second_gpu() -> None:
    """Tensors on cuda:1 while cuda:0 is current (a missing device guard launches on the
    wrong GPU): same bits as the CPU."""
    T = _cpu_cases()
    cpu = _fused_updates_on("cpu", 61)
    with torch.cuda.device(0):
        gpu = _fused_updates_on("cuda:1", 61)
        torch.cuda.synchronize(1)
    for a, b in zip(gpu[0] + gpu[1], cpu[0] + cpu[1], strict=True):
        assert torch.equal(a, b)
    assert gpu[2].device == torch.device("cuda:1")
    _assert_lamb_stats(gpu[2], cpu[2], T.LAMB_SIZES)


# --------------------------------------------------------------------------- integer codec
# The CUDA codec (quantize, quantized_reduce, dequantize) against the CPU kernels, and the torch
# twins run on the GPU against them too: W = 3 and 5 and the codec's 7 and 127 are divisors
# whose reciprocal is inexact (torch's CUDA division by a Python number multiplies by it).
# Blocks of 2 to 4096 values, padding (nx < n), no error, the error in place, rows whose stride
# is no multiple of 4 (unaligned scales), and more codec blocks than the grid's warps (wraps).
CODEC_CASES = [(4, 256, 3, 7), (8, 256, 5, 3), (4, 2, 3, 9), (8, 4096, 1, 2), (4, 256, 3, 4000)]


def _codec_calls(
    device: str, twin: bool, bits: int, block: int, w: int, blocks: int, seed: int, pad: int = 3
) -> list[torch.Tensor]:
    """Every output of quantize (error new, in place, none), quantized_reduce (error given and
    none) and dequantize on ``device`` from the same inputs, on the CPU; rows ``pad`` bytes wider
    than they need (the twins need their stride a multiple of 4: they view the scales)."""
    gen = torch.Generator().manual_seed(seed)
    m = block * blocks
    n, row = w * m, K.row_bytes(m, bits, block)
    x = torch.randn(n - 5, generator=gen) * torch.exp(torch.randn(n - 5, generator=gen) * 3)
    x[torch.rand(n - 5, generator=gen) < 0.05] = 0.0
    e, es = torch.randn(n, generator=gen) * 0.01, torch.randn(m, generator=gen) * 0.01
    quantize = K.reference_quantize if twin else K.quantize
    reduce = K.reference_quantized_reduce if twin else K.quantized_reduce
    dequantize = K.reference_dequantize if twin else K.dequantize
    out: list[torch.Tensor] = []
    on = {"x": x.to(device), "e": e.to(device), "es": es.to(device)}
    rows = torch.zeros(w, row + pad, dtype=torch.uint8, device=device)
    err = torch.empty(n, device=device)
    quantize(on["x"], on["e"], rows, bits=bits, block=block, error_out=err)
    out += [rows.clone(), err]
    inplace = on["e"].clone()
    quantize(on["x"], inplace, rows, bits=bits, block=block)
    out += [rows.clone(), inplace]
    quantize(on["x"], None, rows, bits=bits, block=block, n=n)
    out.append(rows.clone())
    for error in (on["es"].clone(), None):
        got = torch.zeros(row, dtype=torch.uint8, device=device)
        reduce(rows, error, got, m=m, bits=bits, block=block)
        out += [got] + ([] if error is None else [error])
    dec = torch.empty(n - 3, device=device)
    dequantize(rows, dec, m=m, bits=bits, block=block)
    out.append(dec)
    return [t.cpu() for t in out]


@pytest.mark.parametrize(("bits", "block", "w", "blocks"), CODEC_CASES)
def test_codec_cuda_equals_cpu_bitwise(
    bits: int, block: int, w: int, blocks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu = _codec_calls("cpu", False, bits, block, w, blocks, bits + block + w)
    for name in ("reference_quantize", "reference_quantized_reduce", "reference_dequantize"):
        monkeypatch.setattr(K.quantized, name, _refuse)
    gpu = _codec_calls("cuda", False, bits, block, w, blocks, bits + block + w)
    for k, (a, b) in enumerate(zip(gpu, cpu, strict=True)):
        assert torch.equal(a, b), f"output {k}"


@pytest.mark.parametrize(("bits", "block", "w", "blocks"), CODEC_CASES[:3])
def test_codec_twins_on_the_gpu_equal_the_cpu_kernels_bitwise(
    bits: int, block: int, w: int, blocks: int
) -> None:
    cpu = _codec_calls("cpu", False, bits, block, w, blocks, 5 * bits + block + w, pad=4)
    twin = _codec_calls("cuda", True, bits, block, w, blocks, 5 * bits + block + w, pad=4)
    for k, (a, b) in enumerate(zip(twin, cpu, strict=True)):
        assert torch.equal(a, b), f"output {k}"


def test_codec_cuda_non_finite_input_makes_its_blocks_scale_non_finite() -> None:
    bits, block, w, m = 4, 256, 2, 512
    for bad in (float("nan"), float("inf")):
        x = torch.randn(w * m, device="cuda")
        x[300] = bad  # block 1 of row 0
        rows = torch.zeros(w, K.row_bytes(m, bits, block), dtype=torch.uint8, device="cuda")
        K.quantize(x, None, rows, bits=bits, block=block, n=w * m)
        scales = torch.stack([rows[j, :8].view(torch.float32) for j in range(w)]).cpu()
        assert not torch.isfinite(scales[0, 1]) and torch.isfinite(scales.view(-1)[[0, 2, 3]]).all()


@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
def test_codec_on_the_second_gpu() -> None:
    """Tensors on cuda:1 while cuda:0 is current: the device guard launches there."""
    cpu = _codec_calls("cpu", False, 4, 256, 3, 7, 3)
    with torch.cuda.device(0):
        gpu = _codec_calls("cuda:1", False, 4, 256, 3, 7, 3)
    assert all(torch.equal(a, b) for a, b in zip(gpu, cpu, strict=True))


# ------------------------------------------------------- exchange sources and 0/1 Adam's sync
# momentum_source, local_source and sync_update: the CUDA kernels against the torch ops they
# replace (the reference_* twins) on the same GPU, bit for bit (they round as torch's CUDA
# kernels do): fresh random inputs with zeros of both signs, segments of 1 to 1_000_003 values
# around the CUDA chunk (4096 values), an empty one, 3-value gaps that must stay untouched;
# "big" has more chunks than the grid cap (1024 blocks), so the grid-stride loops wrap.
SEGMENT_SIZES = {"small": [1, 7, 0, 4096, 4097, 33, 1_000_003], "big": [5_000_003, 1, 4095]}


def _segments(sizes: list[int]) -> tuple[list[int], int]:
    """Starts of ``sizes`` laid out with a 3-value gap before each, and the buffer length."""
    starts, n = [], 0
    for size in sizes:
        starts.append(n + 3)
        n += size + 3
    return starts, n + 3


def _fresh(n: int, gen: torch.Generator, scale: float = 1.0, device: str = "cuda") -> torch.Tensor:
    """``n`` random normal floats times ``scale``, with some +0.0 and -0.0."""
    t = torch.randn(n, generator=gen) * scale
    t[::97] = 0.0
    t[1::101] = -0.0
    return t.to(device)


def _positive(n: int, gen: torch.Generator, device: str = "cuda") -> torch.Tensor:
    """A ``sqrt(v) + eps``-like denominator: positive, 1e-4 to 0.1."""
    return (torch.rand(n, generator=gen) * 0.1 + 1e-4).to(device)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal as bit patterns (NaNs included: the untouched gaps)."""
    as_int = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(as_int), b.view(as_int))


class _NoHostSync:
    """A block that fails on any host synchronisation (torch's sync debug mode "error")."""

    def __enter__(self) -> None:
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_sync_debug_mode("default")


def _source_hp(k: int, gen: torch.Generator) -> tuple[list[float], ...]:
    """Per segment beta, alpha, lr, weight decay (1.0 on segment 1: addcmul_'s value-1 case;
    0 on every third from segment 2: no decay term)."""
    r = torch.rand(k, generator=gen).tolist()
    beta = [0.8 + 0.19 * a for a in r]
    alpha = [(1 - b) * (0.5 + a) for b, a in zip(beta, r[::-1], strict=True)]
    lr = [1e-3 * (1 + a) for a in r]
    wd = [1.0 if j == 1 else 0.0 if j % 3 == 2 else 0.01 * (1 + a) for j, a in enumerate(r)]
    return beta, alpha, lr, wd


def _local_hp(k: int, gen: torch.Generator) -> dict[str, list[float]]:
    """``_source_hp`` by the names ``local_source`` takes them."""
    return dict(zip(("beta", "alpha", "lr", "weight_decay"), _source_hp(k, gen), strict=True))


@pytest.mark.parametrize("divide", [False, True])
@pytest.mark.parametrize("sizes", list(SEGMENT_SIZES))
def test_momentum_source_cuda_is_the_torch_ops_bitwise(
    sizes: str, divide: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA kernel writes the floats of ``torch.mul(m, beta).add_(g, alpha=alpha)`` (then
    ``div_(d)``) on the GPU bit for bit, without a host synchronisation; gaps untouched,
    inputs unchanged."""
    seg = SEGMENT_SIZES[sizes]
    gen = torch.Generator().manual_seed(101 + 2 * divide + len(seg))
    starts, n = _segments(seg)
    m, g, d = _fresh(n, gen, 0.1), _fresh(n, gen, 1e-3), _positive(n, gen)
    beta, alpha, _, _ = _source_hp(len(seg), gen)
    args = (m, g, _fed(d, len(seg)) if divide else None)
    before = [t.clone() for t in (m, g, d)]
    want = torch.full_like(m, math.nan)
    K.reference_momentum_source(*args, want, starts, seg, beta, alpha)
    monkeypatch.setattr(K.sources, "reference_momentum_source", _refuse)
    got = torch.full_like(m, math.nan)
    with _NoHostSync():
        K.momentum_source(*args, got, starts, seg, beta, alpha)
    assert _same_bits(got, want)
    assert all(torch.equal(a, b) for a, b in zip(before, (m, g, d), strict=True))


@pytest.mark.parametrize("divide", [False, True])
@pytest.mark.parametrize("sizes", list(SEGMENT_SIZES))
def test_momentum_source_cuda_per_segment_grads_are_the_flat_form_bitwise(
    sizes: str, divide: bool
) -> None:
    """The gradient given per segment (storage of its own, some 2-D, None on every third
    segment: zeros) gives the floats of the flat buffer holding the same values (zeros where
    None) bit for bit, and of the torch ops on those tensors; gaps untouched, inputs unchanged."""
    seg = SEGMENT_SIZES[sizes]
    gen = torch.Generator().manual_seed(131 + 2 * divide + len(seg))
    starts, n = _segments(seg)
    m, g, d = _fresh(n, gen, 0.1), _fresh(n, gen, 1e-3), _positive(n, gen)
    beta, alpha, _, _ = _source_hp(len(seg), gen)
    grads = []
    for k, (lo, size) in enumerate(zip(starts, seg, strict=True)):
        if k % 3 == 1:
            g[lo : lo + size] = 0.0
            grads.append(None)
        else:
            piece = g[lo : lo + size].clone()
            grads.append(piece.view(-1, 3) if size % 3 == 0 else piece)
    flat = torch.full_like(m, math.nan)
    K.momentum_source(m, g, _fed(d, len(seg)) if divide else None, flat, starts, seg, beta, alpha)
    want = torch.full_like(m, math.nan)
    K.reference_momentum_source(
        m, grads, _fed(d, len(seg)) if divide else None, want, starts, seg, beta, alpha
    )
    before = [None if t is None else t.clone() for t in grads]
    got = torch.full_like(m, math.nan)
    with _NoHostSync():
        K.momentum_source(
            m, grads, _fed(d, len(seg)) if divide else None, got, starts, seg, beta, alpha
        )
    assert _same_bits(got, flat)
    assert _same_bits(got, want)
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(grads, before, strict=True))


@pytest.mark.parametrize("precond", [False, True])
@pytest.mark.parametrize("sizes", list(SEGMENT_SIZES))
def test_local_source_cuda_is_the_torch_ops_bitwise(
    sizes: str, precond: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA kernel writes the floats of 0/1 Adam's torch ops (reference_local_source) on
    the GPU bit for bit, with and without the decay and the accumulator terms, a weight decay
    of 1 on one segment (addcmul_'s value-1 case), without a host synchronisation; gaps
    untouched, inputs unchanged."""
    seg = SEGMENT_SIZES[sizes]
    gen = torch.Generator().manual_seed(201 + 2 * precond + len(seg))
    starts, n = _segments(seg)
    tensors = (_fresh(n, gen, 0.1), _fresh(n, gen, 1e-3), _positive(n, gen))
    p, acc = _fresh(n, gen), _fresh(n, gen, 1e-3)
    hp = _local_hp(len(seg), gen)
    before = [t.clone() for t in (*tensors, p, acc)]
    m, g, d = tensors
    for decay, with_acc in itertools.product((False, True), repeat=2):
        args = dict(exp_avg=m, grad=g, denom=_fed(d, len(seg)), param=p if decay else None,
                    acc=acc if with_acc else None, starts=starts, sizes=seg, **hp,
                    preconditioned=precond)  # fmt: skip
        want = torch.full_like(p, math.nan)
        K.reference_local_source(out=want, **args)
        got = torch.full_like(p, math.nan)
        with monkeypatch.context() as mp, _NoHostSync():
            mp.setattr(K.sources, "reference_local_source", _refuse)
            K.local_source(out=got, **args)
        assert _same_bits(got, want), (decay, with_acc)
    assert all(torch.equal(a, b) for a, b in zip(before, (*tensors, p, acc), strict=True))


@pytest.mark.parametrize("sizes", list(SEGMENT_SIZES))
def test_local_source_cuda_per_segment_tensors_are_the_flat_form_bitwise(sizes: str) -> None:
    """The gradient and the parameter given per segment give the flat buffers' floats on the GPU
    bit for bit: as views of those buffers and as tensors of their own (the gradient's some
    None: zeros), each read where it lies, without a host synchronisation."""
    seg = SEGMENT_SIZES[sizes]
    gen = torch.Generator().manual_seed(301 + len(seg))
    starts, n = _segments(seg)
    m, g, d = _fresh(n, gen, 0.1), _fresh(n, gen, 1e-3), _positive(n, gen)
    p, acc = _fresh(n, gen), _fresh(n, gen, 1e-3)
    hp = _local_hp(len(seg), gen)
    own = [
        None if k % 3 == 1 else g[lo : lo + z].clone()
        for k, (lo, z) in enumerate(zip(starts, seg, strict=True))
    ]
    zeroed = g.clone()
    for lo, z, t in zip(starts, seg, own, strict=True):
        if t is None:
            zeroed[lo : lo + z] = 0.0
    pieces = list(zip(starts, seg, strict=True))
    params = ([p[lo : lo + z] for lo, z in pieces], [p[lo : lo + z].clone() for lo, z in pieces])
    for precond in (False, True):
        for grad, flat in (([g[lo : lo + z] for lo, z in pieces], g), (own, zeroed)):
            want = torch.full_like(p, math.nan)
            common = dict(exp_avg=m, denom=_fed(d, len(seg)), acc=acc, starts=starts, sizes=seg, **hp,
                          preconditioned=precond)  # fmt: skip
            K.local_source(grad=flat, param=p, out=want, **common)
            for param in (p, *params):
                got = torch.full_like(p, math.nan)
                with _NoHostSync():
                    K.local_source(grad=grad, param=param, out=got, **common)
                assert _same_bits(got, want), precond


#: tilings of an exchange's bucket for the sources computed as read: the CPU tests' (segment
#: ends inside a lane's four values, inside and across 128-value warp segments and rows),
#: empty segments, and one past a warp segment per value.
CUDA_TILINGS = {
    **_cpu_cases().SOURCE_TILINGS,
    "empty": [0, 5, 0, 0, 3, 1, 1, 1, 0, 130, 0, 2],
    "long": [3, 1_000_003, 129],
}


def _compress_on_gpu(x, w: int, pending: bool, seed: int):
    """Deferred worker_compress of ``x`` (a CUDA tensor or ExchangeSource) with a fresh error
    and previous bits and scale from ``seed``, without a host synchronisation: (bits, scale,
    y) after the call."""
    gen = torch.Generator().manual_seed(seed)
    nx = x.numel()
    n = -(-nx // (8 * w)) * 8 * w
    error, y = torch.randn(n, generator=gen).cuda(), torch.full((n,), math.nan, device="cuda")
    prev = torch.randint(0, 256, (w, n // (8 * w)), generator=gen, dtype=torch.uint8).cuda()
    bits, scale, prev_scale = (
        torch.zeros_like(prev),
        torch.zeros(1).cuda(),
        torch.tensor([0.03]).cuda(),
    )
    with _NoHostSync():
        K.worker_compress(x, error, bits, scale, deferred=True, error_out=y, pending=pending,
                          prev_bits=prev, prev_scale=prev_scale)  # fmt: skip
    return bits, scale, y


class _Without:
    """The compiled module with its entry ``name`` refusing to run."""

    def __init__(self, module: Any, name: str) -> None:
        self.module, self.name = module, name

    def __getattr__(self, name: str) -> Any:
        return _refuse if name == self.name else getattr(self.module, name)


def _check_compressed_as_read(
    make: Any, buf: torch.Tensor, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """For W = 1, 2, 3, with and without a pending update: the source ``make(out)`` compressed
    as it is read gives the bits, scale and y of its values in ``buf`` compressed, bit for
    bit, without running the source kernel (the module's entry ``kernel``) or writing ``out``."""
    for w, pending in itertools.product((1, 2, 3), (False, True)):
        out = torch.full_like(buf, math.nan)
        source = make(out)
        assert source.computed_as_read
        want = _compress_on_gpu(buf[source.lo : source.hi], w, pending, seed=w)
        with monkeypatch.context() as mp:
            mp.setattr(K.native, "module", _Without(K.native.module, kernel))
            got = _compress_on_gpu(source, w, pending, seed=w)
        assert all(_same_bits(a, b) for a, b in zip(got, want, strict=True)), (w, pending)
        assert out.isnan().all(), (w, pending)


@pytest.mark.parametrize("tiling", list(CUDA_TILINGS))
@pytest.mark.parametrize("divide", [False, True])
def test_worker_compress_of_a_momentum_source_cuda_is_the_buffer_form_bitwise(
    tiling: str, divide: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the GPU a MomentumSource is compressed as it is read: the bits, scale and y of
    ``momentum_source`` into a buffer then ``worker_compress`` of it, bit for bit (W = 1, 2,
    3, with and without a pending update), without writing ``out`` or running the source
    kernel; the inputs unchanged."""
    m, grads, d, starts, sizes, beta, alpha = _cpu_cases()._tiled(CUDA_TILINGS[tiling], len(tiling))
    m, d = m.cuda(), d.cuda() if divide else None
    grads = [None if g is None else g.cuda() for g in grads]
    before = [None if t is None else t.clone() for t in (m, d, *grads)]
    buf = torch.full_like(m, math.nan)
    K.momentum_source(m, grads, _fed(d, len(sizes)), buf, starts, sizes, beta, alpha)
    _check_compressed_as_read(
        lambda out: K.MomentumSource(
            m, grads, _fed(d, len(sizes)), out, starts, sizes, beta, alpha
        ),
        buf,
        "momentum_source_cuda",
        monkeypatch,
    )
    after = (m, d, *grads)
    assert all(a is b is None or _same_bits(a, b) for a, b in zip(after, before, strict=True))


@pytest.mark.parametrize("tiling", list(CUDA_TILINGS))
@pytest.mark.parametrize("precond", [False, True])
def test_worker_compress_of_a_local_source_cuda_is_the_buffer_form_bitwise(
    tiling: str, precond: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the GPU a LocalSource is compressed as it is read: the bits, scale and y of
    ``local_source`` into a buffer then ``worker_compress`` of it, bit for bit (W = 1, 2, 3,
    with and without a pending update; without the decay and accumulator terms, with them on
    the flat parameter and on parameters of their own), without writing ``out`` or running
    the source kernel; the inputs unchanged."""
    T = _cpu_cases()
    tensors, p, acc, starts, sizes, hp = T._local_tiled(CUDA_TILINGS[tiling], len(tiling) + 1)
    m, grads, d = tensors
    tensors = (m.cuda(), [None if g is None else g.cuda() for g in grads], d.cuda())
    p, acc = p.cuda(), acc.cuda()
    kept = [t.clone() for t in (tensors[0], tensors[2], p, acc)]
    common = dict(exp_avg=tensors[0], grad=tensors[1], denom=_fed(tensors[2], len(starts)), starts=starts,
                  sizes=sizes, **hp, preconditioned=precond)  # fmt: skip
    for param in (None, p, T._param_pieces(p, starts, sizes)):
        terms = dict(param=param, acc=None if param is None else acc, **common)
        buf = torch.full_like(p, math.nan)
        K.local_source(out=buf, **{**terms, "param": None if param is None else p})
        _check_compressed_as_read(
            lambda out, terms=terms: K.LocalSource(out=out, **terms),
            buf,
            "local_source_cuda",
            monkeypatch,
        )
    after = (tensors[0], tensors[2], p, acc)
    assert all(_same_bits(a, b) for a, b in zip(after, kept, strict=True))


@pytest.mark.parametrize("sizes", list(SEGMENT_SIZES))
def test_layer_step_cuda_is_the_torch_ops_bitwise(
    sizes: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One kernel writes the floats of ``p.addcmul_(u_j, alpha[j])`` per parameter bit for bit
    (parameters of their own, some 2-D; alpha on the device, one value +0.0 and one -1e-30),
    without a host synchronisation; the update and alpha unchanged. A non-contiguous
    parameter takes the torch ops, with the same floats."""
    seg = SEGMENT_SIZES[sizes]
    gen = torch.Generator().manual_seed(401 + len(seg))
    starts, n = _segments(seg)
    u = _fresh(n, gen, 1e-2)
    alpha = (-torch.rand(len(seg), generator=gen) * 1e-3).cuda()
    alpha[0], alpha[-1] = 0.0, -1e-30
    params = [_fresh(z, gen).view(-1, 3) if z and z % 3 == 0 else _fresh(z, gen) for z in seg]
    want = [p.clone() for p in params]
    K.reference_layer_step(u, want, starts, alpha)
    kept = (u.clone(), alpha.clone())
    with monkeypatch.context() as mp, _NoHostSync():
        mp.setattr(K.updates, "reference_layer_step", _refuse)
        K.layer_step(u, params, starts, alpha)
    assert all(_same_bits(a, b) for a, b in zip(params, want, strict=True))
    assert _same_bits(u, kept[0]) and _same_bits(alpha, kept[1])
    odd = [p.t() if p.dim() == 2 else p for p in (q.clone() for q in params)]
    twin = [p.clone() for p in odd]
    K.reference_layer_step(u, twin, starts, alpha)
    K.layer_step(u, odd, starts, alpha)
    assert all(_same_bits(a, b) for a, b in zip(odd, twin, strict=True))


def _sync_case(seg: list[int], seed: int, device: str = "cuda"):
    """Inputs of sync_update: (x, d, m, synced), floored, acc, the parameters, starts and per
    parameter lrs: 0 on parameter 2 (m = 0), 1e-50 on parameter 1 (-lrs rounds to -0.0)."""
    gen = torch.Generator().manual_seed(seed)
    starts, n = _segments(seg)
    tensors = (
        _fresh(n, gen, 0.1, device),
        _positive(n, gen, device),
        _fresh(n, gen, 1.0, device),
        _fresh(n, gen, 1.0, device),
    )
    floored = (torch.rand(n, generator=gen) < 0.2).to(device)
    acc = _fresh(n, gen, 1e-3, device)
    params = [torch.randn(k, generator=gen).to(device) for k in seg]
    r = torch.rand(len(seg), generator=gen).tolist()
    lrs = [
        0.0 if j == 2 else 1e-50 if j == 1 else 1e-3 * (j + 1) * (1 + a) for j, a in enumerate(r)
    ]
    return tensors, floored, acc, params, starts, lrs


def _sync_run(fn, case, with_floor: bool, with_acc: bool, dtype: torch.dtype, precond: bool):
    """sync_update (or its twin) on copies of ``case``: (m, synced, acc, params)."""
    (x, d, m, synced), floored, acc, params, starts, lrs = case
    m, synced, acc = m.clone(), synced.clone(), acc.clone()
    ps = [p.to(dtype, copy=True) for p in params]  # (fresh tensors: autograd version 0)
    fn(exchanged=x, denom=_fed(d, len(params)), exp_avg=m, synced=synced, floored=floored if with_floor else None,
       acc=acc if with_acc else None, params=ps, starts=starts, lrs=lrs,
       preconditioned=precond)  # fmt: skip
    return m, synced, acc, ps


@pytest.mark.parametrize("precond", [False, True])
@pytest.mark.parametrize("sizes", list(SEGMENT_SIZES))
def test_sync_update_cuda_is_the_torch_ops_bitwise(
    sizes: str, precond: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA kernel writes the floats of 0/1 Adam's torch ops (reference_sync_update) on the
    GPU bit for bit: the momentum (torch's division by -lrs, a multiply by the reciprocal; 0
    where lrs is 0), the synced copy, the cleared accumulator and the parameters (fp32 written
    by the kernel, bf16 copied after it), with and without the floored mask and the
    accumulator, without a host synchronisation; gaps untouched, parameters' versions bumped."""
    seg = SEGMENT_SIZES[sizes]
    case = _sync_case(seg, 301 + 2 * precond + len(seg))
    runs = [(f, a, torch.float32) for f, a in itertools.product((False, True), repeat=2)]
    for with_floor, with_acc, dtype in [*runs, (True, True, torch.bfloat16)]:
        flags = (with_floor, with_acc, dtype, precond)
        want = _sync_run(K.reference_sync_update, case, *flags)
        with monkeypatch.context() as mp, _NoHostSync():
            mp.setattr(K.updates, "reference_sync_update", _refuse)
            got = _sync_run(K.sync_update, case, *flags)
        what = (with_floor, with_acc, dtype)
        assert all(_same_bits(a, b) for a, b in zip(got[:3], want[:3], strict=True)), what
        assert all(_same_bits(a, b) for a, b in zip(got[3], want[3], strict=True)), what
        assert all(p._version > 0 for p in got[3]), what  # written: autograd told
    m = want[0]
    lo = case[4][2]
    assert not m[lo : lo + seg[2]].any()  # lrs 0: m = 0


def _three_inputs(device: str, seed: int) -> tuple:
    """Inputs of :func:`_three_kernels` on the "small" segments on ``device`` (made here, not
    in a block that forbids host synchronisation: a copy from pageable host memory waits)."""
    seg = SEGMENT_SIZES["small"]
    gen = torch.Generator().manual_seed(seed)
    _, n = _segments(seg)
    tensors = [_fresh(n, gen, 0.1, device) for _ in range(4)]
    tensors.append(_positive(n, gen, device))
    return tensors, _source_hp(len(seg), gen), _sync_case(seg, seed + 1, device)


def _three_kernels(inputs: tuple, fns: dict) -> list[torch.Tensor]:
    """momentum_source, local_source (decay and accumulator) and sync_update (floored, acc) on
    copies of ``inputs`` (:func:`_three_inputs`), through ``fns`` (the kernels or their twins,
    by name): every output."""
    seg = SEGMENT_SIZES["small"]
    starts, _ = _segments(seg)
    tensors, (beta, alpha, lr, wd), case = inputs
    m, g, p, acc, d = (t.clone() for t in tensors)
    u1, u2 = torch.full_like(m, math.nan), torch.full_like(m, math.nan)
    fns["momentum_source"](m, g, _fed(d, len(seg)), u1, starts, seg, beta, alpha)
    fns["local_source"](exp_avg=m, grad=g, denom=_fed(d, len(seg)), param=p, acc=acc, out=u2, starts=starts,
                        sizes=seg, beta=beta, alpha=alpha, lr=lr, weight_decay=wd,
                        preconditioned=False)  # fmt: skip
    synced = _sync_run(fns["sync_update"], case, True, True, torch.float32, False)
    return [u1, u2, *synced[:3], *synced[3]]


_THREE = ("momentum_source", "local_source", "sync_update")
_KERNELS = {name: getattr(K, name) for name in _THREE}
_TWINS = {name: getattr(K, f"reference_{name}") for name in _THREE}
#: the module whose public function calls each twin
_DISPATCHER = {"momentum_source": K.sources, "local_source": K.sources, "sync_update": K.updates}


def test_sources_and_sync_on_a_side_stream_without_host_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Launched on the caller's current stream (a side stream here), with no host
    synchronisation (the tables travel from pinned memory): the twins' floats."""
    inputs = _three_inputs("cuda", 71)
    want = _three_kernels(inputs, _TWINS)
    for name in _THREE:
        monkeypatch.setattr(_DISPATCHER[name], f"reference_{name}", _refuse)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), _NoHostSync():
        got = _three_kernels(inputs, _KERNELS)
    torch.cuda.current_stream().wait_stream(side)
    assert all(_same_bits(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
def test_sources_and_sync_on_the_second_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors on cuda:1 while cuda:0 is current (a missing device guard launches on the
    wrong GPU): the twins' floats on cuda:1."""
    inputs = _three_inputs("cuda:1", 81)
    with torch.cuda.device(1):
        want = _three_kernels(inputs, _TWINS)
    for name in _THREE:
        monkeypatch.setattr(_DISPATCHER[name], f"reference_{name}", _refuse)
    with torch.cuda.device(0):
        got = _three_kernels(inputs, _KERNELS)
        torch.cuda.synchronize(1)
    assert all(t.device == torch.device("cuda:1") for t in got)
    assert all(_same_bits(a, b) for a, b in zip(got, want, strict=True))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(64, 32),
        torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0),
        torch.nn.Linear(32, 64),
    )


def _train(
    device: str, algo: str, paused: bool, steps: int = 16, seed: int = 1, nudge: bool = False
) -> torch.Tensor:
    """The parameters after ``steps`` steps (``nudge``: every initial value one float32 ulp up)."""
    model = _model().to(device)
    if nudge:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.nextafter(p, torch.full_like(p, math.inf)))
    opt = CLASSES[algo](
        model.parameters(),
        lr=1e-3,
        **{"freeze_step": 4} if algo != "zero_one_adam" else {"var_freeze_step": 4},
    )
    opt.overlap_with_backward(0.01)  # several buckets
    opt.overlap_paused = paused  # (paused: every bucket starts in step())
    data = torch.randint(0, 64, (steps, 8, 9), generator=torch.Generator().manual_seed(seed))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # young variance
        for t in range(steps):
            x = data[t].to(device)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(
                model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()
            )
            loss.backward()
            opt.step()
    opt.overlap_with_backward(None)
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


@pytest.mark.parametrize("algo", list(CLASSES))
def test_optimizer_on_gpu_matches_cpu(algo: str) -> None:
    """16 steps (12 compressed), the exchange in buckets overlapped with backward on the GPU (the
    communication thread, its stream and events): equal to the same buckets started in step()
    on the GPU, and to the CPU run up to rounding: the fused Adam/LAMB updates are the CPU's
    arithmetic, but the optimizers' other torch ops (LAMB's per-layer coefficients, the
    compression-phase steps) may round differently on the GPU (FMA, reduction order).

    A rounding difference is amplified where a compressed value is near 0: its sign bit flips
    and the coordinate moves by +-lr * scale / d instead (error feedback takes it back later);
    two CPU runs whose initial parameters differ by one ulp differ as much. So: at most 1% of the
    values may differ, by at most 20 lr; a missing stream wait or a wrong device would corrupt
    whole buckets (the runs the bounds come from:
    benchmarks/results/gpu-test-bounds-2026-11-26.md)."""
    cpu = _train("cpu", algo, paused=False)
    gpu = _train("cuda", algo, paused=False)
    gpu_in_step = _train("cuda", algo, paused=True)
    assert torch.equal(gpu, gpu_in_step)  # the overlap's timing changes nothing
    _assert_close_up_to_sign_flips(gpu, cpu, lr=1e-3)


def _assert_close_up_to_sign_flips(gpu: torch.Tensor, cpu: torch.Tensor, lr: float) -> None:
    diff = (gpu - cpu).abs()
    off = diff > 1e-5 + 1e-4 * cpu.abs()
    assert off.float().mean() <= 0.01, f"{int(off.sum())} of {off.numel()} values differ"
    assert diff.max() <= 20 * lr, f"max |gpu - cpu| = {float(diff.max()):.3g} (> 20 lr)"


def _two_ranks_on_one_gpu(rank: int, world_size: int) -> dict[str, Any]:
    """(a rank of the test below) Exchange and optimizers on cuda:0 and on the CPU, W = 2: the
    optimizers overlapped and in step() on the GPU; on the CPU from the same and from nudged
    initial parameters."""
    torch.cuda.set_device(0)
    try:  # gloo moves CUDA tensors through host memory: these collectives must exist for it
        probe = torch.zeros(8 * world_size, dtype=torch.uint8, device="cuda")
        torch.distributed.all_to_all_single(probe.clone(), probe)
        torch.distributed.all_gather_into_tensor(probe.clone(), probe[:8])
        torch.distributed.all_reduce(probe.float())
    except (RuntimeError, ValueError) as e:
        return {"skip": f"gloo in this torch cannot run the exchange on CUDA tensors: {e}"}
    gen = torch.Generator().manual_seed(rank)
    equal = []
    for make in (
        lambda d: CompressedAllreduce(10_007, device=d),
        lambda d: BucketedAllreduce([(0, 4_000), (4_000, 10_007)], device=d),
    ):
        cpu, gpu = make("cpu"), make("cuda")
        for _ in range(5):  # error feedback over 5 calls
            x = torch.randn(10_007, generator=gen)
            equal.append(torch.equal(cpu(x.clone()), gpu(x.cuda()).cpu()))
    out: dict[str, Any] = {"exchange_equal": equal}
    for algo in CLASSES:  # each rank its own batches
        out[algo] = {
            "gpu": _train("cuda", algo, paused=False, seed=1 + rank),
            "gpu_in_step": _train("cuda", algo, paused=True, seed=1 + rank),
            "cpu": _train("cpu", algo, paused=False, seed=1 + rank),
            "cpu_nudged": _train("cpu", algo, paused=False, seed=1 + rank, nudge=True),
        }
    return out


def test_two_ranks_on_one_gpu_over_gloo() -> None:
    """Two ranks share cuda:0 (NCCL refuses two ranks on one GPU; gloo stages CUDA tensors
    through the host): the W = 2 exchange on the GPU is bit for bit the CPU's; the three
    optimizers with the overlapped exchange (several buckets, the communication thread and its
    stream) keep both ranks' parameters identical, equal bit for bit to the same buckets started
    in step(); and they are as far from the CPU run as rounding can take a 1-bit run.

    That distance is measured, not assumed: 1-bit training amplifies rounding (a sign flips
    where a compressed value is near 0; at W = 2 the server's re-compression flips more), so the
    bound is the distance between two CPU runs whose initial parameters differ by one float32
    ulp: the GPU's L2 distance to the CPU run is at most 4 times the nudged run's (headroom; the
    runs the bound comes from: benchmarks/results/gpu-test-bounds-2026-11-26.md)."""
    from tests.helpers.dist import run_distributed

    ranks = run_distributed(_two_ranks_on_one_gpu, 2, start_method="spawn")
    if "skip" in ranks[0]:
        pytest.skip(ranks[0]["skip"])
    for r in ranks:
        assert all(r["exchange_equal"]), r["exchange_equal"]
    for algo in CLASSES:
        r0, r1 = ranks[0][algo], ranks[1][algo]
        assert torch.equal(r0["gpu"], r1["gpu"]), f"{algo}: ranks differ on the GPU"
        assert torch.equal(r0["cpu"], r1["cpu"]), f"{algo}: ranks differ on the CPU"
        assert torch.equal(r0["gpu"], r0["gpu_in_step"]), f"{algo}: the overlap changed the result"
        rounding = (r0["cpu_nudged"] - r0["cpu"]).norm()
        gpu = (r0["gpu"] - r0["cpu"]).norm()
        assert gpu <= 4 * rounding + 1e-6, f"{algo}: |gpu - cpu| {gpu:.3g}, rounding {rounding:.3g}"


def _lm_step(model: torch.nn.Module, opt: Any, x: torch.Tensor) -> Any:
    """A training step of ``_model()`` on the token batch ``x`` (next-token loss)."""

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(
            model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()
        ).backward()
        opt.step()

    return step


def _host_syncs(step: Any, steps: int = 3) -> Counter:
    """Run ``steps`` steps under ``set_sync_debug_mode("warn")``; count each host
    synchronisation by the innermost lightning_onebit function on its stack (from any thread:
    the overlap's communication thread too)."""
    sites: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchronizing CUDA operation" not in str(message):
            return
        ours = [f for f in traceback.extract_stack() if "lightning_onebit" in f.filename]
        sites[ours[-1].name if ours else f"{filename}:{lineno}"] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sites


#: what OneBitStrategy builds from a torch Adam (bias correction, floor, preconditioned exchange,
#: rescale_variance), all-reduced every 2 steps here so that the runs below include some
STRATEGY = {"bias_correction": True, "variance_floor": 0.01, "preconditioned_exchange": True}
#: every kind of step early: the switch after step 4 (0/1 Adam: 6, with variance steps 1, 2, 4
#: and 1-bit gradient steps between, then sync and local steps: 7, 8 sync, 9 local, 10 sync, ...)
SCHEDULE = {
    "onebit_adam": {"freeze_step": 4},
    "onebit_lamb": {"freeze_step": 4},
    "zero_one_adam": {
        "var_freeze_step": 6,
        "var_update_scaler": 1,
        "local_step_scaler": 2,
        "local_step_clipper": 4,
    },
}


def _optimizer(algo: str, model: torch.nn.Module, options: str) -> Any:
    kw = dict(SCHEDULE[algo])
    if options == "strategy":
        kw.update(STRATEGY)
        if algo != "onebit_lamb":
            kw["rescale_variance"] = True
    opt = CLASSES[algo](model.parameters(), lr=1e-3, **kw)
    opt.rescale_interval = 2
    return opt


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("options", ["defaults", "strategy"])
@pytest.mark.parametrize("algo", list(CLASSES))
def test_no_host_synchronisation_in_a_step(algo: str, options: str, overlap: bool) -> None:
    """Every step after the first (which builds the flat buffers and the exchange) but the one
    that switches the phase (it reads the step's verdict on the host, once per run): warmup /
    variance steps, 1-bit steps, 0/1 Adam's sync and local steps, with and without the overlap,
    DeepSpeed's options and the strategy's (rescale_variance's all-reduces included): no host
    synchronisation, from either thread; then 4 more steps under
    ``torch.cuda.set_sync_debug_mode("error")``."""
    model = _model().cuda()
    opt = _optimizer(algo, model, options)
    if overlap:
        opt.overlap_with_backward(0.01)  # several buckets
    x = torch.randint(0, 64, (8, 9), device="cuda")
    step = _lm_step(model, opt, x)
    assert _host_syncs(lambda: torch.ones(1, device="cuda").item(), steps=1)  # (it sees them)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # young variance
        step()
        switched = 0
        for i in range(2, 17):
            phase = opt.phase
            sites = _host_syncs(step, steps=1)
            if opt.phase != phase:
                switched += 1
                continue
            assert not sites, (i, dict(sites))
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(4):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert switched == 1 and opt.skipped_steps == 0
    if options == "strategy" and algo != "onebit_lamb":
        assert opt.rescale.updates >= 3  # the rescale's all-reduces ran in there
    if algo == "zero_one_adam":
        assert opt.local_step_interval == 4  # (local steps ran)
    if overlap:
        opt.overlap_with_backward(None)


#: batches with a NaN loss: 1-bit Adam / LAMB a warmup step (2) and a compressed one (8);
#: 0/1 Adam (SCHEDULE) a variance step (2), a 1-bit gradient step (3), the switch step (6),
#: a sync step (7) and a local step (9) (steps; a dropped batch is no step)
NAN_BATCHES = {
    "onebit_adam": [1, 8],
    "onebit_lamb": [1, 8],
    "zero_one_adam": [1, 3, 7, 9, 12],
}


def _nan_run(algo: str, overlap: bool, how: str) -> tuple[torch.Tensor, Any, bool]:
    """16 batches with NAN_BATCHES' losses NaN; ``how``: ``"device"`` (the verdicts on the
    device), ``"host"`` (read on the host) or ``"skip"`` (those batches never happen). Returns
    the parameters, the optimizer and whether its exchange kept the verdicts on the device
    (read before the overlap is turned off, which releases the exchange)."""
    model = _model().cuda()
    opt = _optimizer(algo, model, "strategy")
    if how == "host":
        opt.DEVICE_VERDICT = False
    if overlap:
        opt.overlap_with_backward(0.01)
    data = torch.randint(0, 64, (16, 8, 9), generator=torch.Generator().manual_seed(3)).cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in range(16):
            if how == "skip" and t in NAN_BATCHES[algo]:
                continue
            x = data[t]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(
                model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()
            )
            if t in NAN_BATCHES[algo]:
                loss = loss * float("nan")
            loss.backward()
            opt.step()
    on_device = opt.flat.exchange.device_verdict
    if overlap:
        opt.overlap_with_backward(None)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), opt, on_device


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("algo", list(CLASSES))
def test_a_nan_is_dropped_on_the_device(algo: str, overlap: bool) -> None:
    """NaN losses in every kind of step, verdicts on the device: the same parameters and
    optimizer state, bit for bit, as the host's verdict gives (1-bit Adam: as the run without
    those batches, its host path updating through other ops); the host counts the skipped
    steps once it learns the verdicts (the next step, or the checkpoint)."""
    bad, opt, on_device = _nan_run(algo, overlap, "device")
    ref, ref_opt, _ = _nan_run(algo, overlap, "skip" if algo == "onebit_adam" else "host")
    assert on_device and torch.isfinite(bad).all()
    assert torch.equal(bad, ref), float((bad - ref).abs().max())
    state, ref_state = opt.state_dict(), ref_opt.state_dict()
    n = len(NAN_BATCHES[algo])  # (W = 1: 0/1 Adam's local skip is this rank's, counted too)
    assert opt.skipped_steps == n
    assert ref_opt.skipped_steps == (0 if algo == "onebit_adam" else n)
    assert state["onebit"]["step_count"] == ref_state["onebit"]["step_count"]
    for k in opt.flat.states:
        assert torch.equal(opt.flat.states[k], ref_opt.flat.states[k]), k


def _fit(tmp: Path, algo: str, precision: str, devices: int, max_steps: int, **fit_kw: Any):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_onebit import OneBitStrategy
    from tests.scripts.multinode_fit import Attention

    start = "spawn" if devices > 1 else "popen"  # (this process may have initialised CUDA)
    trainer = L.Trainer(
        strategy=OneBitStrategy(algorithm=algo, freeze_step=4, start_method=start),
        accelerator="gpu",
        devices=devices,
        precision=precision,
        max_steps=max_steps,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=tmp, every_n_train_steps=8, save_top_k=-1)],
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp,
    )
    model = Attention()
    # 8 batches per rank and epoch: the checkpoint at step 8 ends an epoch (mid-epoch, Lightning
    # cannot resume a plain DataLoader exactly)
    data = torch.randint(0, 32, (128 * devices, 9), generator=torch.Generator().manual_seed(0))
    trainer.fit(model, DataLoader(TensorDataset(data), batch_size=16), **fit_kw)
    return trainer, model


#: torch >= 2.10's warning when DDP was built on another stream than the one training runs on
#: (issued once per process: the streams DDP is built on are checked directly as well)
_STREAM_MISMATCH = "AccumulateGrad node's stream does not match"


@pytest.fixture
def ddp_streams(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The current CUDA stream at each ``DistributedDataParallel(...)`` construction."""
    from torch.nn.parallel import DistributedDataParallel

    seen: list[Any] = []
    init = DistributedDataParallel.__init__

    def recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
        seen.append(torch.cuda.current_stream())
        init(self, *args, **kwargs)

    monkeypatch.setattr(DistributedDataParallel, "__init__", recording_init)
    return seen


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("algo", list(CLASSES))
def test_trainer_on_one_gpu(
    algo: str, precision: str, tmp_path: Path, ddp_streams: list[Any]
) -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer, model = _fit(tmp_path, algo, precision, 1, 12)
    # DDP built on the stream training runs on (hook._build_ddp), not on a side stream
    assert ddp_streams == [torch.cuda.current_stream()]
    assert not [w for w in seen if _STREAM_MISMATCH in str(w.message)]
    opt = trainer.strategy.onebit_optimizer
    assert str(opt.phase) != "warmup"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert abs(model.last_loss - math.log(32)) < 0.5  # random tokens: ln(32), not diverged


def test_fabric_on_one_gpu_builds_ddp_on_the_training_stream(ddp_streams: list[Any]) -> None:
    import lightning as L

    from lightning_onebit import OneBitFabricStrategy

    fabric = L.Fabric(
        accelerator="gpu",
        devices=1,
        strategy=OneBitFabricStrategy(algorithm="onebit_adam", freeze_step=2),
    )
    fabric.launch()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    model, opt = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    x = torch.randn(64, 16, device=fabric.device)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(6):  # warmup and compressed steps
            fabric.backward(model(x).square().mean())
            opt.step()
            opt.zero_grad()
    assert str(opt.phase) == "compression"
    assert ddp_streams == [torch.cuda.current_stream()]
    assert not [w for w in seen if _STREAM_MISMATCH in str(w.message)]


@pytest.mark.parametrize("algo", list(CLASSES))
def test_resume_on_gpu_equals_uninterrupted(algo: str, tmp_path: Path) -> None:
    """Checkpointed at step 8 (4 compressed steps), resumed to 16: the same parameters."""
    _, full = _fit(tmp_path / "full", algo, "32-true", 1, 16)
    ckpt = tmp_path / "full" / "epoch=0-step=8.ckpt"
    assert ckpt.exists() and Path(f"{ckpt}.onebit-rank0-of-1").exists()
    _, resumed = _fit(tmp_path / "resumed", algo, "32-true", 1, 16, ckpt_path=str(ckpt))
    for p, q in zip(full.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
@pytest.mark.parametrize("algo", list(CLASSES))
def test_trainer_on_two_gpus(algo: str, tmp_path: Path) -> None:
    """Ranks on cuda:0 and cuda:1 (where a missing device guard launches on the wrong GPU);
    spawn-started (this process has initialised CUDA, so fork cannot be used)."""
    from tests.scripts.multinode_fit import Attention

    trainer, model = _fit(tmp_path, algo, "32-true", 2, 12)
    assert trainer.world_size == 2
    before = torch.cat([p.detach().reshape(-1) for p in Attention().parameters()])
    after = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    assert torch.isfinite(after).all() and not torch.equal(before, after)
