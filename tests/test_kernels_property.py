"""Property-based tests of the kernels' Python face: random sizes, dtypes, strides and devices
give either a clear TypeError/ValueError or the reference result, never a crash."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_onebit import kernels as K

pytestmark = pytest.mark.skipif(not K.HAS_CPP, reason="C++ extension not built")

DTYPES = [torch.float32, torch.float64, torch.float16, torch.uint8, torch.int32]
CLEAR = (TypeError, ValueError, RuntimeError)


def _tensor(draw, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``numel`` values, sometimes non-contiguous, sometimes on the meta device."""
    layout = draw(st.sampled_from(["contiguous", "strided", "meta", "2d"]))
    base = torch.arange(max(numel, 1) * 2, dtype=torch.float64).sin().mul(3).to(dtype)
    if layout == "strided":
        return base[: 2 * numel : 2]
    if layout == "meta":
        return base[:numel].to("meta")
    if layout == "2d" and numel % 2 == 0 and numel > 0:
        return base[:numel].view(2, -1)
    return base[:numel].clone()


@st.composite
def worker_args(draw):
    w = draw(st.integers(1, 5))
    rows = draw(st.integers(0, 40))
    n = draw(st.sampled_from([8 * w * rows, 8 * w * rows + draw(st.integers(1, 9))]))
    nx = draw(st.integers(0, n + 3))
    x = _tensor(draw, nx, draw(st.sampled_from(DTYPES)))
    e = _tensor(draw, n, draw(st.sampled_from(DTYPES)))
    brow = draw(st.sampled_from([rows, rows + 1, max(rows - 1, 0)]))
    pad = draw(st.integers(0, 3))
    bits = torch.zeros(w, brow + pad, dtype=draw(st.sampled_from([torch.uint8, torch.int8])))[
        :, :brow
    ]
    if draw(st.booleans()):
        bits = bits.t() if bits.dim() == 2 and draw(st.booleans()) else bits
    scale = torch.zeros(
        draw(st.sampled_from([1, 1, 2])),
        dtype=draw(st.sampled_from([torch.float32, torch.float64])),
    )
    return x, e, bits, scale


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worker_args())
def test_worker_compress_never_crashes(args) -> None:
    x, e, bits, scale = args
    ref_args = [t.clone() if t.device.type != "meta" else t for t in args]
    try:
        K.worker_compress(x, e, bits, scale)
    except CLEAR:
        return
    # accepted: must equal the reference on copies of the same inputs
    xr, er, br, sr = ref_args
    K.reference_worker_compress(xr, er, br, sr)
    assert torch.equal(bits, br)
    torch.testing.assert_close(e, er, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(scale, sr, rtol=1e-6, atol=0)


@st.composite
def decode_args(draw):
    w = draw(st.integers(1, 5))
    rows = draw(st.integers(0, 30))
    pad = draw(st.integers(0, 5))
    bits = torch.randint(0, 256, (w, rows + pad), dtype=torch.uint8)[:, :rows]
    if draw(st.booleans()):
        bits = bits.contiguous().view(-1) if draw(st.booleans()) else bits.to(torch.int16)
    ns = draw(st.sampled_from([w, w, w + 1, max(w - 1, 0)]))
    scales = _tensor(draw, ns, draw(st.sampled_from([torch.float32, torch.float32, torch.float64])))
    nout = draw(st.integers(0, 8 * w * rows + 9))
    out = _tensor(draw, nout, draw(st.sampled_from([torch.float32, torch.float32, torch.float16])))
    return bits, scales, out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(decode_args())
def test_decompress_never_crashes(args) -> None:
    bits, scales, out = args
    try:
        K.decompress(bits, scales, out)
    except CLEAR:
        return
    ref = out.clone()
    K.reference_decompress(bits, scales, ref)
    assert torch.equal(out, ref)


@st.composite
def server_args(draw):
    w = draw(st.integers(1, 5))
    rows = draw(st.integers(0, 30))
    m = 8 * rows + draw(st.sampled_from([0, 0, 3]))
    bits = torch.randint(0, 256, (w, rows + 2), dtype=torch.uint8)[:, draw(st.integers(0, 2)) :][
        :, :rows
    ]
    scales = _tensor(
        draw,
        draw(st.sampled_from([w, w + 1])),
        draw(st.sampled_from([torch.float32, torch.float64])),
    )
    e = _tensor(draw, m, draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16])))
    ob = torch.zeros(draw(st.sampled_from([rows, rows + 1])), dtype=torch.uint8)
    os_ = torch.zeros(1)
    return bits, scales, e, ob, os_, draw(st.booleans())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(server_args())
def test_server_reduce_never_crashes(args) -> None:
    bits, scales, e, ob, os_, pending = args
    ref = [t.clone() if t.device.type != "meta" else t for t in (e, ob, os_)]
    try:
        K.server_reduce(bits, scales, e, ob, os_, pending=pending)
    except CLEAR:
        return
    K.reference_server_reduce(bits, scales, *ref, pending=pending)
    assert torch.equal(ob, ref[1])
    torch.testing.assert_close(e, ref[0], rtol=1e-6, atol=1e-6)
