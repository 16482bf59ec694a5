"""The integer codec (``kernels.quantized``): the compiled kernels against their torch twins bit for
bit, and both against the arithmetic they stand for, in float64, on fresh random inputs; error
feedback over several calls; non-finite input; bad arguments."""

from __future__ import annotations

import pytest
import torch

from lightning_onebit import kernels as Q
from lightning_onebit.kernels import native

needs_cpp = pytest.mark.skipif(not native.HAS_CPP, reason="needs the compiled kernels")
CODECS = [(4, 256), (8, 256), (4, 2), (8, 64)]


def _rows(w: int, m: int, bits: int, block: int, pad: int = 0) -> torch.Tensor:
    return torch.zeros(w, Q.row_bytes(m, bits, block) + pad, dtype=torch.uint8)


def _inputs(gen: torch.Generator, n: int) -> torch.Tensor:
    # values of very different sizes in one buffer, as gradients have, some exactly 0
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 3)
    x[torch.rand(n, generator=gen) < 0.05] = 0.0
    return x


@needs_cpp
@pytest.mark.parametrize(("bits", "block"), CODECS)
@pytest.mark.parametrize("w", [1, 3])
def test_compiled_kernels_are_their_torch_twins(bits: int, block: int, w: int) -> None:
    gen = torch.Generator().manual_seed(bits * 1000 + block + w)
    m = block * 7
    n = w * m
    x, e = _inputs(gen, n - 5), torch.randn(n, generator=gen) * 0.01
    for error in (e, None):
        got, want = _rows(w, m, bits, block, pad=8), _rows(w, m, bits, block, pad=8)
        e1 = None if error is None else torch.empty(n)
        e2 = None if error is None else torch.empty(n)
        Q.quantize(x, error, got, bits=bits, block=block, error_out=e1, n=n)
        Q.reference_quantize(x, error, want, bits=bits, block=block, error_out=e2, n=n)
        assert torch.equal(got, want)
        if error is not None:
            assert torch.equal(e1, e2)
        # the server side, from these rows (one rank's view of every sender's chunk j)
        recv = got[:, : Q.row_bytes(m, bits, block)].clone()
        es = torch.randn(m, generator=gen) * 0.01
        out1, out2 = (
            torch.zeros(Q.row_bytes(m, bits, block), dtype=torch.uint8),
            torch.zeros(Q.row_bytes(m, bits, block), dtype=torch.uint8),
        )
        s1, s2 = es.clone(), es.clone()
        Q.quantized_reduce(recv, s1, out1, m=m, bits=bits, block=block)
        Q.reference_quantized_reduce(recv, s2, out2, m=m, bits=bits, block=block)
        assert torch.equal(out1, out2) and torch.equal(s1, s2)
        d1, d2 = torch.empty(n - 3), torch.empty(n - 3)
        Q.dequantize(got, d1, m=m, bits=bits, block=block)
        Q.reference_dequantize(got, d2, m=m, bits=bits, block=block)
        assert torch.equal(d1, d2)


@pytest.mark.parametrize(("bits", "block"), CODECS)
def test_quantize_is_the_codec_it_documents(bits: int, block: int) -> None:
    """In float64: every code an integer in [-Q, Q], the block's largest value coded as +-Q, each
    value within half a step of its code, the scale max|y| / Q, and decoded + error = y."""
    gen = torch.Generator().manual_seed(7 * bits + block)
    w, m = 2, block * 9
    n = w * m
    x, e = _inputs(gen, n), torch.randn(n, generator=gen) * 0.1
    rows, e_new = _rows(w, m, bits, block), torch.empty(n)
    Q.quantize(x, e, rows, bits=bits, block=block, error_out=e_new)
    dec = torch.empty(n)
    Q.dequantize(rows, dec, m=m, bits=bits, block=block)
    y = (x + e).double()  # x + e is one float32 addition: exact in float64
    qmax = 7 if bits == 4 else 127
    yb = y.view(-1, block)
    s = yb.abs().amax(1) / qmax
    got_s = torch.cat([rows[j, : 4 * (m // block)].view(torch.float32) for j in range(w)]).double()
    torch.testing.assert_close(got_s, s, rtol=2**-23, atol=0)
    nb = m // block
    codes = torch.cat([rows[j, 4 * nb : 4 * nb + m * bits // 8] for j in range(w)])
    if bits == 8:
        q = codes.view(torch.int8).double()
    else:  # value 2k in the low nibble of byte k
        q = torch.stack([(codes & 15).double() - 8, (codes >> 4).double() - 8], 1)
    q = q.reshape(-1, block)
    assert q.abs().max() <= qmax
    assert torch.equal(dec.view(-1, block), (got_s[:, None].float() * q.float()))
    top = yb.abs().argmax(1)
    assert torch.equal(
        q.gather(1, top[:, None]).abs().squeeze(1)[s > 0], torch.full_like(s[s > 0], qmax)
    )
    ratio = torch.where(got_s[:, None] > 0, yb / got_s[:, None].clamp_min(1e-300), 0.0)
    assert ((ratio - q).abs() <= 0.5 + 1e-5).all()
    assert ((yb - dec.double().view(-1, block)).abs() <= got_s[:, None] * (0.5 + 1e-6)).all()
    # the error is what decoding loses, to float32 rounding of y
    ulp = torch.finfo(torch.float32).eps * y.abs().clamp_min(1e-30)
    assert ((dec.double() + e_new.double() - y).abs() <= ulp).all()


@pytest.mark.parametrize(("bits", "block"), [(4, 256), (8, 256)])
def test_error_feedback_keeps_the_sum_of_what_was_sent(bits: int, block: int) -> None:
    """Over T calls the decoded values plus the last error add up to the inputs (float64):
    nothing rounding took is lost, which is what error feedback is for."""
    gen = torch.Generator().manual_seed(bits)
    w, m = 2, block * 4
    n = w * m
    e, rows, dec = torch.zeros(n), _rows(w, m, bits, block), torch.empty(n)
    sent, decoded = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for _ in range(20):
        x = _inputs(gen, n)
        Q.quantize(x, e, rows, bits=bits, block=block)
        Q.dequantize(rows, dec, m=m, bits=bits, block=block)
        sent += x.double()
        decoded += dec.double()
    scale = sent.abs().max()
    torch.testing.assert_close(decoded + e.double(), sent, rtol=0, atol=1e-5 * float(scale))


def test_the_server_side_averages_its_rows_and_keeps_its_error() -> None:
    """quantized_reduce: decoded output + its new error = mean of the decoded rows + the old
    error (float64, to float32 rounding); write_error=False writes the same row and no error."""
    gen = torch.Generator().manual_seed(11)
    bits, block, w, m = 4, 256, 4, 256 * 5
    rows = _rows(w, m, bits, block)
    Q.quantize(_inputs(gen, w * m), None, rows, bits=bits, block=block, n=w * m)
    dec_rows = torch.empty(w * m)
    Q.dequantize(rows, dec_rows, m=m, bits=bits, block=block)
    e0 = torch.randn(m, generator=gen) * 0.01
    e, out = e0.clone(), torch.zeros(Q.row_bytes(m, bits, block), dtype=torch.uint8)
    Q.quantized_reduce(rows, e, out, m=m, bits=bits, block=block)
    dec = torch.empty(m)
    Q.dequantize(out[None], dec, m=m, bits=bits, block=block)
    c = dec_rows.double().view(w, m).mean(0) + e0.double()
    torch.testing.assert_close(
        dec.double() + e.double(), c, rtol=0, atol=1e-6 * float(c.abs().max())
    )
    kept, again = e0.clone(), torch.zeros_like(out)
    Q.quantized_reduce(rows, kept, again, m=m, bits=bits, block=block, write_error=False)
    assert torch.equal(kept, e0) and torch.equal(again, out)


def test_a_non_finite_value_makes_its_blocks_scale_non_finite() -> None:
    bits, block, w, m = 4, 256, 2, 512
    for bad in (float("nan"), float("inf")):
        x = torch.randn(w * m)
        x[300] = bad  # block 1 of row 0
        for fn in (Q.quantize, Q.reference_quantize):
            rows = _rows(w, m, bits, block)
            fn(x, None, rows, bits=bits, block=block, n=w * m)
            scales = torch.stack([rows[j, :8].view(torch.float32) for j in range(w)])
            assert (
                not torch.isfinite(scales[0, 1])
                and torch.isfinite(scales.view(-1)[[0, 2, 3]]).all()
            )


def test_bad_arguments_say_what_to_pass() -> None:
    x, rows = torch.zeros(512), torch.zeros(2, 512, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        Q.quantize(x, None, rows, bits=3, block=256, n=512)
    with pytest.raises(ValueError, match="block must be an even int"):
        Q.quantize(x, None, rows, bits=4, block=255, n=512)
    with pytest.raises(ValueError, match="rows must be a"):
        Q.quantize(x, None, torch.zeros(2, 16, dtype=torch.uint8), bits=4, block=256, n=512)
    with pytest.raises(ValueError, match="multiple of W \\* block"):
        Q.quantize(x[:500], torch.zeros(500), rows, bits=4, block=256)
    with pytest.raises(ValueError, match="pass n"):
        Q.quantize(x, None, rows, bits=4, block=256)
    with pytest.raises(TypeError):
        Q.quantize(x.double(), None, rows, bits=4, block=256, n=512)
