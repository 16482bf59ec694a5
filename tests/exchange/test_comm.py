"""CompressedAllreduce against a single-process simulation of all W ranks, on real gloo groups."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from lightning_onebit.comm import CompressedAllreduce, fp32_allreduce_bytes
from tests.helpers.dist import run_distributed

SIZES = [1, 7, 8, 9, 1023, 10**6 + 3]


# --------------------------------------------------------------------------- reference
# Written from the algorithm's description (docs/how-it-works.md, "The compressed allreduce"),
# sharing no code with the package.


class Simulation:
    """All W ranks of the two-stage error-compensated exchange in one process."""

    def __init__(self, n: int, w: int) -> None:
        self.n, self.w = n, w
        self.n_pad = math.ceil(n / (8 * w)) * 8 * w
        self.m = self.n_pad // w
        self.worker_err = [torch.zeros(self.n_pad) for _ in range(w)]
        self.server_err = [torch.zeros(self.m) for _ in range(w)]

    @staticmethod
    def _compress(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = (v.double().norm() / math.sqrt(v.numel())).float()
        sign = torch.where(v >= 0, 1.0, -1.0)  # sign(0) = +1, also for -0.0
        return scale, sign

    def __call__(self, xs: list[torch.Tensor]) -> torch.Tensor:
        w, m = self.w, self.m
        scales, signs = [], []
        for i, x in enumerate(xs):
            y = (
                torch.nn.functional.pad(x.reshape(-1), (0, self.n_pad - self.n))
                + self.worker_err[i]
            )
            s, sg = self._compress(y)
            self.worker_err[i] = y - s * sg
            scales.append(s)
            signs.append(sg)
        out = []
        for j in range(w):  # rank j serves chunk j
            c = torch.zeros(m)
            for i in range(w):
                c += signs[i][j * m : (j + 1) * m] * (scales[i] / w)
            c += self.server_err[j]
            s, sg = self._compress(c)
            self.server_err[j] = c - s * sg
            out.append(s * sg)
        return torch.cat(out)[: self.n]


def _inputs(rank: int, step: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, generator=g) + 0.5 * (rank - 1)  # ranks disagree: the average matters
    if n > 20:
        x[::17] = 0.0
        x[5::19] = -0.0
    return x


# --------------------------------------------------------------------------- distributed


def _exchange_worker(rank: int, world: int, sizes: list[int], steps: int) -> dict:
    outs = {}
    for n in sizes:
        ex = CompressedAllreduce(n)
        assert ex.world_size == world and ex.rank == rank
        outs[n] = [
            ex(_inputs(rank, t, n).view(-1, 1) if n % 2 else _inputs(rank, t, n)).clone().view(-1)
            for t in range(steps)
        ]
        outs[(n, "bytes")] = ex.bytes_sent
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_exchange_matches_simulation_on_every_rank(world: int) -> None:
    steps = 4
    results = run_distributed(_exchange_worker, world, SIZES, steps)
    for n in SIZES:
        sim = Simulation(n, world)
        for t in range(steps):
            expect = sim([_inputs(r, t, n) for r in range(world)])
            for r in range(world):
                got = results[r][n][t]
                assert got.shape == (n,)
                assert torch.equal(got, results[0][n][t]), (
                    f"rank {r} differs from rank 0 (n={n}, step {t})"
                )
                torch.testing.assert_close(
                    got, expect, rtol=1e-6, atol=1e-7 * float(expect.abs().max())
                )


def _error_feedback_worker(
    rank: int, world: int, n: int, calls: int, feedback: bool
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    base = torch.randn(n, generator=g) * torch.linspace(0.01, 3, n)  # mixed magnitudes
    ex = CompressedAllreduce(n)
    outs = []
    for t in range(calls):
        if not feedback:
            ex.reset_error()
        noise = torch.randn(n, generator=torch.Generator().manual_seed(10_000 + 100 * t + rank))
        outs.append(ex(base + 0.1 * noise).clone())
    return outs


def _true_mean(world: int, n: int, calls: int) -> torch.Tensor:
    total = torch.zeros(n)
    for r in range(world):
        base = torch.randn(n, generator=torch.Generator().manual_seed(r)) * torch.linspace(
            0.01, 3, n
        )
        for t in range(calls):
            noise = torch.randn(n, generator=torch.Generator().manual_seed(10_000 + 100 * t + r))
            total += base + 0.1 * noise
    return total / (world * calls)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_error_feedback_makes_the_running_mean_converge(world: int) -> None:
    n, calls = 4096, 50
    truth = _true_mean(world, n, calls)
    rel = {}
    for feedback in (True, False):
        outs = run_distributed(_error_feedback_worker, world, n, calls, feedback)
        mean = torch.stack(outs[0]).mean(0)
        rel[feedback] = float((mean - truth).norm() / truth.norm())
    print(
        f"W={world}: running-mean relative error after {calls} calls: "
        f"with error feedback {rel[True]:.4f}, without {rel[False]:.4f}"
    )
    # with error feedback the running-mean error shrinks like 1/calls (0.09 here after 50);
    # without it the 1-bit bias stays (about 0.9, whatever the number of calls)
    assert rel[True] < 0.15
    assert rel[False] > 0.5
    assert rel[False] > 5 * rel[True]


def _bytes_worker(rank: int, world: int, n: int) -> dict:
    """Count what actually goes through the collectives by wrapping them."""
    import lightning_onebit.comm.flat as comm

    counted = {"a2a": 0, "gather": 0}
    real_a2a, real_gather = comm.dist.all_to_all_single, comm.all_gather_single

    def a2a(out, inp, *a, **k):  # pairwise exchange: this rank sends all blocks but its own
        counted["a2a"] += inp.numel() * inp.element_size() * (world - 1) // world
        return real_a2a(out, inp, *a, **k)

    def gather(out, inp, *a, **k):  # ring all_gather: this rank forwards W - 1 blocks
        counted["gather"] += inp.numel() * inp.element_size() * (world - 1)
        return real_gather(out, inp, *a, **k)

    comm.dist.all_to_all_single, comm.all_gather_single = a2a, gather
    try:
        ex = CompressedAllreduce(n)
        ex(torch.randn(n))
    finally:
        comm.dist.all_to_all_single, comm.all_gather_single = real_a2a, real_gather
    return {
        "counted": counted["a2a"] + counted["gather"],
        "reported": ex.bytes_sent,
        "n_pad": ex.padded_numel,
        "fp32": ex.fp32_allreduce_bytes,
    }


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_bytes_sent_match_formula_and_are_32x_below_fp32(world: int) -> None:
    n = 10**6 + 3
    res = run_distributed(_bytes_worker, world, n)
    for r in res:
        assert r["reported"] == r["counted"], (
            "reported bytes differ from what went through the collectives"
        )
        formula = 2 * (world - 1) / world * r["n_pad"] / 8 + 2 * (world - 1) * 4  # bits + scales
        assert abs(r["reported"] - formula) / formula < 0.02
        assert r["fp32"] == fp32_allreduce_bytes(n, world)
        print(
            f"W={world}: {r['reported']:,} bytes/call vs fp32 ring {r['fp32']:,}: {r['fp32'] / r['reported']:.1f}x less"
        )
        assert r["fp32"] / r["reported"] >= 30


def _state_worker(rank: int, world: int) -> bool:
    n = 1000
    a = CompressedAllreduce(n)
    for t in range(3):
        a(_inputs(rank, t, n))
    b = CompressedAllreduce(n)
    b.load_state_dict(a.state_dict())
    # both continue identically from the same error state
    return all(
        torch.equal(a(_inputs(rank, t, n)), b(_inputs(rank, t, n)).clone()) for t in range(3, 5)
    )


@pytest.mark.slow
def test_state_dict_round_trip_distributed() -> None:
    assert all(run_distributed(_state_worker, 2))


# --------------------------------------------------------------------------- single process


@pytest.mark.parametrize("n", SIZES)
def test_single_process_runs_the_same_math_without_communication(n: int) -> None:
    assert not dist.is_initialized()
    ex, sim = CompressedAllreduce(n), Simulation(n, 1)
    for t in range(3):
        x = _inputs(0, t, n)
        got = ex(x)
        torch.testing.assert_close(got, sim([x]), rtol=1e-6, atol=1e-7)
        assert ex.bytes_sent == 0
        assert ex.padded_numel % 8 == 0 and ex.padded_numel - n < 8


def test_out_argument_and_inplace() -> None:
    x = torch.randn(3, 100)
    a, b = CompressedAllreduce(300), CompressedAllreduce(300)
    expect = a(x).clone()
    y = x.clone()
    res = b(y, out=y)
    assert res.data_ptr() == y.data_ptr() and res.shape == x.shape
    assert torch.equal(y, expect)


def test_reset_and_state_dict() -> None:
    ex = CompressedAllreduce(50)
    ex(torch.randn(50))
    assert ex.worker_error.abs().sum() > 0
    sd = ex.state_dict()
    sd["server_error"].fill_(0.5)  # with W = 1 the server error stays 0: |c| = s everywhere
    ex.load_state_dict(sd)
    assert torch.equal(ex.server_error, sd["server_error"])
    ex.reset_error()
    assert ex.worker_error.abs().sum() == 0 and ex.server_error.abs().sum() == 0
    ex.load_state_dict(sd)
    assert torch.equal(ex.worker_error, sd["worker_error"])
    with pytest.raises(ValueError, match="world_size"):
        CompressedAllreduce(51).load_state_dict(sd)


@pytest.mark.parametrize(
    ("arg", "exc", "match"),
    [
        (torch.zeros(10, dtype=torch.float64), TypeError, "float32"),
        (torch.zeros(11), ValueError, "built for 10 values"),
        ([0.0] * 10, TypeError, "torch.Tensor"),
        (torch.zeros(10, device="meta"), ValueError, "buffers are on cpu"),
    ],
)
def test_bad_input_is_rejected(arg, exc, match) -> None:
    with pytest.raises(exc, match=match):
        CompressedAllreduce(10)(arg)


@pytest.mark.parametrize("numel", [0, -3, 2.5, True])
def test_bad_numel_is_rejected(numel) -> None:
    with pytest.raises(ValueError, match="positive int"):
        CompressedAllreduce(numel)


def _double_buffered_worker(rank: int, world: int) -> dict:
    gen = torch.Generator().manual_seed(10 + rank)
    xs = [torch.randn(3001, generator=gen) for _ in range(6)]
    xs[3][7] = float("inf") if rank == world - 1 else xs[3][7]
    plain = CompressedAllreduce(3001)
    double = CompressedAllreduce(3001, double_buffered=True)
    finite, same = [], []
    for k, x in enumerate(xs):
        if k == 3:  # non-finite on the last rank: the plain one would raise; skip it there
            h = double.start(x, commit=False)
            finite.append(h.finite)
            h.discard()
            continue
        if k == 1:  # dropped on purpose although finite: nothing may change
            before = double.state_dict()
            h = double.start(x, commit=False)
            finite.append(h.finite)
            h.wait()
            h.discard()
            after = double.state_dict()
            same.append(
                all(torch.equal(before[n], after[n]) for n in ("worker_error", "server_error"))
            )
            continue
        h = double.start(x, commit=False)
        finite.append(h.finite)
        h.commit()
        same.append(torch.equal(h.wait(), plain(x)))
    # the double-buffered exchange defers the worker's error update, the plain one does not
    same.append(torch.equal(double.worker_error, plain.worker_error))
    same.append(torch.equal(double.server_error, plain.server_error))
    return {"finite": finite, "same": same}


def test_double_buffered_commit_and_discard() -> None:
    """commit=False + commit() is bitwise the plain exchange, error buffers included (the
    double-buffered one defers the worker's error update to the next call, the plain one
    updates it after the verdict); discard() (finite or not) leaves the error buffers as they
    were, so the next calls continue as if the dropped one never happened."""
    for rank, r in enumerate(run_distributed(_double_buffered_worker, 3)):
        assert r["finite"] == [True, True, True, False, True, True], rank
        assert all(r["same"]) and len(r["same"]) == 7, (rank, r["same"])
    with pytest.raises(ValueError, match="double_buffered=True"):
        CompressedAllreduce(8).start(torch.zeros(8), commit=False)
    ex = CompressedAllreduce(8, double_buffered=True)
    ex.start(torch.ones(8), commit=False)
    with pytest.raises(RuntimeError, match="neither committed nor discarded"):
        ex.start(torch.ones(8))


def _source_worker(rank: int, world: int) -> dict:
    """Four calls of three exchanges fed the same momentum: a MomentumSource prepared on
    another thread then started here, the same source started directly, and the values
    computed into a buffer first (the plain exchange too, which materializes)."""
    import threading

    from lightning_onebit import kernels

    gen = torch.Generator().manual_seed(20 + rank)
    sizes = [5, 1000, 37, 2003]
    n = sum(sizes)
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    m, v = torch.randn(n, generator=gen), torch.rand(n, generator=gen) + 0.5
    d = kernels.Denominator(v, [1e-8] * len(sizes))  # (sqrt(v) + eps, computed as read)
    beta, alpha = [0.9, 0.8, 0.95, 0.9], [0.1, 0.2, 0.05, 0.1]
    exchanges = [CompressedAllreduce(n, double_buffered=True) for _ in range(3)]
    plain, buf = CompressedAllreduce(n), torch.empty(n)
    same, prepared_kinds = [], []
    for _ in range(4):
        grads = [torch.randn(z, generator=gen) for z in sizes]
        src = kernels.MomentumSource(m, grads, d, torch.empty(n), starts, sizes, beta, alpha)
        box: list = []
        t = threading.Thread(
            target=lambda s=src, b=box: b.append(exchanges[0].prepare(s, commit=False))
        )
        t.start()
        t.join()
        prepared_kinds.append(type(box[0]).__name__)
        results = []
        for ex, x in zip(exchanges, (box[0], src, None), strict=True):
            if x is None:
                kernels.momentum_source(m, grads, d, buf, starts, sizes, beta, alpha)
                x = buf
            h = ex.start(x, commit=False)
            h.commit()
            results.append(h.wait().clone())
        results.append(
            plain(kernels.MomentumSource(m, grads, d, torch.empty(n), starts, sizes, beta, alpha))
        )
        same.append(all(torch.equal(r, results[0]) for r in results[1:]))
    return {"same": same, "kinds": prepared_kinds}


def test_a_momentum_source_is_exchanged_as_its_values() -> None:
    """An exchange of a MomentumSource (compressed as it is read on the CPU, after prepare()
    on another thread or in start()) gives what the exchange of its values in a buffer gives,
    bit for bit, call after call (error feedback), on real gloo groups."""
    for rank, r in enumerate(run_distributed(_source_worker, 2)):
        assert r["same"] == [True] * 4, rank
        assert r["kinds"] == ["Compressed"] * 4, rank
    ex = CompressedAllreduce(8, double_buffered=True)
    token = ex.prepare(torch.ones(8))
    assert isinstance(token, torch.Tensor)  # (a tensor: nothing to read early)
    from lightning_onebit.kernels import MomentumSource

    z = torch.zeros(8)
    prepared = ex.prepare(MomentumSource(z, [z], None, z.clone(), [0], [8], [0.9], [0.1]))
    with pytest.raises(ValueError, match="same commit"):
        ex.start(prepared, commit=False)
    with pytest.raises(ValueError, match="built for 8 values"):
        ex.start(MomentumSource(z, [z[:4]], None, z.clone(), [0], [4], [0.9], [0.1]))


def _one_worker_set_worker(rank: int, world: int) -> dict:
    """Six calls of a MomentumSource (and of its values as a tensor) through an exchange that
    keeps one worker error buffer (``recompute_error``) and its two-set twin, started with
    ``commit=False`` then committed or discarded (one call non-finite on the last rank, one
    dropped although finite), next to the plain exchange (one set, committed in start()):
    whether results and error buffers agree bit for bit after every call."""
    from lightning_onebit import kernels

    gen = torch.Generator().manual_seed(30 + rank)
    sizes = [5, 1000, 37, 2003]
    n = sum(sizes)
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    m, v = torch.randn(n, generator=gen), torch.rand(n, generator=gen) + 0.5
    d = kernels.Denominator(v, [1e-8] * len(sizes))  # (sqrt(v) + eps, computed as read)
    beta, alpha = [0.9, 0.8, 0.95, 0.9], [0.1, 0.2, 0.05, 0.1]
    one = CompressedAllreduce(n, double_buffered=True, recompute_error=True)
    two = CompressedAllreduce(n, double_buffered=True)
    plain, buf = CompressedAllreduce(n), torch.empty(n)
    as_tensor = CompressedAllreduce(n, double_buffered=True, recompute_error=True)
    same, finite = [], []
    for k in range(6):
        grads = [torch.randn(z, generator=gen) for z in sizes]
        if k == 3 and rank == world - 1:
            grads[1][5] = float("nan")
        src = kernels.MomentumSource(m, grads, d, lambda: buf, starts, sizes, beta, alpha)
        kernels.momentum_source(m, grads, d, buf, starts, sizes, beta, alpha)
        x = buf.clone()
        handles = [ex.start(v, commit=False) for ex, v in ((one, src), (two, src), (as_tensor, x))]
        finite.append(all(h.finite for h in handles))
        if k in (1, 3):
            for h in handles:
                h.discard()
        else:
            for h in handles:
                h.commit()
            want = plain(x).clone()
            same += [torch.equal(h.wait(), want) for h in handles]
        same += [_same_exchange(buf, buf, two, ex) for ex in (one, as_tensor)]
        if k not in (1, 3):
            same.append(_same_exchange(buf, buf, plain, one))
    return {"same": same, "finite": finite}


def test_one_worker_error_buffer_gives_the_two_buffer_results() -> None:
    """recompute_error=True (one worker and one server error buffer, updated at the commit: the
    input read again or recomputed as read, the server stage run again) gives the two-set
    exchange's results and error buffers bit for bit, committed or discarded (finite or not),
    from a MomentumSource and from a tensor, on real gloo groups (W = 3)."""
    for rank, r in enumerate(run_distributed(_one_worker_set_worker, 3)):
        assert r["finite"] == [True, True, True, False, True, True], rank
        assert all(r["same"]) and len(r["same"]) == 4 * 3 + 6 * 2 + 4, (rank, r["same"])
    with pytest.raises(ValueError, match="device_verdict"):
        CompressedAllreduce(8, recompute_error=True, device_verdict=True)


def test_an_input_edited_before_the_commit_is_refused() -> None:
    """A source whose gradient changes between its compression and the commit (as a gradient
    clipping between backward and step() would, with the exchange overlapping backward) makes
    the commit raise, naming the cause, rather than keep an error update of other values."""
    from lightning_onebit.kernels import MomentumSource

    n = 4096
    m, g = torch.randn(n), torch.randn(n)
    ex = CompressedAllreduce(n, double_buffered=True, recompute_error=True)
    h = ex.start(MomentumSource(m, [g], None, torch.empty(n), [0], [n], [0.9], [0.1]), commit=False)
    g.mul_(0.5)  # clipped after the compression
    with pytest.raises(RuntimeError, match="changed between its compression and its error update"):
        h.commit()


def _runs_worker(rank: int, world: int) -> dict:
    """Three calls each of a flat and a bucketed exchange with ``out=None`` (undecoded), next to twins
    that decode: the runs' values against the twins' outputs, and whether ``out`` stayed."""
    from lightning_onebit.comm import BucketedAllreduce
    from lightning_onebit.kernels import TensorSource, decode_runs

    n, bounds = 10_003, [(6_001, 10_003), (0, 13), (13, 6_001)]
    pairs = [
        (CompressedAllreduce(n), CompressedAllreduce(n)),
        (BucketedAllreduce(bounds), BucketedAllreduce(bounds)),
    ]
    same, untouched = [], []
    for t in range(3):
        x = _inputs(rank, t, n)
        for direct, twin in pairs:
            want, out = torch.empty(n), torch.full((n,), 7.0)
            assert twin.finish([TensorSource(x[lo:hi]) for lo, hi in twin.pending()], want) is None
            runs = direct.finish([TensorSource(x[lo:hi]) for lo, hi in direct.pending()], None)
            same.append(torch.equal(decode_runs(runs, torch.empty(n)), want))
            untouched.append(bool(out.eq(7.0).all()))
    return {"same": same, "untouched": untouched}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_an_undecoded_result_holds_the_decoded_values(world: int) -> None:
    """``finish(sources, None)`` on the CPU returns SignRuns whose values are what the
    decoded call writes, bit for bit, call after call, flat and in buckets (exchanged out of
    layout order), and leaves ``out`` as it was."""
    for rank, r in enumerate(run_distributed(_runs_worker, world)):
        assert r["same"] == [True] * 6, rank
        assert r["untouched"] == [True] * 6, rank


def _state_tensors(state: dict) -> list[torch.Tensor]:
    """Every tensor of an exchange's ``state_dict`` (its error buffers), in order."""
    found = []
    for v in state.values():
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, dict):
            found += _state_tensors(v)
        elif isinstance(v, list):
            found += [t for s in v if isinstance(s, dict) for t in _state_tensors(s)]
    return found


def _same_exchange(a: torch.Tensor, b: torch.Tensor, ea: object, eb: object) -> bool:
    """Results ``a``, ``b`` and the error buffers of exchanges ``ea``, ``eb``: bit for bit."""
    bufs = zip(_state_tensors(ea.state_dict()), _state_tensors(eb.state_dict()), strict=True)
    return torch.equal(a.view(torch.int32), b.view(torch.int32)) and all(
        torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in bufs
    )


def _tensor_source_worker(rank: int, world: int) -> dict:
    """Three calls of each exchange kind, one fed the tensor, its twin a TensorSource of it:
    whether the results and the error buffers agree bit for bit, per kind and call."""
    from lightning_onebit.comm import BucketedAllreduce
    from lightning_onebit.kernels import TensorSource

    n, bounds = 1003, [(500, 1003), (0, 13), (13, 500)]
    kinds = {
        "single": lambda: CompressedAllreduce(n),
        "double": lambda: CompressedAllreduce(n, double_buffered=True),
        "prepared": lambda: CompressedAllreduce(n, double_buffered=True),
        "finish": lambda: CompressedAllreduce(n, double_buffered=True),
        "bucketed": lambda: BucketedAllreduce(bounds),
    }
    same: dict[str, list[bool]] = {}
    for kind, make in kinds.items():
        plain, twin = make(), make()
        for t in range(3):
            x = _inputs(rank, t, n)
            src = TensorSource(x.clone())
            if kind == "single":
                a, b = plain(x).clone(), twin.start(src).wait().clone()
            elif kind in ("double", "prepared"):
                h = plain.start(x, commit=False)
                h.commit()
                a = h.wait().clone()
                g = twin.start(twin.prepare(src, commit=False) if kind == "prepared" else src,
                               commit=False)  # fmt: skip
                g.commit()
                b = g.wait().clone()
            else:
                a, b = torch.empty(n), torch.empty(n)
                plain.finish([x[lo:hi] for lo, hi in plain.pending()], a)
                twin.finish([TensorSource(src.tensor[lo:hi]) for lo, hi in twin.pending()], b)
            same.setdefault(kind, []).append(_same_exchange(a, b, plain, twin))
    return same


@pytest.mark.parametrize("world", [1, 2])
def test_a_tensor_source_is_exchanged_as_its_tensor(world: int) -> None:
    """A TensorSource through the flat exchange (one set of error buffers and two, started
    directly, after prepare() and through finish()) and the bucketed one gives the result and
    the error buffers of the tensor itself, bit for bit, call after call."""
    for rank, r in enumerate(run_distributed(_tensor_source_worker, world)):
        assert all(r[kind] == [True] * 3 for kind in r), (rank, r)


def test_a_tensor_source_is_its_tensor() -> None:
    """The tensor itself, no copy: nothing computed as it is read; flat float32 only."""
    from lightning_onebit.kernels import ExchangeSource, TensorSource

    x = torch.randn(24)
    src = TensorSource(x)
    assert isinstance(src, ExchangeSource) and not src.computed_as_read
    assert src.materialize() is x and src.tensor is x
    assert (src.numel(), src.shape, src.device) == (24, torch.Size([24]), x.device)
    with pytest.raises(TypeError, match="float32"):
        TensorSource(x.double())
    with pytest.raises(ValueError, match="flat, contiguous, non-empty"):
        TensorSource(x.view(4, 6))
    with pytest.raises(ValueError, match="flat, contiguous, non-empty"):
        TensorSource(x[::2])
    with pytest.raises(ValueError, match="built for 8 values"):
        CompressedAllreduce(8).start(src)
