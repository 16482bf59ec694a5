"""Level-0 tests: every fused kernel against the pure-torch reference, and argument checks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from lightning_onebit import kernels as K
from lightning_onebit.kernels import native

pytestmark = pytest.mark.skipif(not K.HAS_CPP, reason="C++ extension not built")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and K.HAS_CUDA else [])
# Awkward sizes (values per rank buffer after padding to 8 * W) and world sizes.
SIZES = [8, 16, 56, 1024, 1032, 10**6 + 8]
WORLDS = [1, 2, 3, 4, 8]


def _rand(n: int, gen: torch.Generator, device: str, zeros: bool = True) -> torch.Tensor:
    x = torch.randn(n, generator=gen)
    if zeros and n >= 8:  # exact +0.0 and -0.0 must both encode +1
        idx = torch.randperm(n, generator=gen)[: max(2, n // 10)]
        x[idx[: len(idx) // 2]] = 0.0
        x[idx[len(idx) // 2 :]] = -0.0
    return x.to(device)


def _padded(n: int, w: int) -> int:
    return -(-n // (8 * w)) * 8 * w


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1023, 10**6 + 3])
@pytest.mark.parametrize("w", WORLDS)
def test_worker_compress_matches_reference(n: int, w: int, device: str) -> None:
    gen = torch.Generator().manual_seed(n * 31 + w)
    n_pad = _padded(n, w)
    x = _rand(n, gen, device)
    e0 = _rand(n_pad, gen, device) * 0.3
    rows = n_pad // (8 * w)
    # bits written into strided rows, as the exchange does (records with a 4-byte header)
    rec = torch.zeros(w, rows + 7, dtype=torch.uint8, device=device)
    bits, bits_ref = rec[:, 4 : 4 + rows], torch.zeros(w, rows, dtype=torch.uint8, device=device)
    e, e_ref = e0.clone(), e0.clone()
    s, s_ref = torch.zeros(1, device=device), torch.zeros(1, device=device)
    K.worker_compress(x, e, bits, s)
    K.reference_worker_compress(x, e_ref, bits_ref, s_ref)
    assert torch.equal(bits, bits_ref)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(e, e_ref, rtol=1e-6, atol=1e-6 * float(s_ref))
    # the header and trailing bytes of the records were not touched
    assert rec[:, :4].eq(0).all() and rec[:, 4 + rows :].eq(0).all()
    # x was not modified and sign(0) = +1 for both zeros
    y = x.cpu().double()
    y = torch.cat([y, torch.zeros(n_pad - n, dtype=torch.float64)]) + e0.cpu().double()
    expect = np.packbits((y >= 0).numpy(), bitorder="little")
    assert np.array_equal(bits.cpu().reshape(-1).numpy(), expect)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [5, 1023, 10**6 + 3])
def test_deferred_error_update_matches_the_eager_one(n: int, device: str) -> None:
    """update_error=False leaves the error untouched; worker_update_error then gives bitwise
    what the one-call form gives (the exchange relies on this to skip non-finite steps)."""
    gen = torch.Generator().manual_seed(n)
    w, n_pad = 4, _padded(n, 4)
    x, e0 = _rand(n, gen, device), _rand(n_pad, gen, device) * 0.3
    bits, bits_eager = (
        torch.zeros(w, n_pad // (8 * w), dtype=torch.uint8, device=device) for _ in "ab"
    )
    e, e_eager = e0.clone(), e0.clone()
    s, s_eager = torch.zeros(1, device=device), torch.zeros(1, device=device)
    K.worker_compress(x, e, bits, s, update_error=False)
    assert torch.equal(e, e0)
    K.worker_compress(x, e_eager, bits_eager, s_eager)
    assert torch.equal(bits, bits_eager) and torch.equal(s, s_eager)
    e_next = torch.full_like(e, float("nan"))
    K.worker_update_error(x, e, s, out=e_next)  # double buffering: e stays as it was
    assert torch.equal(e, e0) and torch.equal(e_next, e_eager)
    K.worker_update_error(x, e, s)
    assert torch.equal(e, e_eager)
    e_ref = e0.clone()
    K.reference_worker_update_error(x, e_ref, s)
    torch.testing.assert_close(e, e_ref, rtol=1e-6, atol=1e-6 * float(s))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [5, 1023, 10**6 + 3])
@pytest.mark.parametrize("w", [1, 3])
@pytest.mark.parametrize("in_place", [False, True])
def test_the_one_sweep_worker_compression_is_the_two_call_form(
    n: int, w: int, in_place: bool, device: str
) -> None:
    """deferred=True over four calls (each applying the previous one's update as it reads,
    pending) sends the bits and scales of the two-call form bit for bit, and its buffer settles
    to that form's error bit for bit: in place, or double buffered (the inputs untouched)."""
    gen = torch.Generator().manual_seed(7 * n + w)
    n_pad = _padded(n, w)
    rows = n_pad // (8 * w)
    e_two = _rand(n_pad, gen, device) * 0.3
    # the deferred state: (error buffer, bits in strided records, scale), one set or two
    sets = [
        (e_two.clone(), torch.zeros(w, rows + 6, dtype=torch.uint8, device=device)[:, 4 : 4 + rows],
         torch.zeros(1, device=device))
        for _ in range(1 if in_place else 2)
    ]  # fmt: skip
    bits_two, s_two = (
        torch.zeros(w, rows, dtype=torch.uint8, device=device),
        torch.zeros(1, device=device),
    )
    for call in range(4):
        x = _rand(n, gen, device) * (1 + call)
        K.worker_compress(x, e_two, bits_two, s_two)
        cur, nxt = sets[call % len(sets)], sets[(call + 1) % len(sets)]
        before = [t.clone() for t in cur]
        K.worker_compress(x, cur[0], nxt[1], nxt[2], deferred=True, error_out=nxt[0],
                          pending=call > 0, prev_bits=cur[1], prev_scale=cur[2])  # fmt: skip
        assert torch.equal(nxt[1], bits_two) and torch.equal(nxt[2], s_two), call
        if not in_place:
            assert all(torch.equal(a, b) for a, b in zip(before, cur, strict=True)), call
        settled = nxt[0].clone()
        K.finish_pending(settled, nxt[1], nxt[2])
        assert torch.equal(settled, e_two), call
        ref = [torch.empty_like(t) for t in before]
        K.reference_worker_compress(x, before[0], ref[1], ref[2], deferred=True, error_out=ref[0],
                                    pending=call > 0, prev_bits=before[1], prev_scale=before[2])  # fmt: skip
        assert torch.equal(ref[1], bits_two)
        torch.testing.assert_close(ref[2], s_two, rtol=1e-6, atol=0)
        torch.testing.assert_close(ref[0], nxt[0], rtol=1e-6, atol=1e-6 * float(s_two))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"pending": True}, "deferred=True"),
        ({"error_out": torch.zeros(64)}, "deferred=True"),
        ({"deferred": True, "update_error": False}, "two-call form"),
        ({"deferred": True, "error_out": torch.zeros(72)}, "error_out must have"),
        ({"deferred": True, "pending": True, "prev_bits": torch.zeros(2, 4, dtype=torch.uint8)},
         "prev_bits must have the shape"),
    ],
)  # fmt: skip
def test_the_deferred_form_refuses_mixed_arguments(kwargs: dict, match: str) -> None:
    x, e, s = torch.zeros(64), torch.zeros(64), torch.zeros(1)
    with pytest.raises(ValueError, match=match):
        K.worker_compress(x, e, torch.zeros(1, 8, dtype=torch.uint8), s, **kwargs)


def _double_buffered(fn, bits, scales, cur, pending):
    """One server call (``fn``: the kernel or its reference) from state ``cur`` = (error, bits,
    scale) into fresh buffers; returns them."""
    out = tuple(torch.empty_like(t) for t in cur)
    fn(bits, scales, cur[0], out[1], out[2], pending=pending, error_out=out[0],
       prev_bits=cur[1], prev_scale=cur[2])  # fmt: skip
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("w", [1, 3, 4])
def test_server_reduce_double_buffered_matches_in_place(w: int, device: str) -> None:
    """Separate error_out / prev_bits / prev_scale give bitwise the in-place results and leave
    the previous state untouched (a dropped call changes nothing)."""
    gen = torch.Generator().manual_seed(w)
    m = 8 * 1001
    e = _rand(m, gen, device) * 0.1
    state = [
        (
            e.clone(),
            torch.zeros(m // 8, dtype=torch.uint8, device=device),
            torch.zeros(1, device=device),
        )
    ]
    e_ip, ob_ip, s_ip = (
        e.clone(),
        torch.zeros(m // 8, dtype=torch.uint8, device=device),
        torch.zeros(1, device=device),
    )
    for call in range(3):
        bits = torch.randint(0, 256, (w, m // 8), generator=gen, dtype=torch.uint8).to(device)
        scales = (torch.rand(w, generator=gen) + 0.1).to(device)
        K.server_reduce(bits, scales, e_ip, ob_ip, s_ip, pending=call > 0)
        cur = state[-1]
        kept = [t.clone() for t in cur]

        nxt, ref = (
            _double_buffered(fn, bits, scales, cur, call > 0)
            for fn in (K.server_reduce, K.reference_server_reduce)
        )
        assert all(torch.equal(a, b) for a, b in zip(cur, kept, strict=True))
        assert (
            torch.equal(nxt[0], e_ip) and torch.equal(nxt[1], ob_ip) and torch.equal(nxt[2], s_ip)
        )
        assert torch.equal(ref[1], nxt[1])
        torch.testing.assert_close(ref[0], nxt[0], rtol=1e-6, atol=1e-6 * float(nxt[2]))
        state.append(nxt)


@pytest.mark.parametrize("w", [1, 3, 4])
def test_server_reduce_without_its_error_writes_the_same_record_and_no_error(w: int) -> None:
    """write_error=False (a call whose error update waits for its commit) writes bitwise the
    record of the full call and leaves the accumulator as it was; the full call run afterwards on
    the same inputs gives the one-call result (compiled kernel and torch twin)."""
    gen = torch.Generator().manual_seed(40 + w)
    m = 8 * 1003
    for fn in (K.server_reduce, K.reference_server_reduce):
        e = torch.randn(m, generator=gen) * 0.1
        prev = torch.randint(0, 256, (m // 8,), generator=gen, dtype=torch.uint8)
        prev_s = torch.rand(1, generator=gen) + 0.1
        for pending in (False, True):
            bits = torch.randint(0, 256, (w, m // 8), generator=gen, dtype=torch.uint8)
            scales = torch.rand(w, generator=gen) + 0.1
            full = _double_buffered(fn, bits, scales, (e, prev, prev_s), pending)
            kept, rec, s = e.clone(), torch.empty(m // 8, dtype=torch.uint8), torch.empty(1)
            fn(bits, scales, kept, rec, s, pending=pending, prev_bits=prev, prev_scale=prev_s,
               write_error=False)  # fmt: skip
            assert torch.equal(kept, e) and torch.equal(rec, full[1]) and torch.equal(s, full[2])
            fn(bits, scales, kept, rec, s, pending=pending, prev_bits=prev, prev_scale=prev_s)
            assert torch.equal(kept, full[0])


def test_worker_compress_error_identity() -> None:
    """e_new = y - s*sign(y) exactly, s = ||y|| / sqrt(n), computed independently in float64."""
    gen = torch.Generator().manual_seed(0)
    x, e = torch.randn(4096, generator=gen), torch.randn(4096, generator=gen)
    y = (x + e).double()
    bits, s = torch.empty(2, 256, dtype=torch.uint8), torch.empty(1)
    K.worker_compress(x, e, bits, s)
    s64 = y.norm() / 4096**0.5
    assert abs(float(s) - float(s64)) <= 1e-7 * float(s64)
    torch.testing.assert_close(
        e.double(), y - float(s) * torch.where(y >= 0, 1.0, -1.0), rtol=0, atol=1e-6
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", SIZES)
@pytest.mark.parametrize("w", WORLDS)
def test_server_reduce_matches_reference(m: int, w: int, device: str) -> None:
    """Two calls in a row: the second applies the first one's deferred error update."""
    gen = torch.Generator().manual_seed(m * 7 + w)
    rows = m // 8
    e0 = _rand(m, gen, device) * 0.1
    e, e_ref = e0.clone(), e0.clone()
    ob, ob_ref = (torch.empty(rows, dtype=torch.uint8, device=device) for _ in range(2))
    s, s_ref = torch.empty(1, device=device), torch.empty(1, device=device)
    eager = e0.clone().cpu().double()  # the error as the algorithm defines it, in float64
    for call in range(2):
        rec = torch.randint(0, 256, (w, rows + 12), generator=gen, dtype=torch.uint8).to(device)
        bits = rec[:, 8 : 8 + rows]  # strided rows
        scales = (torch.rand(w, 3, generator=gen) + 0.1).to(device)[:, 1]  # strided scales
        K.server_reduce(bits, scales, e, ob, s, pending=call > 0)
        K.reference_server_reduce(bits, scales, e_ref, ob_ref, s_ref, pending=call > 0)
        assert torch.equal(ob, ob_ref)
        torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
        torch.testing.assert_close(e, e_ref, rtol=1e-6, atol=1e-6 * float(s_ref))
        # independent check: c = mean of decoded rows + error; new error = c - s * sign(c)
        signs = torch.from_numpy(
            np.unpackbits(bits.cpu().contiguous().numpy(), axis=1, bitorder="little")
        )
        c = ((signs.double() * 2 - 1) * (scales.cpu().double() / w)[:, None]).sum(0) + eager
        sign_c = torch.where(c >= 0, 1.0, -1.0).double()
        assert np.array_equal(ob.cpu().numpy(), np.packbits((c >= 0).numpy(), bitorder="little"))
        torch.testing.assert_close(float(s), float(c.norm() / m**0.5), rtol=1e-5, atol=0)
        eager = c - float(s) * sign_c
        true_err = e.clone()
        K.finish_pending(true_err, ob, s)
        torch.testing.assert_close(true_err.cpu().double(), eager, rtol=1e-5, atol=1e-5 * float(s))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", SIZES)
@pytest.mark.parametrize("w", WORLDS)
def test_decompress_matches_reference(m: int, w: int, device: str) -> None:
    gen = torch.Generator().manual_seed(m * 13 + w)
    rows = m // 8
    rec = torch.randint(0, 256, (w, rows + 4), generator=gen, dtype=torch.uint8).to(device)
    bits = rec[:, 4:]
    scales = torch.rand(w, generator=gen).to(device)
    for nout in sorted({w * m, max(1, w * m - 5), max(1, w * m - 8 * rows - 3)}):
        out = torch.full((nout,), 7.0, device=device)
        ref = torch.full((nout,), 7.0, device=device)
        K.decompress(bits, scales, out)
        K.reference_decompress(bits, scales, ref)
        assert torch.equal(out, ref)
    # spot-check the wire format against numpy's little-endian unpacking
    full = torch.empty(w * m, device=device)
    K.decompress(bits, scales, full)
    signs = (
        np.unpackbits(bits.cpu().contiguous().numpy(), axis=1, bitorder="little").astype(np.float32)
        * 2
        - 1
    )
    assert np.array_equal(full.cpu().numpy().reshape(w, m), signs * scales.cpu().numpy()[:, None])


def test_kernels_independent_of_thread_count() -> None:
    gen = torch.Generator().manual_seed(5)
    x, e0 = torch.randn(300_000, generator=gen), torch.randn(300_000, generator=gen)
    results = []
    old = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            e, bits, s = (
                e0.clone(),
                torch.empty(4, 300_000 // 32, dtype=torch.uint8),
                torch.empty(1),
            )
            K.worker_compress(x, e, bits, s)
            results.append((e, bits, s))
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1], strict=True))


# --------------------------------------------------------------------------- 1-bit LAMB update

LAMB_SIZES = [0, 5, 8, 1, 20_000, 77, 3, 70_000]  # empty, sub-vector, multi-block, threaded


def _lamb_case(seed: int, decay: bool, sizes: list[int] = LAMB_SIZES):
    gen = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    L = len(sizes)
    u01 = lambda: torch.rand(L, generator=gen).tolist()  # noqa: E731
    hp = {
        "scaling": [0.25 + 2 * a for a in u01()],
        "beta1": [0.8 + 0.15 * a for a in u01()],
        "beta2": [0.9 + 0.099 * a for a in u01()],
        "eps": [10 ** (-8 + 2 * a) for a in u01()],
        "weight_decay": [0.1 * a if decay and a > 0.3 else 0.0 for a in u01()],
    }
    bufs = {
        "exchanged": torch.randn(n, generator=gen),
        "exp_avg": torch.randn(n, generator=gen) * 0.5,
        "denom": K.Denominator(torch.rand(n, generator=gen) + 1e-3, hp["eps"]),
        "exp_avg_sq_fresh": torch.rand(n, generator=gen) * 0.1,
        "param": torch.randn(n, generator=gen) if decay else None,
        "update": torch.full((n,), float("nan")),  # written before read
    }
    return bufs, offsets, hp


def _lamb_d(bufs, offsets) -> torch.Tensor:
    """The d buffer of a LAMB case: ``sqrt(v) + eps`` layer by layer, with torch ops."""
    sizes = [b - a for a, b in itertools.pairwise(offsets)]
    den = bufs["denom"]
    return den.write(torch.zeros_like(den.exp_avg_sq), offsets[:-1], sizes)


def _lamb_run(fn, bufs, offsets, hp):
    b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in bufs.items()}
    stats = fn(*b.values(), offsets, **hp)
    return {**b, "denom": b["denom"].exp_avg_sq}, stats  # (tensors only: saved by torch.save)


def _assert_lamb_close(got, ref) -> None:
    (b1, s1), (b2, s2) = got, ref
    for k in ("exp_avg", "exp_avg_sq_fresh", "update"):
        torch.testing.assert_close(b1[k], b2[k], rtol=2e-6, atol=1e-7, msg=k)
    torch.testing.assert_close(s1, s2, rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("decay", [False, True])
def test_lamb_frozen_update_preconditioned_is_the_product_first_bitwise(
    decay: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``preconditioned=True``: the floats and statistics of ``exchanged.mul_(denom)`` then the
    call, bit for bit (1 and 2 threads), with ``exchanged`` left as it was on the CPU (the
    kernel multiplies as it reads); the pure-torch twin agrees with its own product-first
    call."""
    bufs, offsets, hp = _lamb_case(31 + decay, decay)
    scaled = {**bufs, "exchanged": bufs["exchanged"] * _lamb_d(bufs, offsets)}
    want_b, want_s = _lamb_run(K.lamb_frozen_update, scaled, offsets, hp)
    old = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            got_b, got_s = _lamb_run(
                K.lamb_frozen_update, bufs, offsets, {**hp, "preconditioned": True}
            )
            for k in ("exp_avg", "exp_avg_sq_fresh", "update"):
                assert _same_bits(got_b[k], want_b[k]), (nt, k)
            assert torch.equal(got_s, want_s), nt
            assert torch.equal(got_b["exchanged"], bufs["exchanged"]), nt
    finally:
        torch.set_num_threads(old)
    ref = _lamb_run(K.reference_lamb_frozen_update, scaled, offsets, hp)
    monkeypatch.setattr(K.native, "use_native", lambda: False)  # (the torch path)
    got = _lamb_run(K.lamb_frozen_update, bufs, offsets, {**hp, "preconditioned": True})
    for k in ("exp_avg", "exp_avg_sq_fresh", "update"):
        assert _same_bits(got[0][k], ref[0][k]), k
    assert torch.equal(got[1], ref[1])


@pytest.mark.parametrize("decay", [False, True])
def test_lamb_frozen_update_matches_reference(decay: bool) -> None:
    bufs, offsets, hp = _lamb_case(11 + decay, decay)
    got = _lamb_run(K.lamb_frozen_update, bufs, offsets, hp)
    ref = _lamb_run(K.reference_lamb_frozen_update, bufs, offsets, hp)
    _assert_lamb_close(got, ref)
    stats = got[1]
    assert stats.shape == (len(offsets) - 1, 3) and stats.dtype == torch.float64
    assert stats[0].tolist() == [1.0, 0.0, 0.0]  # the empty layer
    # the reference itself, against a float64 evaluation of the formulas
    x, m = (bufs[k].double() for k in ("exchanged", "exp_avg"))
    d = _lamb_d(bufs, offsets).double()
    vf = bufs["exp_avg_sq_fresh"].double()
    lo, hi = offsets[4], offsets[5]  # the multi-block layer
    c = {k: v[4] for k, v in hp.items()}
    m_new = x[lo:hi] / c["scaling"]
    g = (m_new - c["beta1"] * m[lo:hi]) / (1 - c["beta1"])
    vf_new = c["beta2"] * vf[lo:hi] + (1 - c["beta2"]) * g * g
    up = m_new / d[lo:hi]
    u = up + c["weight_decay"] * bufs["param"].double()[lo:hi] if decay else up
    torch.testing.assert_close(
        got[0]["exp_avg_sq_fresh"][lo:hi].double(), vf_new, rtol=1e-5, atol=0
    )
    torch.testing.assert_close(got[0]["update"][lo:hi].double(), u, rtol=1e-5, atol=1e-7)
    want = [(d[lo:hi] / (vf_new.sqrt() + c["eps"])).max(), up.square().sum(), u.square().sum()]
    torch.testing.assert_close(stats[4], torch.stack(want), rtol=1e-5, atol=0)


def _own_pieces(flat: torch.Tensor, offsets: list[int]) -> list[torch.Tensor]:
    """Each layer's values of ``flat`` (``offsets[k]:offsets[k + 1]``) in storage of its own,
    shaped 2-D where its size allows (the kernels read any shape)."""
    pieces = []
    for lo, hi in itertools.pairwise(offsets):
        t = flat[lo:hi].clone()
        pieces.append(t.view(2, -1) if (hi - lo) % 2 == 0 and hi > lo else t)
    return pieces


def _lamb_layers(bufs: dict, offsets: list[int], hp: dict):
    """``_lamb_case``'s inputs with the parameter as one tensor per layer."""
    return {**bufs, "param": _own_pieces(bufs["param"], offsets)}, offsets, hp


@pytest.mark.parametrize("precond", [False, True])
def test_lamb_frozen_update_per_layer_params_are_the_flat_form_bitwise(
    precond: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each layer's parameter in storage of its own (as the optimizer passes them: no copy into
    a flat buffer) gives the floats and statistics of the flat buffer holding the same values,
    bit for bit: the kernel on 1 and 2 threads, and the torch path; the parameters unchanged."""
    bufs, offsets, hp = _lamb_case(41 + precond, True)
    hp = {**hp, "preconditioned": precond}
    layers = _lamb_layers(bufs, offsets, hp)[0]
    kept = [p.clone() for p in layers["param"]]
    old = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            want_b, want_s = _lamb_run(K.lamb_frozen_update, bufs, offsets, hp)
            got_b, got_s = _lamb_run(K.lamb_frozen_update, layers, offsets, hp)
            for k in ("exp_avg", "exp_avg_sq_fresh", "update"):
                assert _same_bits(got_b[k], want_b[k]), (nt, k)
            assert torch.equal(got_s, want_s), nt
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(a, b) for a, b in zip(layers["param"], kept, strict=True))
    monkeypatch.setattr(K.native, "use_native", lambda: False)  # (the torch path)
    want_b, want_s = _lamb_run(K.lamb_frozen_update, bufs, offsets, hp)
    got_b, got_s = _lamb_run(K.lamb_frozen_update, layers, offsets, hp)
    for k in ("exp_avg", "exp_avg_sq_fresh", "update"):
        assert _same_bits(got_b[k], want_b[k]), k
    assert torch.equal(got_s, want_s)


#: what the scalar (non-AVX2) kernels compute, in a fresh process whose kernels take that path
#: (ONEBIT_NO_SIMD is read at import): Adam's update on case 9, 1-bit LAMB's on case 7
_PORTABLE = """
import sys, torch, tests.kernels.test_kernels as T
from lightning_onebit import kernels as K
assert not K.native.module.cpu_has_simd()
lamb = {d: T._lamb_run(K.lamb_frozen_update, *T._lamb_case(7, d)) for d in (False, True)}
lamb_layers = T._lamb_run(K.lamb_frozen_update, *T._lamb_layers(*T._lamb_case(7, True)))
source = {d: T.source_run(K.momentum_source, T._source_case(3), d) for d in (False, True)}
case, grads = T._segment_grads(T._source_case(5), 5)
source_seg = {d: T.source_run(K.momentum_source, (case[0], grads, *case[2:]), d) for d in (False, True)}
frozen = {pre: T.frozen_run(T._frozen_case(11, T.AWKWARD), None, pre) for pre in (False, True)}
local = {pre: T.local_runs(K.local_source, pre) for pre in (False, True)}
m, g, d, st, sz, b, a = T._tiled(T.SOURCE_TILINGS["awkward"], 3)
compress_source = T._compress_source(K.MomentumSource(m, g, T._fed(d, len(st)), m.clone(), st, sz, b, a), 3, True, 3)
(m, g, d), p, acc, st, sz, hp = T._local_tiled(T.SOURCE_TILINGS["awkward"], 3)
args = dict(exp_avg=m, grad=g, denom=T._fed(d, len(st)), acc=acc, starts=st, sizes=sz, **hp, preconditioned=True)
local_source = K.LocalSource(param=p, out=p.clone(), **args)
compress_local = T._compress_source(local_source, 3, True, 3)
pieces = [p[lo : lo + n].clone() for lo, n in zip(st, sz)]
local_pieces = K.LocalSource(param=pieces, out=p.clone(), **args)
compress_local_pieces = T._compress_source(local_pieces, 3, True, 3)
local_step = T.step_run(K.local_step, T._step_case(21))
sync = {pre: T.sync_runs(K.sync_update, pre) for pre in (False, True)}
sign_runs = T.sign_runs_pair()
m, g, d, st, sz, b, a = T._tiled(T.SOURCE_TILINGS["awkward"], 3)
two_call = T._two_call(K.MomentumSource(m, g, T._fed(d, len(st)), T._never_made, st, sz, b, a), 3, 3)
torch.save({"two_call": two_call, "adam": T._adam_run(K.adam_update, T._adam_case(9), True), "lamb": lamb,
            "lamb_layers": lamb_layers, "compress_local_pieces": compress_local_pieces,
            "source": source, "source_seg": source_seg, "frozen": frozen, "local": local,
            "sync": sync, "compress_source": compress_source, "compress_local": compress_local,
            "local_step": local_step, "sign_runs": sign_runs},
           sys.argv[1])
"""


@pytest.fixture(scope="module")
def portable(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The scalar kernels' results (``_PORTABLE``): one process serves the tests of that path."""
    import os
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("portable") / "portable.pt"
    env = {**os.environ, "ONEBIT_NO_SIMD": "1"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run(
        [sys.executable, "-c", _PORTABLE, str(out)],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(out, weights_only=True)


def test_lamb_frozen_update_portable_path_matches_reference(portable: dict) -> None:
    for decay in (False, True):
        ref = _lamb_run(K.reference_lamb_frozen_update, *_lamb_case(7, decay))
        _assert_lamb_close(portable["lamb"][decay], ref)
    (want_b, want_s), (got_b, got_s) = portable["lamb"][True], portable["lamb_layers"]
    for k in ("exp_avg", "exp_avg_sq_fresh", "update"):
        assert _same_bits(got_b[k], want_b[k]), k  # (per-layer parameters: the same floats)
    assert torch.equal(got_s, want_s)


def test_lamb_frozen_update_independent_of_thread_count() -> None:
    bufs, offsets, hp = _lamb_case(3, True, [200_000, 90_001])
    old = torch.get_num_threads()
    try:
        runs = []
        for nt in (1, 2):
            torch.set_num_threads(nt)
            runs.append(_lamb_run(K.lamb_frozen_update, bufs, offsets, hp))
    finally:
        torch.set_num_threads(old)
    (b1, s1), (b2, s2) = runs
    assert torch.equal(s1, s2)
    assert all(torch.equal(b1[k], b2[k]) for k in ("exp_avg", "exp_avg_sq_fresh", "update"))


# --------------------------------------------------------------------------- Adam update

ADAM_SIZES = [0, 5, 8, 1, 20_000, 77, 3, 70_000]


def _adam_case(seed: int, dtype: torch.dtype = torch.float32, sizes: list[int] = ADAM_SIZES):
    """Flat buffers with a 2-value gap before every parameter (must stay untouched)."""
    gen = torch.Generator().manual_seed(seed)
    starts, n = [], 0
    for s in sizes:
        starts.append(n + 2)
        n += s + 2
    u01 = lambda: torch.rand(len(sizes), generator=gen).tolist()  # noqa: E731
    hp = {
        "lr": [1e-3 * (0.5 + a) for a in u01()],
        "beta1": [0.8 + 0.15 * a for a in u01()],
        "beta2": [0.9 + 0.099 * a for a in u01()],
        "eps": [10 ** (-8 + 2 * a) for a in u01()],
        "weight_decay": [0.1 * a if a > 0.3 else 0.0 for a in u01()],
    }
    bufs = {
        "grad": torch.randn(n, generator=gen),
        "exp_avg": torch.randn(n, generator=gen) * 0.1,
        "exp_avg_sq": torch.rand(n, generator=gen) * 0.1,
    }
    params = [torch.randn(s, generator=gen).to(dtype) for s in sizes]
    return bufs, params, starts, hp


def _adam_run(fn, case, update_variance: bool):
    bufs, params, starts, hp = case
    b = {k: v.clone() for k, v in bufs.items()}
    ps = [p.clone() for p in params]
    fn(*b.values(), ps, starts, **hp, update_variance=update_variance)
    return b, ps


def _assert_adam_close(got, ref) -> None:
    """Values are O(1): a few float32 ulps of the operands (the kernel rounds differently)."""
    (b1, p1), (b2, p2) = got, ref
    for k in b1:
        torch.testing.assert_close(b1[k], b2[k], rtol=2e-6, atol=5e-7, msg=k)
    for a, b in zip(p1, p2, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=5e-7)


@pytest.mark.parametrize("update_variance", [False, True])
def test_adam_update_matches_reference_and_float64(update_variance: bool) -> None:
    case = _adam_case(5 + update_variance)
    b1, p1 = got = _adam_run(K.adam_update, case, update_variance)
    _assert_adam_close(got, _adam_run(K.reference_adam_update, case, update_variance))
    bufs, params, starts, hp = case
    gap = torch.ones(bufs["grad"].numel(), dtype=torch.bool)
    for j, (p, lo) in enumerate(zip(params, starts, strict=True)):
        gap[lo : lo + p.numel()] = False
        s = slice(lo, lo + p.numel())
        g, m, v = (bufs[k][s].double() for k in ("grad", "exp_avg", "exp_avg_sq"))
        m = hp["beta1"][j] * m + (1 - hp["beta1"][j]) * g
        if update_variance:
            v = hp["beta2"][j] * v + (1 - hp["beta2"][j]) * g * g
        u = m / (v.sqrt() + hp["eps"][j]) + hp["weight_decay"][j] * p.double()
        # rtol 1e-6: holds only because 1 - beta reaches the kernel rounded from double (from float32
        # beta it is 1.3e-5 off at beta2 = 0.999)
        torch.testing.assert_close(b1["exp_avg"][s].double(), m, rtol=1e-6, atol=3e-7)
        torch.testing.assert_close(b1["exp_avg_sq"][s].double(), v, rtol=1e-6, atol=0)
        torch.testing.assert_close(
            p1[j].double(), p.double() - hp["lr"][j] * u, rtol=1e-6, atol=1e-7
        )
    for k in b1:  # values outside every parameter's range are not touched
        assert torch.equal(b1[k][gap], bufs[k][gap]), k


def test_adam_update_portable_path_and_threads_and_dtypes(portable: dict) -> None:
    """The scalar kernel (ONEBIT_NO_SIMD=1, fresh process) and 1 vs 2 threads match the
    reference; a bf16 parameter (the pure-torch path) is updated like its fp32 twin."""
    _assert_adam_close(portable["adam"], _adam_run(K.reference_adam_update, _adam_case(9), True))

    case = _adam_case(4, sizes=[300_000, 90_001])
    old = torch.get_num_threads()
    try:
        runs = []
        for nt in (1, 2):
            torch.set_num_threads(nt)
            runs.append(_adam_run(K.adam_update, case, True))
    finally:
        torch.set_num_threads(old)
    (b1, p1), (b2, p2) = runs
    assert all(torch.equal(b1[k], b2[k]) for k in b1)
    assert all(torch.equal(a, b) for a, b in zip(p1, p2, strict=True))

    f32, bf16 = _adam_case(8, sizes=[1000, 24]), _adam_case(8, torch.bfloat16, sizes=[1000, 24])
    (_, p32), (_, p16) = _adam_run(K.adam_update, f32, True), _adam_run(K.adam_update, bf16, True)
    for a, b, b0 in zip(p32, p16, bf16[1], strict=True):
        assert b.dtype == torch.bfloat16 and not torch.equal(b, b0)  # updated
        torch.testing.assert_close(b.float(), a, rtol=2e-2, atol=2e-2)


def test_simd_and_portable_paths_agree_bitwise(portable: dict) -> None:
    """The AVX2 and the scalar kernels compute every element with the same float operations
    (built with -ffp-contract=off: no fused multiply-add the other path lacks), so Adam's and
    1-bit LAMB's updates agree bit for bit; only LAMB's per-layer double sums may differ in
    their last bits (summation order)."""
    if native.module is None or not native.module.cpu_has_simd():
        pytest.skip("needs the AVX2 path")
    (b1, p1), (b2, p2) = _adam_run(K.adam_update, _adam_case(9), True), portable["adam"]
    assert all(torch.equal(b1[k], b2[k]) for k in b1), "adam: a buffer differs"
    assert all(torch.equal(a, b) for a, b in zip(p1, p2, strict=True)), "adam: a parameter differs"
    (l1, s1), (l2, s2) = (
        _lamb_run(K.lamb_frozen_update, *_lamb_case(7, True)),
        portable["lamb"][True],
    )
    for k in ("exp_avg", "exp_avg_sq_fresh", "update"):
        assert torch.equal(l1[k], l2[k]), f"lamb: {k} differs"
    torch.testing.assert_close(s1, s2, rtol=1e-12, atol=0)


def _per_parameter_grads(case, missing: int = 3):
    """``case`` (an `_adam_case`) with its gradient as one tensor per parameter, each in its own
    storage and its parameter's shape, every ``missing``-th one ``None``, and the flat buffer
    that is the same call (zeros where a gradient is missing)."""
    bufs, params, starts, _ = case
    flat = bufs["grad"].clone()
    grads = []
    for j, (p, lo) in enumerate(zip(params, starts, strict=True)):
        piece = flat[lo : lo + p.numel()]
        if j % missing == missing - 1:
            piece.zero_()
            grads.append(None)
        else:
            grads.append(piece.clone().view(p.shape))
    return grads, {**bufs, "grad": flat}


@pytest.mark.parametrize("update_variance", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adam_update_per_parameter_gradients_equal_the_flat_buffer_bitwise(
    seed: int, update_variance: bool
) -> None:
    """The gradients read where each lies (one pointer per parameter; ``None``: zeros) give the
    flat buffer's call bit for bit: moments, parameters, the gaps between parameters untouched;
    with 1 and 2 threads."""
    gen = torch.Generator().manual_seed(100 + seed)
    sizes = [int(z) for z in torch.randint(0, 40_000, (7,), generator=gen)] + [1, 0, 8, 70_001]
    case = _adam_case(200 + seed, sizes=sizes)
    grads, flat_bufs = _per_parameter_grads(case)
    _, params, starts, hp = case
    old = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            ref_b, ref_p = _adam_run(
                K.adam_update, (flat_bufs, params, starts, hp), update_variance
            )
            m, v = flat_bufs["exp_avg"].clone(), flat_bufs["exp_avg_sq"].clone()
            ps = [p.clone() for p in params]
            K.adam_update(grads, m, v, ps, starts, **hp, update_variance=update_variance)
            assert torch.equal(m, ref_b["exp_avg"]) and torch.equal(v, ref_b["exp_avg_sq"])
            assert all(torch.equal(a, b) for a, b in zip(ps, ref_p, strict=True))
    finally:
        torch.set_num_threads(old)


def test_adam_update_per_parameter_gradients_on_the_torch_path() -> None:
    """A bf16 parameter sends the call down the pure-torch path: per-parameter gradients give
    the flat buffer's floats there too."""
    case = _adam_case(7, torch.bfloat16, sizes=[1000, 24, 5])
    grads, flat_bufs = _per_parameter_grads(case)
    _, params, starts, hp = case
    ref_b, ref_p = _adam_run(K.adam_update, (flat_bufs, params, starts, hp), True)
    m, v = flat_bufs["exp_avg"].clone(), flat_bufs["exp_avg_sq"].clone()
    ps = [p.clone() for p in params]
    K.adam_update(grads, m, v, ps, starts, **hp)
    assert torch.equal(m, ref_b["exp_avg"]) and torch.equal(v, ref_b["exp_avg_sq"])
    assert all(torch.equal(a, b) for a, b in zip(ps, ref_p, strict=True))


def test_adam_update_rejects_bad_per_parameter_gradients() -> None:
    bufs, params, starts, hp = _adam_case(2, sizes=[4, 4])
    m, v = bufs["exp_avg"], bufs["exp_avg_sq"]
    with pytest.raises(ValueError, match=r"one tensor \(or None\) per segment"):
        K.adam_update([torch.zeros(4)], m, v, params, starts, **hp)
    with pytest.raises(ValueError, match=r"grad\[1\] must have its segment's 4 values"):
        K.adam_update([None, torch.zeros(5)], m, v, params, starts, **hp)
    with pytest.raises(TypeError, match=r"grad\[0\] must have dtype torch\.float32"):
        K.adam_update([torch.zeros(4).double(), None], m, v, params, starts, **hp)


def test_adam_update_bumps_the_autograd_version() -> None:
    """Parameters written by the kernel count as modified in place: backward through a graph
    that saved one fails instead of silently using the updated values."""
    bufs, params, starts, hp = _adam_case(3, sizes=[64, 8])
    w = params[0].clone().requires_grad_()
    loss = (w * w).sum()  # saves w for backward
    with torch.no_grad():
        K.adam_update(*bufs.values(), [w, params[1]], starts, **hp)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def _frozen_case(seed: int, sizes: list[int] = ADAM_SIZES):
    """Inputs of frozen_adam_update from an Adam case: x, m, d = sqrt(v) + eps, params, starts,
    lr, weight decay (2-value gaps before every parameter, which must stay untouched)."""
    bufs, params, starts, hp = _adam_case(seed, sizes=sizes)
    d = bufs["exp_avg_sq"].sqrt() + 1e-3
    return (bufs["grad"], bufs["exp_avg"], d, params, starts, hp["lr"], hp["weight_decay"])


def frozen_run(case, ok: torch.Tensor, precond: bool):
    """frozen_adam_update on copies of ``case``: (m, params) after it."""
    x, m, d, params, starts, lr, wd = case
    m, ps = m.clone(), [p.clone() for p in params]
    K.frozen_adam_update(ok, x, m, _fed(d, len(ps)), ps, starts, lr, wd, precond)
    return m, ps


@pytest.mark.parametrize("precond", [False, True])
def test_frozen_adam_update_is_the_optimizers_torch_update(precond: bool) -> None:
    """A true verdict: m = x * d (or x) and each parameter's torch ops of the path without a
    verdict (_decoupled_update_: decay, then the step), bit for bit; a false one: nothing."""
    case = _frozen_case(7 + precond)
    x, m0, d, params, starts, lr, wd = case
    m, ps = frozen_run(case, torch.ones(1, dtype=torch.bool), precond)
    want_m = m0.clone()
    for p, lo in zip(params, starts, strict=True):
        s = slice(lo, lo + p.numel())
        want_m[s] = x[s] * d[s] if precond else x[s]
    assert torch.equal(m, want_m)  # (the gaps too: untouched)
    for j, (p, q, lo) in enumerate(zip(params, ps, starts, strict=True)):
        want, s = p.clone(), slice(lo, lo + p.numel())
        if wd[j] > 0:
            torch._foreach_add_([want], [want], alpha=-lr[j] * wd[j])
        if precond:
            torch._foreach_add_([want], [x[s]], alpha=-lr[j])
        else:
            torch._foreach_addcdiv_([want], [x[s]], [d[s]], value=-lr[j])
        assert torch.equal(q, want), j
        assert p.numel() == 0 or not torch.equal(q, p), j
    m, ps = frozen_run(case, torch.zeros(1, dtype=torch.bool), precond)
    assert torch.equal(m, m0)
    assert all(torch.equal(p, q) for p, q in zip(params, ps, strict=True))


#: parameter sizes around the kernels' 8-value vectors and their scalar tails
AWKWARD = [1, 7, 8, 9, 31, 33, 1_000_003]


def _source_case(seed: int, sizes: list[int] = AWKWARD):
    """Inputs of momentum_source: m, g, d and a poisoned out, with a 3-value gap before every
    segment (must stay untouched); starts, sizes, per-segment beta and alpha."""
    gen = torch.Generator().manual_seed(seed)
    starts, n = [], 0
    for size in sizes:
        starts.append(n + 3)
        n += size + 3
    m, g = torch.randn(n, generator=gen) * 0.1, torch.randn(n, generator=gen) * 1e-3
    d = torch.rand(n, generator=gen) * 0.1 + 1e-4
    beta = [0.8 + 0.19 * a for a in torch.rand(len(sizes), generator=gen).tolist()]
    alpha = [
        (1 - b) * (0.5 + a)
        for b, a in zip(beta, torch.rand(len(sizes), generator=gen).tolist(), strict=True)
    ]
    return m, g, d, starts, sizes, beta, alpha


def source_run(fn, case, divide: bool) -> torch.Tensor:
    """momentum_source (or a twin) on ``case`` into a NaN-filled buffer: that buffer."""
    m, g, d, starts, sizes, beta, alpha = case
    out = torch.full_like(m, float("nan"))
    g = g.clone() if isinstance(g, torch.Tensor) else g  # (per-segment: the caller's, as given)
    fn(m.clone(), g, _fed(d, len(starts)) if divide else None, out, starts, sizes, beta, alpha)
    return out


def _source_by_torch(case, divide: bool) -> torch.Tensor:
    """The optimizers' torch ops for what momentum_source computes."""
    m, g, d, starts, sizes, beta, alpha = case
    out = torch.full_like(m, float("nan"))
    for lo, size, b, a in zip(starts, sizes, beta, alpha, strict=True):
        s = slice(lo, lo + size)
        torch.mul(m[s], b, out=out[s]).add_(g[s], alpha=a)
        if divide:
            out[s].div_(d[s])
    return out


@pytest.mark.parametrize("divide", [False, True])
def test_momentum_source_is_the_torch_ops_bitwise(divide: bool) -> None:
    """One sweep, torch's floats bit for bit (its add with alpha is a fused multiply-add), on
    1 and 2 threads; gaps between the segments untouched, the inputs unchanged."""
    case = _source_case(2 + divide)
    want = _source_by_torch(case, divide)
    old = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            got = source_run(K.momentum_source, case, divide)
            assert _same_bits(got, want), nt
    finally:
        torch.set_num_threads(old)
    assert _same_bits(source_run(K.reference_momentum_source, case, divide), want)
    m, g, d, starts, sizes, beta, alpha = case
    m0, g0 = m.clone(), g.clone()
    K.momentum_source(m, g, _fed(d, len(starts)), torch.empty_like(m), starts, sizes, beta, alpha)
    assert torch.equal(m, m0) and torch.equal(g, g0)


def _fed(d: torch.Tensor | None, segments: int) -> K.Denominator | None:
    """A [Denominator][lightning_onebit.kernels.Denominator] whose kernels read exactly the buffer
    ``d`` (positive, no over- or underflow in ``d * d``): ``v = d * d`` and ``eps`` 0, since the
    correctly rounded square root of ``fl(d * d)`` is ``d`` in binary floating point."""
    return None if d is None else K.Denominator(d * d, [0.0] * segments)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal as bit patterns (NaNs included: the untouched gaps)."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_momentum_source_portable_path_is_bitwise_too(portable: dict) -> None:
    for divide in (False, True):
        assert _same_bits(portable["source"][divide], _source_by_torch(_source_case(3), divide))
        case, _ = _segment_grads(_source_case(5), 5)  # (per-segment grads, some None)
        assert _same_bits(portable["source_seg"][divide], _source_by_torch(case, divide))


#: segment layouts of the per-segment gradients: sizes around the 8-value vectors, one large
#: segment (several blocks of the kernel, two threads), many small ones
SEGMENT_LAYOUTS = {
    "awkward": AWKWARD,
    "large": [3, 200_003],
    "many": [1 + (7 * k) % 23 for k in range(40)],
}


def _segment_grads(case, seed: int):
    """A gradient for ``case`` (``_source_case``) as one tensor per segment, each in storage
    of its own (some 2-D, some None: zeros), and ``case`` with the flat gradient buffer it
    stands for (zeros where None). ``m`` gets exact +0.0 and -0.0 values, one segment a negative
    beta and one a negative alpha, so that ``m * beta`` is -0.0 where a gradient is missing."""
    m, g, d, starts, sizes, beta, alpha = case
    gen = torch.Generator().manual_seed(seed)
    m[::5] = 0.0
    m[2::7] = -0.0
    beta, alpha = list(beta), list(alpha)
    beta[0], alpha[-1] = -beta[0], -alpha[-1]
    flat, grads = torch.zeros_like(g), []
    for k, (lo, n) in enumerate(zip(starts, sizes, strict=True)):
        if torch.rand(1, generator=gen).item() < 0.3 or k == 1:
            grads.append(None)
            continue
        piece = torch.randn(n, generator=gen) * 1e-3
        piece[::11] = -0.0
        flat[lo : lo + n] = piece
        grads.append(piece.reshape(n // 3, 3).clone() if n % 3 == 0 else piece.clone())
    return (m, flat, d, starts, sizes, beta, alpha), grads


@pytest.mark.parametrize("layout", list(SEGMENT_LAYOUTS))
@pytest.mark.parametrize("divide", [False, True])
def test_momentum_source_per_segment_grads_are_the_flat_form_bitwise(
    layout: str, divide: bool
) -> None:
    """The gradient given per segment (storage of its own, None for zeros) gives the floats of
    the flat gradient buffer holding the same values (zeros where None) bit for bit, -0.0 and
    +0.0 included, on 1 and 2 threads; the reference agrees; inputs unchanged, gaps untouched."""
    sizes = SEGMENT_LAYOUTS[layout]
    case, grads = _segment_grads(_source_case(7 + divide + len(sizes), sizes), len(sizes))
    m = case[0]
    assert any(g is None for g in grads) and any(g is not None for g in grads)
    want = source_run(K.momentum_source, case, divide)
    assert _same_bits(want, _source_by_torch(case, divide))
    before = [None if g is None else g.clone() for g in grads]
    old = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            got = source_run(K.momentum_source, (m, grads, *case[2:]), divide)
            assert _same_bits(got, want), nt
    finally:
        torch.set_num_threads(old)
    got = source_run(K.reference_momentum_source, (m, grads, *case[2:]), divide)
    assert _same_bits(got, want)
    for g, g0 in zip(grads, before, strict=True):
        assert g is g0 is None or _same_bits(g, g0)


def test_momentum_source_missing_grads_give_the_bits_of_zeros() -> None:
    """A missing gradient is +0.0 in the fused multiply-add, not skipped: where
    ``m * beta`` is -0.0 the result is +0.0 (``-0.0 + 0.0``), as with a buffer of zeros;
    with a negative alpha it stays -0.0."""
    m = torch.tensor([-0.0, 0.0, 1.0, -0.0] * 4)
    for a, want in ((0.1, [0.0, 0.0]), (-0.1, [-0.0, 0.0])):
        got, flat = torch.full_like(m, float("nan")), torch.full_like(m, float("nan"))
        K.momentum_source(m, [None], None, got, [0], [16], [0.9], [a])
        K.momentum_source(m, torch.zeros(16), None, flat, [0], [16], [0.9], [a])
        assert _same_bits(got[:2], torch.tensor(want)), a
        assert _same_bits(got, flat), a


def test_momentum_source_rejects_bad_input() -> None:
    m = torch.zeros(16)
    with pytest.raises(ValueError, match="does not fit"):
        K.momentum_source(m, m, None, torch.zeros(16), [10], [7], [0.9], [0.1])
    with pytest.raises(ValueError, match="one value per segment"):
        K.momentum_source(m, m, None, torch.zeros(16), [0], [8], [0.9, 0.8], [0.1])
    with pytest.raises(TypeError):
        K.momentum_source(m, m.double(), None, torch.zeros(16), [0], [8], [0.9], [0.1])
    out, g8 = torch.zeros(16), torch.zeros(8)
    with pytest.raises(ValueError, match=r"one tensor \(or None\) per segment"):
        K.momentum_source(m, [g8, None], None, out, [0], [8], [0.9], [0.1])
    with pytest.raises(ValueError, match=r"grad\[0\] must have its segment's 8 values, got 7"):
        K.momentum_source(m, [torch.zeros(7)], None, out, [0], [8], [0.9], [0.1])
    with pytest.raises(TypeError, match=r"grad\[1\] must have dtype torch.float32"):
        K.momentum_source(m, [None, g8.double()], None, out, [0, 8], [8, 8], [0.9] * 2, [0.1] * 2)
    with pytest.raises(ValueError, match=r"grad\[0\] must be contiguous"):
        K.momentum_source(m, [torch.zeros(4, 2).t()], None, out, [0], [8], [0.9], [0.1])


def _tiled(sizes: list[int], seed: int, base: int = 5):
    """A momentum source over segments that tile ``[base, base + sum(sizes))`` (an exchange's
    bucket): m, d, per-segment gradients (some None, -0.0 and +0.0 in m), starts, betas."""
    gen = torch.Generator().manual_seed(seed)
    n = base + sum(sizes) + 4
    m, d = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.1 + 1e-4
    m[::5], m[2::7] = 0.0, -0.0
    starts = [base + sum(sizes[:k]) for k in range(len(sizes))]
    grads = [
        None if k % 4 == 1 else torch.randn(z, generator=gen) * 1e-3 for k, z in enumerate(sizes)
    ]
    beta = [0.8 + 0.19 * a for a in torch.rand(len(sizes), generator=gen).tolist()]
    beta[0] = -beta[0]  # (m * beta is -0.0 where m is +0.0)
    alpha = [(1 - abs(b)) * 1.3 for b in beta]
    return m, grads, d, starts, sizes, beta, alpha


def _compress_source(x, w: int, pending: bool, seed: int):
    """Deferred worker_compress of ``x`` (a tensor or an ExchangeSource) with a fresh error,
    previous bits and scale from ``seed``: (bits, scale, y) after the call."""
    gen = torch.Generator().manual_seed(seed)
    nx = x.numel()
    n = -(-nx // (8 * w)) * 8 * w
    error, y = torch.randn(n, generator=gen), torch.full((n,), float("nan"))
    prev = torch.randint(0, 256, (w, n // (8 * w)), generator=gen, dtype=torch.uint8)
    bits, scale = torch.zeros_like(prev), torch.zeros(1)
    K.worker_compress(x, error, bits, scale, deferred=True, error_out=y, pending=pending,
                      prev_bits=prev, prev_scale=torch.tensor([0.03]))  # fmt: skip
    return bits, scale, y


#: tilings of a bucket: segment ends inside and across 8-value groups and 8192-value blocks
#: (rows of W = 3 cut them elsewhere), a padded tail, many small segments, one large
SOURCE_TILINGS = {
    "awkward": [1, 7, 8, 9, 31, 33, 20_003],
    "blocks": [8190, 5, 8192, 16_389, 3],
    "many": [1 + (7 * k) % 23 for k in range(40)],
    "large": [100_001],
}


@pytest.mark.parametrize("tiling", list(SOURCE_TILINGS))
@pytest.mark.parametrize("divide", [False, True])
def test_worker_compress_of_a_momentum_source_is_the_buffer_form_bitwise(
    tiling: str, divide: bool
) -> None:
    """A MomentumSource compressed as it is read gives the bits, scale and y of
    ``momentum_source`` into a buffer then ``worker_compress`` of it, bit for bit (W = 1, 2, 3,
    with and without a pending update, 1 and 2 threads), without writing ``out``; the
    gradients unchanged."""
    m, grads, d, starts, sizes, beta, alpha = _tiled(SOURCE_TILINGS[tiling], len(tiling))
    d = d if divide else None
    before = [None if g is None else g.clone() for g in grads]
    lo, hi = starts[0], starts[-1] + sizes[-1]
    buf = torch.full_like(m, float("nan"))
    K.momentum_source(m, grads, _fed(d, len(starts)), buf, starts, sizes, beta, alpha)
    old = torch.get_num_threads()
    try:
        for nt, w, pending in itertools.product((1, 2), (1, 2, 3), (False, True)):
            torch.set_num_threads(nt)
            out = torch.full_like(m, float("nan"))
            source = K.MomentumSource(
                m, grads, _fed(d, len(starts)), out, starts, sizes, beta, alpha
            )
            assert source.computed_as_read and source.numel() == hi - lo
            got = _compress_source(source, w, pending, seed=w)
            want = _compress_source(buf[lo:hi], w, pending, seed=w)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (nt, w, pending)
            assert out.isnan().all(), (nt, w, pending)
    finally:
        torch.set_num_threads(old)
    for g, g0 in zip(grads, before, strict=True):
        assert g is g0 is None or _same_bits(g, g0)


def test_worker_compress_of_a_momentum_source_portable_path_is_bitwise_too(portable: dict) -> None:
    m, grads, d, starts, sizes, beta, alpha = _tiled(SOURCE_TILINGS["awkward"], 3)
    buf = torch.full_like(m, float("nan"))
    K.momentum_source(m, grads, _fed(d, len(starts)), buf, starts, sizes, beta, alpha)
    want = _compress_source(buf[starts[0] : starts[-1] + sizes[-1]], 3, True, seed=3)
    for a, b in zip(portable["compress_source"], want, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _two_call(x, w: int, seed: int):
    """``worker_compress(x, update_error=False)`` then ``worker_update_error`` (a tensor, or a
    source: recomputed as read) with a fresh error from ``seed``: (bits, scale, error,
    the update's recomputed scale or None)."""
    gen = torch.Generator().manual_seed(seed)
    n = -(-x.numel() // (8 * w)) * 8 * w
    error = torch.randn(n, generator=gen)
    bits, scale = torch.zeros(w, n // (8 * w), dtype=torch.uint8), torch.zeros(1)
    before = error.clone()
    K.worker_compress(x, error, bits, scale, update_error=False)
    assert _same_bits(error, before)  # (left for the second call)
    got = K.worker_update_error(x, error, scale, rows=w)
    return bits, scale, error, got


def _never_made() -> torch.Tensor:
    raise AssertionError("the source's buffer was made")


@pytest.mark.parametrize("tiling", list(SOURCE_TILINGS))
def test_the_two_call_form_of_a_source_recomputes_it_bitwise(tiling: str) -> None:
    """A MomentumSource and a LocalSource through the two-call form (the compression, then the
    error update once the call goes ahead: one error buffer) give the bits, scale and error of
    their values in a buffer, bit for bit, without making the source's buffer (W = 1, 2, 3, 1
    and 2 threads); the update returns the compression's scale, and another one once an input
    changed in between."""
    m, grads, d, starts, sizes, beta, alpha = _tiled(SOURCE_TILINGS[tiling], len(tiling))
    (lm, lg, ld), p, acc, lst, lsz, hp = _local_tiled(SOURCE_TILINGS[tiling], len(tiling) + 1)
    buf, lbuf = torch.full_like(m, float("nan")), torch.full_like(lm, float("nan"))
    K.momentum_source(m, grads, _fed(d, len(starts)), buf, starts, sizes, beta, alpha)
    largs = dict(exp_avg=lm, grad=lg, denom=_fed(ld, len(lst)), param=p, acc=acc, starts=lst, sizes=lsz, **hp,
                 preconditioned=True)  # fmt: skip
    K.local_source(out=lbuf, **largs)
    sources = {
        "momentum": (K.MomentumSource(m, grads, _fed(d, len(starts)), _never_made, starts, sizes, beta, alpha),
                     buf[starts[0] : starts[-1] + sizes[-1]]),
        "local": (K.LocalSource(out=_never_made, **largs), lbuf[lst[0] : lst[-1] + lsz[-1]]),
    }  # fmt: skip
    old = torch.get_num_threads()
    try:
        for (name, (source, values)), nt, w in itertools.product(
            sources.items(), (1, 2), (1, 2, 3)
        ):
            torch.set_num_threads(nt)
            assert source.updated_as_read
            *got, recomputed = _two_call(source, w, seed=w)
            *want, none = _two_call(values, w, seed=w)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (name, nt, w)
            assert none is None and recomputed == want[1].item(), (name, nt, w)
    finally:
        torch.set_num_threads(old)
    gen = torch.Generator().manual_seed(0)
    n = -(-sources["momentum"][0].numel() // 16) * 16
    error, bits, scale = torch.randn(n, generator=gen), torch.zeros(2, n // 16, dtype=torch.uint8), torch.zeros(1)  # fmt: skip
    K.worker_compress(sources["momentum"][0], error, bits, scale, update_error=False)
    for g in grads:  # clipped in between
        if g is not None:
            g.mul_(0.5)
    assert K.worker_update_error(sources["momentum"][0], error, scale, rows=2) != scale.item()


def test_the_two_call_form_portable_path_is_bitwise_too(portable: dict) -> None:
    m, grads, d, starts, sizes, beta, alpha = _tiled(SOURCE_TILINGS["awkward"], 3)
    buf = torch.full_like(m, float("nan"))
    K.momentum_source(m, grads, _fed(d, len(starts)), buf, starts, sizes, beta, alpha)
    *want, _ = _two_call(buf[starts[0] : starts[-1] + sizes[-1]], 3, seed=3)
    *got, recomputed = portable["two_call"]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert recomputed == want[1].item()


def test_a_source_elsewhere_is_materialized_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the values cannot be recomputed as read (the pure-torch path), the two-call form
    computes the source into ``out`` first: the same results as from a buffer."""
    m, grads, d, starts, sizes, beta, alpha = _tiled([3, 29, 12], 4)
    lo, hi = starts[0], starts[-1] + sizes[-1]
    buf = torch.zeros_like(m)
    K.momentum_source(m, grads, _fed(d, len(starts)), buf, starts, sizes, beta, alpha)
    source = K.MomentumSource(
        m, grads, _fed(d, len(starts)), torch.zeros_like(m), starts, sizes, beta, alpha
    )
    want = _two_call(buf[lo:hi], 2, seed=1)
    monkeypatch.setattr(K.native, "use_native", lambda: False)  # (the torch path)
    assert not source.updated_as_read and not source.computed_as_read
    got = _two_call(source, 2, seed=1)
    assert torch.equal(source.out[lo:hi], buf[lo:hi])
    for a, b in zip(got[:3], want[:3], strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_momentum_source_rejects_segments_that_do_not_tile_a_range() -> None:
    m = torch.zeros(32)
    args = (m, m, None, torch.zeros(32))
    with pytest.raises(ValueError, match="tile a non-empty flat range in order"):
        K.MomentumSource(*args, [0, 9], [8, 8], [0.9] * 2, [0.1] * 2)  # (a gap)
    with pytest.raises(ValueError, match="tile a non-empty flat range in order"):
        K.MomentumSource(*args, [8, 0], [8, 8], [0.9] * 2, [0.1] * 2)  # (out of order)
    with pytest.raises(ValueError, match="tile a non-empty flat range in order"):
        K.MomentumSource(*args, [], [], [], [])
    with pytest.raises(ValueError, match="does not fit"):
        K.MomentumSource(*args, [30], [8], [0.9], [0.1])


def _frozen_by_torch(case, precond: bool):
    """The optimizers' torch ops (m = x * d or x; decoupled_update_'s decay and step)."""
    x, m0, d, params, starts, lr, wd = case
    m, ps = m0.clone(), [p.clone() for p in params]
    for j, (p, lo) in enumerate(zip(ps, starts, strict=True)):
        s = slice(lo, lo + p.numel())
        m[s] = x[s] * d[s] if precond else x[s]
        if wd[j] > 0:
            torch._foreach_add_([p], [p], alpha=-lr[j] * wd[j])
        if precond:
            torch._foreach_add_([p], [x[s]], alpha=-lr[j])
        else:
            torch._foreach_addcdiv_([p], [x[s]], [d[s]], value=-lr[j])
    return m, ps


@pytest.mark.parametrize("precond", [False, True])
def test_frozen_adam_update_cpu_without_verdict_is_bitwise_on_awkward_sizes(precond: bool) -> None:
    """ok=None (the CPU optimizers' call): the torch ops' floats bit for bit on sizes around
    the vector width, on 1 and 2 threads; x may be m itself (the exchange wrote into m)."""
    case = _frozen_case(11, AWKWARD)
    want_m, want_p = _frozen_by_torch(case, precond)
    old = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            m, ps = frozen_run(case, None, precond)
            assert torch.equal(m, want_m), nt
            assert all(torch.equal(a, b) for a, b in zip(ps, want_p, strict=True)), nt
    finally:
        torch.set_num_threads(old)
    _, m0, d, params, starts, lr, wd = case
    if not precond:  # x is m: the kernel leaves m as it is
        m, ps = m0.clone(), [p.clone() for p in params]
        K.frozen_adam_update(None, m, m, _fed(d, len(ps)), ps, starts, lr, wd, False)
        _, want_p = _frozen_by_torch((m0, m0, d, params, starts, lr, wd), False)
        assert torch.equal(m, m0)
        assert all(torch.equal(a, b) for a, b in zip(ps, want_p, strict=True))


def test_frozen_adam_update_portable_path_is_bitwise_too(portable: dict) -> None:
    for precond in (False, True):
        want_m, want_p = _frozen_by_torch(_frozen_case(11, AWKWARD), precond)
        m, ps = portable["frozen"][precond]
        assert torch.equal(m, want_m)
        assert all(torch.equal(a, b) for a, b in zip(ps, want_p, strict=True))


def _local_case(seed: int):
    """Inputs of local_source on AWKWARD segments with 3-value gaps: (m, g, d), the flat
    parameters, the accumulator, starts, sizes and per segment the coefficients (``beta``,
    ``alpha``, ``lr``, ``weight_decay``, by name), the decay 0 on every third segment."""
    m, g, d, starts, sizes, beta, _ = _source_case(seed)
    gen = torch.Generator().manual_seed(seed + 100)
    p, acc = torch.randn(m.numel(), generator=gen), torch.randn(m.numel(), generator=gen) * 1e-3
    r = torch.rand(len(sizes), generator=gen).tolist()
    lr = [1e-3 * (1 + a) for a in r]
    wd = [0.0 if k % 3 == 0 else 0.01 * (1 + a) for k, a in enumerate(r)]
    hp = {"beta": beta, "alpha": [1 - b for b in beta], "lr": lr, "weight_decay": wd}
    return (m, g, d), p, acc, starts, sizes, hp


def local_runs(fn, precond: bool) -> dict:
    """local_source (or its twin) on ``_local_case(4)`` into NaN-filled buffers, with and
    without the decay and accumulator terms: {(decay, acc): out}."""
    (m, g, d), p, acc, starts, sizes, hp = _local_case(4)
    runs = {}
    for decay, with_acc in itertools.product((False, True), repeat=2):
        out = torch.full_like(p, float("nan"))
        fn(exp_avg=m, grad=g, denom=_fed(d, len(starts)), param=p if decay else None, acc=acc if with_acc else None,
           out=out, starts=starts, sizes=sizes, **hp, preconditioned=precond)  # fmt: skip
        runs[(decay, with_acc)] = out
    return runs


def _local_by_torch(precond: bool) -> dict:
    """The optimizer's torch ops (ZeroOneAdam._exchange_source) for local_runs' cases."""
    (m, g, d), p, acc, starts, sizes, hp = _local_case(4)
    beta, lr, wd = hp["beta"], hp["lr"], hp["weight_decay"]
    runs = {}
    for decay, with_acc in itertools.product((False, True), repeat=2):
        out = torch.full_like(p, float("nan"))
        for lo, n, b, r, w in zip(starts, sizes, beta, lr, wd, strict=True):
            s = slice(lo, lo + n)
            torch.mul(m[s], b, out=out[s]).add_(g[s], alpha=1 - b)
            if precond:
                out[s].div_(d[s])
                if decay and w > 0:
                    out[s].add_(p[s], alpha=w)
            elif decay and w > 0:
                out[s].addcmul_(p[s], d[s], value=w)
            out[s].mul_(-r)
            if with_acc:
                if precond:
                    out[s].add_(acc[s])
                else:
                    out[s].addcmul_(acc[s], d[s])
        runs[(decay, with_acc)] = out
    return runs


@pytest.mark.parametrize("precond", [False, True])
def test_local_source_is_the_torch_ops_bitwise(precond: bool) -> None:
    """One sweep, the optimizer's torch floats bit for bit (its add with alpha and addcmul_ are
    fused multiply-adds) on sizes around the vector width, 1 and 2 threads, with and without
    each optional term; gaps untouched, inputs unchanged."""
    want = _local_by_torch(precond)
    old = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            got = local_runs(K.local_source, precond)
            assert all(_same_bits(got[k], want[k]) for k in want), nt
    finally:
        torch.set_num_threads(old)
    ref = local_runs(K.reference_local_source, precond)
    assert all(_same_bits(ref[k], want[k]) for k in want)
    assert not _same_bits(want[(True, True)], want[(False, False)])  # (the terms count)
    tensors, p, acc, starts, sizes, hp = _local_case(4)
    before = [t.clone() for t in (*tensors, p, acc)]
    m, g, d = tensors
    K.local_source(exp_avg=m, grad=g, denom=_fed(d, len(starts)), param=p, acc=acc, out=torch.empty_like(p),
                   starts=starts, sizes=sizes, **hp, preconditioned=precond)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(before, (*tensors, p, acc), strict=True))


def test_local_source_portable_path_is_bitwise_too(portable: dict) -> None:
    for precond in (False, True):
        want, got = _local_by_torch(precond), portable["local"][precond]
        assert all(_same_bits(got[k], want[k]) for k in want)


def _local_tiled(sizes: list[int], seed: int):
    """A local source over segments that tile a range (``_tiled``'s, some gradients None):
    (m, per-segment grads, d), flat p and acc, starts, sizes, coefficients by name (decay 0 on
    every third segment)."""
    m, grads, d, starts, sizes, beta, alpha = _tiled(sizes, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    p, acc = torch.randn(m.numel(), generator=gen), torch.randn(m.numel(), generator=gen) * 1e-3
    lr = [1e-3 * (1 + a) for a in torch.rand(len(sizes), generator=gen).tolist()]
    wd = [0.0 if k % 3 == 0 else 0.01 * (k + 1) for k in range(len(sizes))]
    hp = {"beta": beta, "alpha": alpha, "lr": lr, "weight_decay": wd}
    return (m, grads, d), p, acc, starts, sizes, hp


def _flat_grad(grads, starts, like: torch.Tensor) -> torch.Tensor:
    """The flat gradient buffer that per-segment ``grads`` stand for (zeros where None)."""
    flat = torch.zeros_like(like)
    for g, lo in zip(grads, starts, strict=True):
        if g is not None:
            flat[lo : lo + g.numel()] = g.reshape(-1)
    return flat


def _param_pieces(p: torch.Tensor, starts: list[int], sizes: list[int]) -> list[torch.Tensor]:
    """Each segment's values of the flat ``p`` in storage of its own (the parameters where
    they lie)."""
    return [p[lo : lo + n].clone() for lo, n in zip(starts, sizes, strict=True)]


@pytest.mark.parametrize("precond", [False, True])
def test_local_source_per_segment_tensors_are_the_flat_form_bitwise(precond: bool) -> None:
    """The gradient given per segment (storage of its own, None for zeros) and the parameter
    given per segment give the floats of the flat buffers holding the same values bit for bit
    (the kernel on 1 and 2 threads, the reference), with and without the decay and
    accumulator terms."""
    (m, grads, d), p, acc, starts, sizes, hp = _local_tiled(SOURCE_TILINGS["awkward"], 9)
    assert any(g is None for g in grads)
    flat, pieces = _flat_grad(grads, starts, m), _param_pieces(p, starts, sizes)
    old = torch.get_num_threads()
    try:
        for nt, decay, with_acc in itertools.product((1, 2), (False, True), (False, True)):
            torch.set_num_threads(nt)
            a = acc if with_acc else None
            want, got, ref = (torch.full_like(m, float("nan")) for _ in range(3))
            common = dict(exp_avg=m, denom=_fed(d, len(starts)), acc=a, starts=starts, sizes=sizes, **hp,
                          preconditioned=precond)  # fmt: skip
            K.local_source(grad=flat, param=p if decay else None, out=want, **common)
            terms = dict(grad=grads, param=pieces if decay else None, **common)
            K.local_source(out=got, **terms)
            K.reference_local_source(out=ref, **terms)
            assert _same_bits(got, want) and _same_bits(ref, want), (nt, decay, with_acc)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("tiling", list(SOURCE_TILINGS))
@pytest.mark.parametrize("precond", [False, True])
def test_worker_compress_of_a_local_source_is_the_buffer_form_bitwise(
    tiling: str, precond: bool
) -> None:
    """A LocalSource compressed as it is read gives the bits, scale and y of ``local_source``
    into a buffer then ``worker_compress`` of it, bit for bit (W = 1, 2, 3, with and without a
    pending update, the decay and accumulator terms, 1 and 2 threads), without writing
    ``out``; its inputs unchanged."""
    tensors, p, acc, starts, sizes, hp = _local_tiled(SOURCE_TILINGS[tiling], len(tiling) + 1)
    m, grads, _ = tensors
    before = [t.clone() for t in (m, p, acc)] + [g.clone() for g in grads if g is not None]
    lo, hi = starts[0], starts[-1] + sizes[-1]
    pieces = _param_pieces(p, starts, sizes)
    old = torch.get_num_threads()
    try:
        for nt, w, pending, param in itertools.product(
            (1, 2), (1, 2, 3), (False, True), (None, p, pieces)
        ):
            torch.set_num_threads(nt)
            common = dict(exp_avg=m, grad=grads, denom=_fed(tensors[2], len(starts)), starts=starts, sizes=sizes,
                          **hp, preconditioned=precond)  # fmt: skip
            a = None if param is None else acc
            buf, out = torch.full_like(m, float("nan")), torch.full_like(m, float("nan"))
            flat_param = None if param is None else p
            K.local_source(param=flat_param, acc=a, out=buf, **common)
            source = K.LocalSource(param=param, acc=a, out=out, **common)
            assert source.computed_as_read and source.numel() == hi - lo
            got = _compress_source(source, w, pending, seed=w)
            want = _compress_source(buf[lo:hi], w, pending, seed=w)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (nt, w, pending)
            assert out.isnan().all(), (nt, w, pending)
    finally:
        torch.set_num_threads(old)
    after = [t for t in (m, p, acc)] + [g for g in grads if g is not None]
    assert all(_same_bits(a, b) for a, b in zip(after, before, strict=True))


def test_worker_compress_of_a_local_source_portable_path_is_bitwise_too(portable: dict) -> None:
    (m, g, d), p, acc, starts, sizes, hp = _local_tiled(SOURCE_TILINGS["awkward"], 3)
    buf = torch.full_like(p, float("nan"))
    K.local_source(exp_avg=m, grad=g, denom=_fed(d, len(starts)), param=p, acc=acc, out=buf, starts=starts,
                   sizes=sizes, **hp, preconditioned=True)  # fmt: skip
    want = _compress_source(buf[starts[0] : starts[-1] + sizes[-1]], 3, True, seed=3)
    for got in (portable["compress_local"], portable["compress_local_pieces"]):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_local_source_elsewhere_is_materialized_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the values cannot be recomputed as read (the pure-torch path), the two-call form
    computes a LocalSource into ``out`` first: the results of the buffer."""
    (m, g, d), p, acc, starts, sizes, hp = _local_tiled([3, 29, 12], 4)
    lo, hi = starts[0], starts[-1] + sizes[-1]
    buf = torch.zeros_like(p)
    args = dict(exp_avg=m, grad=g, denom=_fed(d, len(starts)), param=p, acc=acc, starts=starts, sizes=sizes, **hp,
                preconditioned=False)  # fmt: skip
    K.local_source(out=buf, **args)
    want = _two_call(buf[lo:hi], 2, seed=2)
    source = K.LocalSource(out=torch.zeros_like(p), **args)
    monkeypatch.setattr(K.native, "use_native", lambda: False)  # (the torch path)
    got = _two_call(source, 2, seed=2)
    assert torch.equal(source.out[lo:hi], buf[lo:hi])
    assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3], strict=True))


def test_local_source_rejects_segments_that_do_not_tile_a_range() -> None:
    t = torch.zeros(32)
    hp = {"beta": [0.9] * 2, "alpha": [0.1] * 2, "lr": [1e-3] * 2, "weight_decay": [0.0] * 2}
    one = {k: c[:1] for k, c in hp.items()}
    args = dict(exp_avg=t, param=None, acc=None, out=t.clone(), preconditioned=True)
    with pytest.raises(ValueError, match="LocalSource's segments must tile a non-empty"):
        K.LocalSource(grad=t, starts=[0, 9], sizes=[8, 8], denom=_fed(t, 2), **hp, **args)
    with pytest.raises(ValueError, match="does not fit"):
        K.LocalSource(grad=t, starts=[30], sizes=[8], denom=_fed(t, 1), **one, **args)
    with pytest.raises(ValueError, match=r"grad\[0\] must have its segment's 8 values"):
        K.LocalSource(grad=[torch.zeros(7)], starts=[0], sizes=[8], denom=_fed(t, 1), **one, **args)


def _step_case(seed: int, sizes: list[int] = AWKWARD):
    """Inputs of local_step: m, per-parameter gradients (some None, one 2-D), d, acc, the
    parameters (3-value gaps before each in the flat buffers), starts and per parameter the
    coefficients (``beta``, ``alpha``, ``lr``, ``weight_decay`` by name; the decay 0 on every
    third), with exact zeros of both signs in m."""
    m, g, d, starts, sizes, beta, alpha = _source_case(seed, sizes)
    gen = torch.Generator().manual_seed(seed + 50)
    m[::5], m[2::7] = 0.0, -0.0
    acc = torch.randn(m.numel(), generator=gen) * 1e-3
    grads = [
        None if k % 4 == 1 else g[lo : lo + n].clone()
        for k, (lo, n) in enumerate(zip(starts, sizes, strict=True))
    ]
    params = [torch.randn(n, generator=gen) for n in sizes]
    if len(sizes) > 2 and sizes[2] == 8:
        grads[2], params[2] = grads[2].view(2, 4), params[2].view(2, 4)
    lr = [1e-3 * (1 + a) for a in torch.rand(len(sizes), generator=gen).tolist()]
    wd = [0.0 if k % 3 == 0 else 0.01 * (k + 1) for k in range(len(sizes))]
    hp = {"beta": beta, "alpha": alpha, "lr": lr, "weight_decay": wd}
    return (m, grads, d, acc), params, starts, hp


def _step_by_torch(case):
    """The optimizer's torch ops of a local step (ZeroOneAdam before its kernel): the
    gradients and parameters gathered into flat buffers, then m, u, acc and the parameters."""
    (m, grads, d, acc), params, starts, hp = case
    beta, alpha, lr, wd = hp["beta"], hp["alpha"], hp["lr"], hp["weight_decay"]
    m, acc, ps = m.clone(), acc.clone(), [p.clone() for p in params]
    g, pflat, u = torch.zeros_like(m), torch.zeros_like(m), torch.zeros_like(m)
    for j, p in enumerate(ps):
        s = slice(starts[j], starts[j] + p.numel())
        if grads[j] is not None:
            g[s] = grads[j].reshape(-1)
        pflat[s] = p.reshape(-1)
    for j, p in enumerate(ps):
        s = slice(starts[j], starts[j] + p.numel())
        m[s].mul_(beta[j]).add_(g[s], alpha=alpha[j])
        torch.div(m[s], d[s], out=u[s])
        if wd[j] > 0:
            u[s].add_(pflat[s], alpha=wd[j])
        acc[s].add_(u[s], alpha=-lr[j])
    for j, p in enumerate(ps):
        s = slice(starts[j], starts[j] + p.numel())
        torch._foreach_add_([p], [u[s].view_as(p)], alpha=-lr[j])
    return m, acc, ps


def step_run(fn, case):
    """local_step (or its twin) on copies of ``case``: (taken, m, acc, params) after it."""
    (m, grads, d, acc), params, starts, hp = case
    m, acc, ps = m.clone(), acc.clone(), [p.clone() for p in params]
    taken = fn(
        exp_avg=m, grad=grads, denom=_fed(d, len(starts)), acc=acc, params=ps, starts=starts, **hp
    )
    return taken, m, acc, ps


def _same_step(got, want) -> bool:
    (m, acc, ps), (wm, wacc, wps) = got, want
    return (
        _same_bits(m, wm)
        and _same_bits(acc, wacc)
        and all(_same_bits(a.reshape(-1), b.reshape(-1)) for a, b in zip(ps, wps, strict=True))
    )


def test_local_step_is_the_torch_ops_bitwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """One sweep, the optimizer's torch floats bit for bit (m, the accumulator and the
    parameters) on sizes around the vector width, 1 and 2 threads, with missing gradients
    (zeros) and a decay on some parameters; the flat-gradient form agrees; the reference too;
    the gaps untouched."""
    case = _step_case(21)
    want = _step_by_torch(case)
    old = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            with monkeypatch.context() as mp:
                mp.setattr(K.updates, "reference_local_step", _refuse)
                taken, *got = step_run(K.local_step, case)
            assert taken and _same_step(got, want), nt
    finally:
        torch.set_num_threads(old)
    (m, grads, d, acc), params, starts, hp = case
    flat = _flat_grad(grads, starts, m)
    taken, *got = step_run(K.local_step, ((m, flat, d, acc), params, starts, hp))
    assert taken and _same_step(got, want)
    taken, *got = step_run(K.reference_local_step, case)
    assert taken and _same_step(got, want)
    assert not _same_bits(want[0], m)  # (the step moved m)


def _refuse(*args, **kwargs):
    raise AssertionError("the torch ops ran where the kernel should have")


@pytest.mark.parametrize("fn", ["local_step", "reference_local_step"])
def test_local_step_with_a_non_finite_gradient_changes_nothing(fn: str) -> None:
    """A NaN or Inf anywhere (the last value of the large parameter): nothing is written and
    the call says so; the rank sits the step out."""
    for bad in (float("nan"), float("inf")):
        (m, grads, d, acc), params, starts, hp = _step_case(22)
        grads[-1][-1] = bad
        taken, m2, acc2, ps = step_run(getattr(K, fn), ((m, grads, d, acc), params, starts, hp))
        assert not taken
        assert _same_step((m2, acc2, ps), (m, acc, params)), bad


def test_local_step_of_other_parameters_runs_the_torch_ops() -> None:
    """Parameters that are not fp32 and contiguous (bf16, a transposed one) take the torch ops:
    the optimizer's floats as before."""
    (m, grads, d, acc), params, starts, hp = _step_case(23, [16, 40])
    params = [params[0].to(torch.bfloat16), params[1].view(5, 8).t()]
    grads = [grads[0], grads[1] if grads[1] is None else grads[1].view(5, 8).t().contiguous()]
    case = ((m, grads, d, acc), params, starts, hp)
    taken, *got = step_run(K.local_step, case)
    assert taken and _same_step(got, _step_by_torch(case))


def test_local_step_portable_path_is_bitwise_too(portable: dict) -> None:
    taken, *got = portable["local_step"]
    assert taken and _same_step(got, _step_by_torch(_step_case(21)))


def test_local_source_rejects_bad_input() -> None:
    t = torch.zeros(16)
    hp = {"beta": [0.9], "alpha": [0.1], "lr": [1e-3], "weight_decay": [0.0]}
    tensors = dict(exp_avg=t, grad=t, denom=_fed(t, 1), acc=None, preconditioned=True)
    args = dict(**tensors, out=t.clone(), starts=[0], sizes=[8])
    with pytest.raises(ValueError, match="does not fit"):
        K.local_source(**tensors, param=None, out=torch.zeros(16), starts=[10], sizes=[7], **hp)
    with pytest.raises(ValueError, match="one value per segment"):
        K.local_source(param=None, **args, **{**hp, "weight_decay": [0.0, 0.1]})
    with pytest.raises(TypeError):
        K.local_source(param=t.double(), **args, **hp)
    for pieces, exc, match in (
        ([t[:8], t[8:]], ValueError, r"param must have one tensor per segment \(1\), got 2"),
        ([t[:7]], ValueError, r"param\[0\] must have its segment's 8 values, got 7"),
        ([None], TypeError, r"param\[0\] is None: give a tensor for every segment"),
        ([t[:8].double()], TypeError, r"param\[0\] must have dtype torch\.float32"),
        ([torch.zeros(16)[::2]], ValueError, r"param\[0\] must be contiguous"),
    ):
        with pytest.raises(exc, match=match):
            K.local_source(param=pieces, **args, **hp)
        with pytest.raises(exc, match=match):
            K.LocalSource(param=pieces, **args, **hp)


def _sync_case(seed: int):
    """Inputs of sync_update on AWKWARD parameters with 3-value gaps: (x, d, m, synced), the
    floored mask, the accumulator, params, starts and per parameter lrs (0 on one: m = 0)."""
    m, g, d, starts, sizes, _, _ = _source_case(seed)
    gen = torch.Generator().manual_seed(seed + 200)
    synced = torch.randn(m.numel(), generator=gen)
    floored = torch.rand(m.numel(), generator=gen) < 0.2
    params = [torch.randn(n, generator=gen) for n in sizes]
    lrs = [0.0 if k == 2 else 1e-3 * (k + 1) for k in range(len(sizes))]
    return (g * 100, d, m, synced), floored, g.clone(), params, starts, lrs


def sync_runs(fn, precond: bool) -> dict:
    """sync_update (or its twin) on copies of ``_sync_case(6)``, with and without the floored
    mask and the accumulator: {(floored, acc): (m, synced, acc, params)}."""
    (x, d, m0, synced0), floored, acc0, params, starts, lrs = _sync_case(6)
    runs = {}
    for with_floor, with_acc in itertools.product((False, True), repeat=2):
        m, synced, acc, ps = m0.clone(), synced0.clone(), acc0.clone(), [p.clone() for p in params]
        fn(exchanged=x, denom=_fed(d, len(starts)), exp_avg=m, synced=synced, floored=floored if with_floor else None,
           acc=acc if with_acc else None, params=ps, starts=starts, lrs=lrs,
           preconditioned=precond)  # fmt: skip
        runs[(with_floor, with_acc)] = (m, synced, acc, ps)
    return runs


def _sync_by_torch(precond: bool) -> dict:
    """The optimizer's torch ops (ZeroOneAdam's sync: m from the exchange, masked_fill_, the
    synced copy's add_/addcdiv_, acc.zero_(), copy_to_params_) for sync_runs' cases."""
    (x, d, m0, synced0), floored, acc0, params, starts, lrs = _sync_case(6)
    runs = {}
    for with_floor, with_acc in itertools.product((False, True), repeat=2):
        m, synced, acc, ps = m0.clone(), synced0.clone(), acc0.clone(), [p.clone() for p in params]
        for p, lo, total in zip(ps, starts, lrs, strict=True):
            s = slice(lo, lo + p.numel())
            if with_acc:
                acc[s].zero_()
            src = torch.mul(x[s], d[s], out=m[s]) if precond else x[s]
            if total > 0:
                torch.div(src, -total, out=m[s])
            else:
                m[s].zero_()
            if with_floor:
                m[s].masked_fill_(floored[s], 0.0)
            if precond:
                synced[s].add_(x[s])
            else:
                synced[s].addcdiv_(x[s], d[s])
        torch._foreach_copy_(
            ps, [synced[lo : lo + p.numel()] for p, lo in zip(ps, starts, strict=True)]
        )
        runs[(with_floor, with_acc)] = (m, synced, acc, ps)
    return runs


def _same_sync(got: dict, want: dict) -> bool:
    return all(
        all(_same_bits(a, b) for a, b in zip(got[k][:3], want[k][:3], strict=True))
        and all(_same_bits(a, b) for a, b in zip(got[k][3], want[k][3], strict=True))
        for k in want
    )


@pytest.mark.parametrize("precond", [False, True])
def test_sync_update_is_the_torch_ops_bitwise(precond: bool) -> None:
    """One sweep, the optimizer's torch floats bit for bit on sizes around the vector width,
    1 and 2 threads, with and without the floored mask and the accumulator; a parameter with
    no lr since the last sync gets m = 0; gaps untouched."""
    want = _sync_by_torch(precond)
    old = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            assert _same_sync(sync_runs(K.sync_update, precond), want), nt
    finally:
        torch.set_num_threads(old)
    assert _same_sync(sync_runs(K.reference_sync_update, precond), want)
    _, floored, _, params, starts, _ = _sync_case(6)
    m, _, acc, ps = want[(True, True)]
    lo = starts[2]
    assert torch.equal(m[lo : lo + params[2].numel()], torch.zeros(params[2].numel()))
    last = slice(starts[-1], None)
    assert (m[last][floored[last]] == 0).all() and acc[last].count_nonzero() == 0
    assert (want[(False, False)][0][last][floored[last]] != 0).all()
    assert all(not torch.equal(p, q) for p, q in zip(params, ps, strict=True))


def test_sync_update_portable_path_is_bitwise_too(portable: dict) -> None:
    for precond in (False, True):
        assert _same_sync(portable["sync"][precond], _sync_by_torch(precond))


def test_sync_update_clears_an_accumulator_aligned_unlike_the_momentum() -> None:
    """An accumulator whose address is not the momentum's modulo the vector width (a view one
    value in) is cleared too, the other results unchanged."""
    (x, d, m0, synced0), floored, acc0, params, starts, lrs = _sync_case(6)
    want = _sync_by_torch(True)[(True, True)]
    m, synced, ps = m0.clone(), synced0.clone(), [p.clone() for p in params]
    acc = torch.empty(acc0.numel() + 1)[1:]
    acc.copy_(acc0)
    K.sync_update(exchanged=x, denom=_fed(d, len(starts)), exp_avg=m, synced=synced, floored=floored, acc=acc,
                  params=ps, starts=starts, lrs=lrs, preconditioned=True)  # fmt: skip
    assert _same_sync({0: (m, synced, acc, ps)}, {0: want})


def test_sync_update_casts_into_parameters_of_other_dtypes() -> None:
    """A bf16 or strided parameter gets the synced values cast (the torch copy after the
    kernel); the fp32 ones are written by the kernel, the same values."""
    (x, d, m, synced), floored, acc, params, starts, lrs = _sync_case(6)
    ps = [params[0].bfloat16(), *params[1:6], params[6]]
    ps[5] = torch.randn(33, 2)[:, 0]  # (strided: 33 values)
    K.sync_update(exchanged=x, denom=_fed(d, len(starts)), exp_avg=m, synced=synced, floored=floored, acc=acc,
                  params=ps, starts=starts, lrs=lrs, preconditioned=True)  # fmt: skip
    for p, lo in zip(ps, starts, strict=True):
        assert torch.equal(p, synced[lo : lo + p.numel()].to(p.dtype))


def test_sync_update_rejects_bad_input() -> None:
    t, p = torch.zeros(16), [torch.zeros(8)]
    args = dict(
        exchanged=t, denom=_fed(t, 1), exp_avg=t, synced=t, acc=None, params=p, preconditioned=True
    )
    with pytest.raises(ValueError, match="does not fit"):
        K.sync_update(**args, floored=None, starts=[10], lrs=[1e-3])
    with pytest.raises(ValueError, match="one value per parameter"):
        K.sync_update(**args, floored=None, starts=[0], lrs=[1e-3, 1e-3])
    with pytest.raises(TypeError):
        K.sync_update(**args, floored=torch.zeros(16), starts=[0], lrs=[1e-3])


def test_adam_update_with_a_verdict() -> None:
    """ok true: the call without a verdict, bit for bit; false: nothing written."""
    case = _adam_case(23)
    ref = _adam_run(K.adam_update, case, True)
    yes = _adam_run(
        lambda *a, **k: K.adam_update(*a, **k, ok=torch.ones(1, dtype=torch.bool)), case, True
    )
    no = _adam_run(
        lambda *a, **k: K.adam_update(*a, **k, ok=torch.zeros(1, dtype=torch.bool)), case, True
    )
    bufs, params = case[0], case[1]
    for k in bufs:
        assert torch.equal(yes[0][k], ref[0][k]) and torch.equal(no[0][k], bufs[k]), k
    for a, b in zip(yes[1], ref[1], strict=True):
        assert torch.equal(a, b)
    assert all(torch.equal(a, p) for a, p in zip(no[1], params, strict=True))


def test_a_false_verdict_leaves_lamb_state_and_zeroes_the_update() -> None:
    """lamb_frozen_update with ok false: m and v_fresh as they were, u = 0 (so the step leaves
    the parameters as they were), stats 1, 0, 0 per layer; true: the call without a verdict."""
    bufs, offsets, hp = _lamb_case(17, True)
    ref, stats = _lamb_run(K.lamb_frozen_update, bufs, offsets, hp)
    with_ok, stats_ok = _lamb_run(
        lambda *a, **k: K.lamb_frozen_update(*a, **k, ok=torch.ones(1, dtype=torch.bool)),
        bufs, offsets, hp,
    )  # fmt: skip
    assert all(torch.equal(with_ok[k], ref[k]) for k in ref if ref[k] is not None)
    assert torch.equal(stats_ok, stats)
    got, stats_bad = _lamb_run(
        lambda *a, **k: K.lamb_frozen_update(*a, **k, ok=torch.zeros(1, dtype=torch.bool)),
        bufs, offsets, hp,
    )  # fmt: skip
    for k in ("exp_avg", "exp_avg_sq_fresh", "exchanged"):
        assert torch.equal(got[k], bufs[k]), k
    assert not got["update"][: offsets[-1]].any()
    assert torch.equal(stats_bad, torch.tensor([[1.0, 0.0, 0.0]] * (len(offsets) - 1)).double())


def test_restore_unless_copies_only_on_a_false_verdict() -> None:
    dst, src = torch.randn(100), torch.randn(100)
    before = dst.clone()
    K.restore_unless(torch.ones(1, dtype=torch.bool), dst, src)
    assert torch.equal(dst, before)
    K.restore_unless(torch.zeros(1, dtype=torch.bool), dst, src)
    assert torch.equal(dst, src)
    with pytest.raises(TypeError, match="one-element bool tensor"):
        K.restore_unless(torch.ones(1), dst, src)
    with pytest.raises(ValueError, match="same dtype, size and device"):
        K.restore_unless(torch.ones(1, dtype=torch.bool), dst, src[:5])


def test_adam_update_rejects_bad_input() -> None:
    bufs, params, starts, hp = _adam_case(2, sizes=[4, 4])
    args = list(bufs.values())
    with pytest.raises(ValueError, match="one value per parameter"):
        K.adam_update(*args, params, starts, **{**hp, "eps": [1e-8]})
    with pytest.raises(ValueError, match="does not fit the flat buffers"):
        K.adam_update(*args, params, [0, 9], **hp)
    with pytest.raises(TypeError, match=r"exp_avg_sq must have dtype torch\.float32"):
        K.adam_update(args[0], args[1], args[2].double(), params, starts, **hp)


@pytest.mark.parametrize("seed", [0, 1])
def test_layer_step_steps_each_parameter_by_its_own_values(seed: int) -> None:
    """``p_j += alpha[j] * u_j`` per parameter (each its own values of the update), on
    parameters of any shape: within one rounding of the exact result; the update and alpha
    unchanged."""
    gen = torch.Generator().manual_seed(seed)
    sizes, u = [1, 6, 0, 300], torch.randn(320, generator=gen)
    starts = [3, 4, 10, 10]
    params = [torch.randn(z, generator=gen) for z in sizes]
    params[1] = params[1].view(2, 3)
    alpha = -torch.rand(4, generator=gen) * 1e-2
    before, kept = [p.clone() for p in params], (u.clone(), alpha.clone())
    K.layer_step(u, params, starts, alpha)
    for p, p0, lo, a in zip(params, before, starts, alpha.tolist(), strict=True):
        exact = p0.double() + a * u[lo : lo + p0.numel()].view_as(p0).double()
        assert p.shape == p0.shape
        assert ((p.double() - exact).abs() <= exact.abs() * 2.0**-23).all()
    assert torch.equal(u, kept[0]) and torch.equal(alpha, kept[1])


def test_layer_step_rejects_bad_input() -> None:
    u, p = torch.zeros(8), [torch.zeros(4)]
    with pytest.raises(ValueError, match="one value per parameter"):
        K.layer_step(u, p, [0], torch.zeros(2))
    with pytest.raises(ValueError, match="does not fit"):
        K.layer_step(u, p, [6], torch.zeros(1))
    with pytest.raises(TypeError, match=r"alpha must have dtype torch\.float32"):
        K.layer_step(u, p, [0], torch.zeros(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="update must be contiguous"):
        K.layer_step(torch.zeros(4, 2).t(), p, [0], torch.zeros(1))


def test_lamb_frozen_update_rejects_bad_input() -> None:
    bufs, offsets, hp = _lamb_case(1, True, [4, 4])
    args = list(bufs.values())
    with pytest.raises(ValueError, match="param is required"):
        K.lamb_frozen_update(*args[:4], None, args[5], offsets, **hp)
    with pytest.raises(ValueError, match="one value per layer"):
        K.lamb_frozen_update(*args, offsets, **{**hp, "eps": [1e-8]})
    with pytest.raises(ValueError, match="non-decreasing"):
        K.lamb_frozen_update(*args, [0, 5, 4], **hp)
    with pytest.raises(ValueError, match="the layers need 9"):
        K.lamb_frozen_update(*args, [0, 4, 9], **hp)
    with pytest.raises(TypeError, match=r"exp_avg_sq must have dtype torch\.float32"):
        K.Denominator(args[2].exp_avg_sq.double(), hp["eps"])
    with pytest.raises(TypeError, match="denom must be a Denominator"):
        K.lamb_frozen_update(*args[:2], args[2].exp_avg_sq, *args[3:], offsets, **hp)
    with pytest.raises(ValueError, match="the layers' eps"):
        wrong = K.Denominator(args[2].exp_avg_sq, [1.0, 1.0])
        K.lamb_frozen_update(*args[:2], wrong, *args[3:], offsets, **hp)
    with pytest.raises(ValueError, match="update must be contiguous"):
        K.lamb_frozen_update(*args[:5], torch.zeros(16)[::2], offsets, **hp)
    p = args[4]
    for pieces, exc, match in (
        ([p[:4]], ValueError, r"param must have one tensor per segment \(2\), got 1"),
        ([p[:4], p[4:7]], ValueError, r"param\[1\] must have its segment's 4 values, got 3"),
        ([p[:4], None], TypeError, r"param\[1\] is None: give a tensor for every segment"),
        ([p[:4], p[4:].half()], TypeError, r"param\[1\] must have dtype torch\.float32"),
        ([p[:4], torch.zeros(8)[::2]], ValueError, r"param\[1\] must be contiguous"),
    ):
        with pytest.raises(exc, match=match):
            K.lamb_frozen_update(*args[:4], pieces, args[5], offsets, **hp)


# --------------------------------------------------------------------------- bad input


def _good():
    return (torch.zeros(64), torch.zeros(64), torch.zeros(2, 4, dtype=torch.uint8), torch.zeros(1))


@pytest.mark.parametrize(
    ("mutate", "exc", "match"),
    [
        (lambda a: (a[0].double(), *a[1:]), TypeError, "x must have dtype torch.float32"),
        (lambda a: (a[0].half(), *a[1:]), TypeError, "x must have dtype"),
        (lambda a: (a[0].numpy(), *a[1:]), TypeError, "x must be a torch.Tensor"),
        (
            lambda a: (a[0], a[1], a[2].to(torch.int8), a[3]),
            TypeError,
            "bits must have dtype torch.uint8",
        ),
        (lambda a: (torch.zeros(128)[::2], *a[1:]), ValueError, "x must be contiguous"),
        (lambda a: (a[0], torch.zeros(128)[::2], *a[2:]), ValueError, "error must be contiguous"),
        (lambda a: (torch.zeros(65), *a[1:]), ValueError, "x has 65 values"),
        (lambda a: (a[0], torch.zeros(60), *a[2:]), ValueError, "multiple of 8"),
        (
            lambda a: (a[0], a[1], torch.zeros(2, 5, dtype=torch.uint8), a[3]),
            ValueError,
            "rows must hold 4 bytes",
        ),
        (
            lambda a: (a[0], a[1], torch.zeros(8, dtype=torch.uint8), a[3]),
            ValueError,
            "must be 2-D",
        ),
        (
            lambda a: (a[0], a[1], torch.zeros(4, 2, dtype=torch.uint8).t(), a[3]),
            ValueError,
            "rows must be contiguous",
        ),
        (
            lambda a: (
                a[0],
                a[1],
                torch.zeros(8, dtype=torch.uint8).as_strided((2, 4), (2, 1)),
                a[3],
            ),
            ValueError,
            "overlap",
        ),
        (lambda a: (*a[:3], torch.zeros(2)), ValueError, "exactly one element"),
        (lambda a: (a[0], a[1].to("meta"), *a[2:]), ValueError, "one device"),
        (lambda a: (a[0].to_sparse(), *a[1:]), TypeError, "dense"),
    ],
)
def test_worker_compress_rejects_bad_input(mutate, exc, match) -> None:
    with pytest.raises(exc, match=match):
        K.worker_compress(*mutate(_good()))


def test_server_reduce_and_decompress_reject_bad_input() -> None:
    bits, scales, e = torch.zeros(2, 4, dtype=torch.uint8), torch.ones(2), torch.zeros(32)
    ob, s = torch.zeros(4, dtype=torch.uint8), torch.zeros(1)
    with pytest.raises(ValueError, match="one scale per row"):
        K.server_reduce(bits, torch.ones(3), e, ob, s)
    with pytest.raises(ValueError, match="rows must hold 5 bytes"):
        K.server_reduce(bits, scales, torch.zeros(40), torch.zeros(5, dtype=torch.uint8), s)
    with pytest.raises(ValueError, match="out_bits must hold"):
        K.server_reduce(bits, scales, e, torch.zeros(3, dtype=torch.uint8), s)
    with pytest.raises(TypeError, match="scales must have dtype"):
        K.server_reduce(bits, scales.double(), e, ob, s)
    with pytest.raises(ValueError, match="out has 65 values"):
        K.decompress(bits, scales, torch.zeros(65))
    with pytest.raises(ValueError, match="out must be contiguous"):
        K.decompress(bits, scales, torch.zeros(128)[::2])
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, ValueError)):
            K.decompress(bits, scales, torch.zeros(64, device="meta"))


def test_the_cpp_entry_points_check_sizes_themselves() -> None:
    """Behind the checks of lightning_onebit.kernels, the C++ entry points refuse sizes that would read or write
    out of bounds (or divide by zero: a NaN scale for n = 0) instead of trusting the caller."""
    if native.module is None:
        pytest.skip("the C++ extension is not built")
    buf = torch.zeros(64)
    bits, scale = torch.zeros(8, dtype=torch.uint8), torch.zeros(1)
    x, e, b, s = buf.data_ptr(), buf.data_ptr(), bits.data_ptr(), scale.data_ptr()
    with pytest.raises(ValueError, match="worker_compress_cpu: need"):
        native.module.worker_compress_cpu(x, 0, e, 0, 0, b, 1, 8, 0, 0.0, False, s, 1)  # n = 0
    with pytest.raises(ValueError, match="worker_compress_cpu: need"):
        native.module.worker_compress_cpu(x, 65, e, 0, 64, b, 1, 8, 0, 0.0, False, s, 1)  # nx > n
    with pytest.raises(ValueError, match="worker_compress_cpu: need"):
        native.module.worker_compress_cpu(x, 24, e, e, 24, b, 2, 8, b, 0.0, True, s, 1)  # n % (8W)
    with pytest.raises(ValueError, match="worker_update_error_cpu: need"):
        native.module.worker_update_error_cpu(x, 12, e, e, 12, 1.0, 1)
    with pytest.raises(ValueError, match="server_reduce_cpu: need"):
        native.module.server_reduce_cpu(b, 1, 8, s, 1, e, e, 0, b, 0.0, b, s, False, 1)  # m = 0
    with pytest.raises(ValueError, match="server_reduce_cpu: need"):
        native.module.server_reduce_cpu(b, 0, 8, s, 1, e, e, 64, b, 0.0, b, s, False, 1)  # W = 0
    with pytest.raises(ValueError, match="decompress_cpu: need"):
        native.module.decompress_cpu(b, 1, 8, s, 1, 64, x, 65, 1)  # nout > W * m
    with pytest.raises(ValueError, match="momentum_source_cpu: need"):
        native.module.momentum_source_cpu(x, x, 0, 0, 0, x, -1, 0, 0, 0, 0, 1)  # P < 0
    with pytest.raises(ValueError, match="frozen_adam_update_cpu: need"):
        native.module.frozen_adam_update_cpu(
            x, x, x, x, 0, 0, -1, 0, 0, 0, 0, True, 1, 0, 0, 0, 0, 0
        )
    # runs that hold [0, 8) of a parameter of 16 values; then runs with a gap
    ptrs = torch.tensor([buf.data_ptr()], dtype=torch.int64)
    starts, sizes, lr = torch.tensor([0]), torch.tensor([16]), torch.zeros(1)
    b_ptrs = torch.tensor([b, b], dtype=torch.int64)
    for lo, hi in (([0], [8]), ([0, 9], [8, 16])):
        rl, rh = torch.tensor(lo), torch.tensor(hi)
        with pytest.raises(ValueError, match="frozen_adam_update_cpu: need runs"):
            native.module.frozen_adam_update_cpu(
                0, x, x, lr.data_ptr(), 0, ptrs.data_ptr(), 1, starts.data_ptr(), sizes.data_ptr(),
                lr.data_ptr(), lr.data_ptr(), False, 1,
                len(lo), rl.data_ptr(), rh.data_ptr(), b_ptrs.data_ptr(), s,
            )  # fmt: skip
    with pytest.raises(ValueError, match="local_source_cpu: need"):
        native.module.local_source_cpu(
            x, x, x, x, 0, 0, 0, x, -1, 0, 0, 0, 0, 0, 0, True, 1
        )  # P < 0
    with pytest.raises(ValueError, match="sync_update_cpu: need"):
        native.module.sync_update_cpu(
            x, x, x, 0, 0, x, x, 0, 0, -1, 0, 0, 0, True, 1, 0, 0, 0, 0, 0
        )
    native.module.worker_compress_cpu(
        x, 64, e, 0, 64, b, 1, 8, 0, 0.0, False, s, 1
    )  # (and a valid call goes through)
    assert float(scale) == 0.0


def test_the_cuda_entry_points_check_sizes_before_touching_the_device() -> None:
    """The CUDA entry points refuse bad sizes before any CUDA call (so this runs without a GPU),
    and calls with nothing to do return before it."""
    if native.module is None or not K.HAS_CUDA:
        pytest.skip("the CUDA kernels are not built")
    C = native.module
    with pytest.raises(ValueError, match="worker_compress_cuda: need"):
        C.worker_compress_cuda(0, 0, 0, 0, 0, 0, 0, 1, 8, 0, 0, False, 0, 0, 0)  # n = 0
    with pytest.raises(ValueError, match="server_reduce_cuda: need"):
        C.server_reduce_cuda(0, 0, 0, 8, 0, 1, 0, 0, 64, 0, 0, 0, 0, False, 0, 0)  # W = 0
    with pytest.raises(ValueError, match="decompress_cuda: need"):
        C.decompress_cuda(0, 0, 1, 8, 0, 1, 64, 0, 65, 0)  # nout > W * m

    def adam(n_params: int, nchunks: int) -> None:
        C.adam_update_cuda(0, 0, 0, 0, 0, 0, n_params, 0, 0, 0, nchunks, *[0] * 7, True, 0)

    def lamb(n_layers: int, nchunks: int) -> None:
        C.lamb_frozen_update_cuda(0, *[0] * 8, n_layers, 0, 0, nchunks, *[0] * 7, False, 0, 0, 0)

    def frozen_adam(n_params: int, nchunks: int) -> None:
        C.frozen_adam_update_cuda(0, *[0] * 7, n_params, 0, 0, 0, nchunks, 0, 0, True, 0)

    for fn, name in (
        (adam, "adam_update_cuda"),
        (lamb, "lamb_frozen_update_cuda"),
        (frozen_adam, "frozen_adam_update_cuda"),
    ):
        with pytest.raises(ValueError, match=f"{name}: need . >= 0"):
            fn(-1, 0)
        with pytest.raises(ValueError, match=f"{name}: need nchunks >= 0"):
            fn(3, -1)
        with pytest.raises(ValueError, match=f"{name}: need nchunks >= 0"):
            fn(0, 2)  # chunks but no parameters (layers)
    # nothing to do: no CUDA call, so no error without a GPU
    adam(0, 0)
    adam(3, 0)
    lamb(0, 0)
    frozen_adam(3, 0)
    C.restore_unless_cuda(0, 0, 0, 0, 0, 0)  # 0 bytes
    with pytest.raises(ValueError, match="restore_unless_cuda: need nbytes >= 0"):
        C.restore_unless_cuda(0, 0, 0, 0, -1, 0)
    chunk = C.cuda_update_chunk()
    assert native.chunk_starts([0, 5, chunk, chunk + 1, 0, 3 * chunk]) == [0, 0, 1, 2, 4, 4, 7]


def test_cuda_kernels_are_built_when_nvcc_is_present() -> None:
    """CI compiles the CUDA kernels (they cannot run here): make sure the build did not skip them."""
    import os
    import shutil

    if os.environ.get("ONEBIT_CUDA", "AUTO").upper() == "OFF" or not shutil.which("nvcc"):
        pytest.skip("no nvcc on PATH (or ONEBIT_CUDA=OFF): CUDA kernels are not expected")
    assert K.HAS_CUDA, "nvcc is on PATH but lightning_onebit._C was built without CUDA kernels"


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and K.HAS_CUDA), reason="needs a CUDA GPU")
@pytest.mark.parametrize("w", [1, 2, 4, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cuda_matches_cpu_bitwise(w: int, seed: int) -> None:
    """Wire-format interop: a GPU rank and a CPU rank produce the same bits, scales, errors and
    decoded values, bit for bit, through all three stages (worker, server with a pending error,
    decode). Both sides accumulate the squares in float64 and round the scale once, and every
    other value is one float32 operation on equal inputs: the float64 sums differ only in their
    last bits (~1e-13 relative), far below float32's rounding (6e-8), so equal is expected."""
    gen = torch.Generator().manual_seed(seed)
    n = 8 * w * (12345 + 977 * seed)
    x = torch.randn(n - 5, generator=gen) * (1 + seed)
    e0, es = torch.randn(n, generator=gen), torch.randn(n // w, generator=gen)
    outs: dict[str, list[torch.Tensor]] = {}
    for dev in ("cpu", "cuda"):
        e = e0.clone().to(dev)
        bits = torch.empty(w, n // (8 * w), dtype=torch.uint8, device=dev)
        s = torch.empty(1, device=dev)
        K.worker_compress(x.to(dev), e, bits, s)
        scales = s.expand(w).contiguous() * torch.linspace(0.5, 1.5, w, device=dev)
        err, ob, os_ = (
            es.clone().to(dev),
            torch.empty(n // (8 * w), dtype=torch.uint8, device=dev),
            torch.empty(1, device=dev),
        )
        K.server_reduce(bits, scales, err, ob, os_)
        K.server_reduce(bits, scales, err, ob, os_, pending=True)  # applies the deferred error
        out = torch.empty(n - 5, device=dev)
        K.decompress(bits, scales, out)
        outs[dev] = [t.cpu() for t in (bits, s, e, ob, os_, err, out)]
    names = (
        "bits",
        "scale",
        "worker error",
        "server bits",
        "server scale",
        "server error",
        "decoded",
    )
    for name, a, b in zip(names, outs["cpu"], outs["cuda"], strict=True):
        assert torch.equal(a, b), (
            f"{name} differs (max |diff| {(a.double() - b.double()).abs().max()})"
        )


def test_the_op_table_declares_every_entry_point() -> None:
    """native.OPS names each compiled entry point once: every ``<op>_cpu`` and ``<op>_cuda``
    of the module is an op's, and every op's entries exist."""
    if native.module is None:
        pytest.skip("the C++ extension is not built")
    for device in ("cpu", "cuda"):
        declared = {f"{k}_{device}" for k, op in native.OPS.items() if getattr(op, device)}
        built = {k for k in dir(native.module) if k.endswith(f"_{device}") and k != "has_cuda"}
        assert declared == built or (device == "cuda" and not K.HAS_CUDA and not built), device


def test_the_op_table_checks_only_what_it_declares() -> None:
    """Every tensor kind of the table is one `native.check` knows, and a tensor the op does not
    declare is refused (a misspelt name would otherwise go unchecked)."""
    known = {"f32", "f32s", "f32r", "u8", "u8c", "rows", "scale", "scales", "bool", "any", "ok"}
    for name, op in native.OPS.items():
        assert {kind for _, kind in op.kinds} <= known, name
    with pytest.raises(TypeError, match="declares no tensors"):
        native.check("decompress", bits=torch.zeros(1, 1, dtype=torch.uint8), outt=torch.zeros(8))


@pytest.mark.skipif(not getattr(native.module, "has_cuda", False), reason="built without CUDA")
@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="needs a machine without a GPU (with one, the device guard passes and the kernels would "
    "be launched on host pointers); tests/kernels/test_gpu.py calls the bindings for real there",
)
def test_every_cuda_op_calls_its_binding_with_the_right_arguments(monkeypatch) -> None:
    """Without a GPU the CUDA entry points can still be reached: for every op of the table,
    the launcher's argument list must get past pybind's argument check and the entry's size
    checks and fail only in the device guard (a wrong argument list is a TypeError before any
    CUDA call). The pointers are those of CPU tensors, never read."""
    monkeypatch.setattr(native, "on_device", lambda v, dtype, device: torch.tensor(v, dtype=dtype))
    monkeypatch.setattr(native, "stream", lambda device: 0)
    monkeypatch.setattr(native, "workspace", lambda device, n=None: torch.empty(n or 64))
    g, m, v, p = torch.randn(10), torch.zeros(10), torch.zeros(10), torch.randn(10)
    bits, e, s = torch.zeros(2, 1, dtype=torch.uint8), torch.zeros(16), torch.zeros(1)
    pointers = {"grads": [g[:4], None], "params": [p[:4], p[4:]]}
    ints = {"starts": [0, 4], "sizes": [4, 6], "offsets": [0, 4, 10]}
    coefs = [
        "beta",
        "alpha",
        "nwd",
        "nlr",
        "lr",
        "beta1",
        "ob1",
        "beta2",
        "ob2",
        "eps",
        "wd",
        "nlw",
        "inv",
        "scaling",
    ]
    table = native.Table([4, 6], pointers, ints, {c: [0.1, 0.2] for c in coefs})
    values = dict(
        x=g, error=e, error_out=e, bits=bits, prev_bits=bits, prev_scale=s, pending=True, scale=s,
        out=torch.zeros(16), scales=torch.ones(2), m=8, out_bits=bits[0], out_scale=s,
        exp_avg=m, dscale=None, acc=v, precond=True, base=0, nx=10, ok=torch.ones(1, dtype=torch.bool),
        grad=g, exp_avg_sq=v, update_variance=True, exchanged=g, exp_avg_sq_fresh=v, update=m,
        stats=torch.zeros(2, 3, dtype=torch.float64), floored=None, synced=m,
        alpha=torch.zeros(2), dst=m, src=g,
    )  # fmt: skip
    # the integer codec's: 2 rows of 8 values, 4 bits, blocks of 2 (its bits are a number)
    codec = dict(x=g, n=16, bits=4, block=2, rows=torch.zeros(2, 24, dtype=torch.uint8),
                 out_row=torch.zeros(24, dtype=torch.uint8))  # fmt: skip
    cuda = torch.device("cuda", 0)
    for name, op in native.OPS.items():
        if op.cuda is not None:
            given = {**values, **codec} if "block" in op.cuda else values
            with pytest.raises(RuntimeError, match="onebit: cuda"):
                native.launch(name, cuda, table if "np" in op.cuda else None, **given)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens without a GPU")
def test_the_gpu_scripts_refuse_clearly_without_a_gpu(tmp_path) -> None:
    """scripts/gpu_check.sh and benchmarks/gpu_step.py run only on GPU machines, so CI checks
    that they parse and stop with a message that says why (they must not rot unseen)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    check = subprocess.run(
        ["bash", str(root / "scripts" / "gpu_check.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)},
        timeout=120,
    )
    assert check.returncode == 2, check.stderr
    assert "sees no GPU" in check.stderr
    step = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "gpu_step.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert step.returncode != 0 and "needs a CUDA GPU" in step.stderr, step.stderr


# --------------------------------------------------------------------------- SignRuns


def _sign_runs(n: int, seed: int, lengths: list[int] | None = None) -> K.SignRuns:
    """Runs tiling [0, n) with random lengths (1 value, sub-byte, byte and block sizes), each
    run's bits a row of a records-like buffer (4-byte header, as the exchange's), listed out of
    order; random positive scales."""
    gen = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths, left = [], n
        while left:
            k = min(left, [1, 3, 8, 13, 8192, 9000, 50_000][len(lengths) % 7])
            lengths.append(k)
            left -= k
    runs, lo = [], 0
    for k in lengths:
        row = -(-k // 8) + int(torch.randint(0, 3, (1,), generator=gen))
        rec = torch.randint(0, 256, (4 + row + 5,), dtype=torch.uint8, generator=gen)
        runs.append((lo, lo + k, rec[4 : 4 + row], 0.1 + float(torch.rand(1, generator=gen))))
        lo += k
    assert lo == n
    return K.SignRuns(runs[1::2] + runs[::2])


def test_sign_runs_decode_to_the_wire_format() -> None:
    runs = _sign_runs(80_000, 1)
    x = K.decode_runs(runs, torch.full((80_000,), float("nan")))
    for lo, hi, bits, scale in runs.runs:
        b = np.unpackbits(bits.numpy(), bitorder="little")[: hi - lo].astype(bool)
        want = np.where(b, np.float32(scale), np.float32(-scale))
        assert np.array_equal(x[lo:hi].numpy(), want)


@pytest.mark.parametrize("precond", [False, True])
def test_frozen_adam_update_reads_sign_runs_as_the_decoded_buffer(precond: bool) -> None:
    """The exchange's runs in place of x: m and the parameters bit for bit as from the decoded
    x, with runs that cross parameters and blocks anywhere, on 1 and 2 threads."""
    _, m0, d, params, starts, lr, wd = _frozen_case(13, AWKWARD)
    runs = _sign_runs(m0.numel(), 2)
    x = K.decode_runs(runs, torch.zeros_like(m0))
    want = frozen_run((x, m0, d, params, starts, lr, wd), None, precond)
    old = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            got = frozen_run((runs, m0, d, params, starts, lr, wd), None, precond)
            assert torch.equal(got[0], want[0]), nt
            assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True)), nt
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize(("decay", "precond"), [(False, False), (True, False), (True, True)])
def test_lamb_frozen_update_reads_sign_runs_as_the_decoded_buffer(
    decay: bool, precond: bool
) -> None:
    """As for 1-bit Adam: the floats written and the statistics bit for bit, 1 and 2 threads;
    the layers may start anywhere in the runs (here at value 5 of the buffer)."""
    bufs, offsets, hp = _lamb_case(17 + decay, decay)
    offsets = [5 + o for o in offsets]
    den = bufs.pop("denom")
    bufs = {k: None if v is None else torch.cat([v, v[:5]]) for k, v in bufs.items()}
    v = den.exp_avg_sq
    bufs = {**bufs, "denom": K.Denominator(torch.cat([v, v[:5]]), den.eps)}
    bufs = {
        k: bufs[k] for k in ("exchanged", "exp_avg", "denom", "exp_avg_sq_fresh", "param", "update")
    }
    runs = _sign_runs(offsets[-1], 3)
    x = K.decode_runs(runs, torch.zeros(offsets[-1]))
    want = _lamb_run(
        K.lamb_frozen_update, {**bufs, "exchanged": x}, offsets, {**hp, "preconditioned": precond}
    )
    old = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            got = _lamb_run(
                K.lamb_frozen_update,
                {**bufs, "exchanged": runs},
                offsets,
                {**hp, "preconditioned": precond},
            )
            assert torch.equal(got[1], want[1]), nt
            for k in ("exp_avg", "exp_avg_sq_fresh", "update"):  # (update: NaN before 5)
                torch.testing.assert_close(
                    got[0][k], want[0][k], rtol=0, atol=0, equal_nan=True, msg=f"{nt} {k}"
                )
    finally:
        torch.set_num_threads(old)


def test_sign_runs_must_tile_what_the_update_reads() -> None:
    _, m0, d, params, starts, lr, wd = _frozen_case(13, AWKWARD)
    short = _sign_runs(m0.numel() - 1, 2)
    with pytest.raises(ValueError, match="the update reads"):
        frozen_run((short, m0, d, params, starts, lr, wd), None, False)
    bits = torch.zeros(2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="tile a flat range"):
        K.SignRuns([(0, 8, bits, 1.0), (9, 16, bits, 1.0)])
    with pytest.raises(ValueError, match="tile a flat range"):
        K.SignRuns([(0, 24, bits, 1.0)])  # 2 bytes hold 16 values
    with pytest.raises(ValueError, match="at least one run"):
        K.SignRuns([])


def sign_runs_pair() -> dict:
    """1-bit Adam's and LAMB's updates from SignRuns and from the decoded buffer (for the
    portable path's test): {name: (from runs, from decoded)}."""
    _, m0, d, params, starts, lr, wd = _frozen_case(13, AWKWARD)
    runs = _sign_runs(m0.numel(), 2)
    x = K.decode_runs(runs, torch.zeros_like(m0))
    out = {
        "frozen": tuple(
            frozen_run((src, m0, d, params, starts, lr, wd), None, False) for src in (runs, x)
        )
    }
    bufs, offsets, hp = _lamb_case(19, True)
    runs = _sign_runs(offsets[-1], 3)
    x = K.decode_runs(runs, torch.zeros(offsets[-1]))
    out["lamb"] = tuple(
        _lamb_run(K.lamb_frozen_update, {**bufs, "exchanged": src}, offsets, hp)
        for src in (runs, x)
    )
    out["lamb"] = tuple(
        (b["exp_avg"], b["exp_avg_sq_fresh"], b["update"], s) for b, s in out["lamb"]
    )
    return out


def test_sign_runs_on_the_portable_path(portable: dict) -> None:
    (m1, p1), (m2, p2) = portable["sign_runs"]["frozen"]
    assert torch.equal(m1, m2) and all(torch.equal(a, b) for a, b in zip(p1, p2, strict=True))
    got, want = portable["sign_runs"]["lamb"]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
