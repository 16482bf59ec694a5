"""The integer-coded average (``comm.QuantizedAllreduce``) on real gloo groups: against a float64
reference of its arithmetic, error feedback included, on fresh random inputs; the same result on
every rank; a NaN on one rank stops every rank with the error buffers unchanged; bytes; state."""

from __future__ import annotations

import pytest
import torch

from lightning_onebit import kernels
from lightning_onebit.comm import NonFiniteError, QuantizedAllreduce
from tests.helpers.dist import run_distributed


def _inputs(rank: int, call: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + call)
    return torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 2)


SEGMENTS = [1000, 3, 130, 1868]  # 3001 values: tensors that start blocks of their own


def _places(n: int, segments: list[int] | None, block: int) -> list[tuple[int, int, int]]:
    """(offset in the input, offset in the exchange's layout, size) per segment."""
    out, src, dst = [], 0, 0
    for k in segments or [n]:
        out.append((src, dst, k))
        src, dst = src + k, dst + -(-k // block) * block
    return out


def _average_worker(
    rank: int, world: int, n: int, calls: int, bits: int, block: int, segments: list[int] | None
) -> dict:
    ex = QuantizedAllreduce(n, bits=bits, block=block, segments=segments)
    outs = [ex(_inputs(rank, t, n)).clone() for t in range(calls)]
    return {
        "outs": outs,
        "worker_error": ex.worker_error.clone(),
        "server_error": ex.server_error.clone(),
        "bytes": ex.bytes_sent,
        "per_call": ex.bytes_per_call,
        "fp32": ex.fp32_allreduce_bytes,
    }


def _reference(
    world: int, n: int, calls: int, bits: int, block: int, segments: list[int] | None
) -> list[torch.Tensor]:
    """The algorithm in float64 where it adds and averages, the codec's float32 encoding where
    it rounds (kernels' torch twins): what every rank must return."""
    places = _places(n, segments, block)
    aligned = places[-1][1] + -(-places[-1][2] // block) * block
    npad = -(-aligned // (world * block)) * world * block
    m = npad // world
    ew = [torch.zeros(npad, dtype=torch.float64) for _ in range(world)]
    es = [torch.zeros(m, dtype=torch.float64) for _ in range(world)]

    def encode(y: torch.Tensor) -> torch.Tensor:  # its decoded values
        rows = torch.zeros(1, kernels.row_bytes(y.numel(), bits, block), dtype=torch.uint8)
        kernels.reference_quantize(y.float(), None, rows, bits=bits, block=block, n=y.numel())
        out = torch.empty(y.numel())
        kernels.reference_dequantize(rows, out, m=y.numel(), bits=bits, block=block)
        return out.double()

    outs = []
    for t in range(calls):
        dec = []
        for r in range(world):
            y, x = ew[r].clone(), _inputs(r, t, n).double()
            for src, dst, k in places:
                y[dst : dst + k] += x[src : src + k]
            d = torch.cat([encode(y[j * m : (j + 1) * m]) for j in range(world)])
            ew[r] = y - d
            dec.append(d)
        out = []
        for j in range(world):
            c = sum(d[j * m : (j + 1) * m] for d in dec) / world + es[j]
            x = encode(c)
            es[j] = c - x
            out.append(x)
        whole = torch.cat(out)
        outs.append(torch.cat([whole[dst : dst + k] for _, dst, k in places]))
    return outs


@pytest.mark.parametrize(
    ("world", "bits", "segments"),
    [(2, 4, None), (3, 8, None), (3, 4, None), (2, 4, SEGMENTS), (3, 8, SEGMENTS)],
)
def test_the_average_is_its_arithmetic_with_error_feedback(
    world: int, bits: int, segments: list[int] | None
) -> None:
    n, calls, block = 3001, 4, 64
    results = run_distributed(_average_worker, world, n, calls, bits, block, segments)
    want = _reference(world, n, calls, bits, block, segments)
    for r in results:
        for t in range(calls):
            assert torch.equal(r["outs"][t], results[0]["outs"][t])  # every rank the same
            scale = float(want[t].abs().max())
            # the server averages in float32, the reference in float64: a mean that falls on a
            # rounding boundary may come out one code apart (and its error the other way)
            diff = (r["outs"][t].double() - want[t]).abs()
            apart = diff > 2e-6 * scale
            assert int(apart.sum()) <= 2, f"{int(apart.sum())} values differ at call {t}"
            assert float(diff.max()) <= 1.01 * scale / (7 if bits == 4 else 127)
    # error feedback: what was averaged and what came out differ by the errors left, nothing else
    sent = sum(_inputs(r, t, n).double() for r in range(world) for t in range(calls)) / world
    got = sum(results[0]["outs"][t].double() for t in range(calls))
    left_all = sum(r["worker_error"].double() for r in results) / world
    left_all += torch.cat([r["server_error"].double() for r in results])
    left = torch.cat([left_all[dst : dst + k] for _, dst, k in _places(n, segments, block)])
    torch.testing.assert_close(got + left, sent, rtol=0, atol=1e-5 * float(sent.abs().max()))
    # bytes: 2 (W - 1) records of [flag][scales][codes]
    m = results[0]["server_error"].numel()
    record = 4 + kernels.row_bytes(m, bits, block)
    assert results[0]["bytes"] == results[0]["per_call"] == 2 * (world - 1) * record
    assert results[0]["fp32"] / results[0]["bytes"] > (6.0 if bits == 4 else 3.3)


def test_a_small_tensor_next_to_a_large_one_keeps_its_values() -> None:
    # a LayerNorm's gradients (1e-4) next to a weight matrix's (1): in blocks of their own
    sizes = [128, 4096, 128]
    gen = torch.Generator().manual_seed(7)
    x = torch.cat(
        [torch.randn(k, generator=gen) * s for k, s in zip(sizes, [1e-4, 1, 1e-4], strict=True)]
    )
    mixed = QuantizedAllreduce(x.numel(), block=256)(x)
    own = QuantizedAllreduce(x.numel(), block=256, segments=sizes)(x)
    for got, want, k in zip(own.split(sizes), x.split(sizes), sizes, strict=True):
        assert float((got - want).norm() / want.norm()) < 0.2, k  # 4 bits: ~0.13
    assert torch.equal(mixed[:128], torch.zeros(128))  # one block with the large: rounded away
    with pytest.raises(ValueError, match="sum to numel"):
        QuantizedAllreduce(x.numel(), segments=[128, 4096])


def _non_finite_worker(rank: int, world: int) -> dict:
    n = 1000
    ex = QuantizedAllreduce(n, bits=4, block=64)
    ex(_inputs(rank, 0, n))
    before = (ex.worker_error.clone(), ex.server_error.clone())
    x = _inputs(rank, 1, n)
    if rank == world - 1:
        x[123] = float("nan")
    try:
        ex(x)
        raised = ""
    except NonFiniteError as err:
        raised = str(err)
    same = torch.equal(before[0], ex.worker_error) and torch.equal(before[1], ex.server_error)
    after = ex(_inputs(rank, 2, n)).clone()  # the exchange goes on
    return {"raised": raised, "same": same, "after": after}


def test_a_nan_on_one_rank_stops_every_rank_with_the_errors_unchanged() -> None:
    results = run_distributed(_non_finite_worker, 3)
    for r in results:
        assert "rank(s) [2]" in r["raised"] and r["same"]
        assert torch.equal(r["after"], results[0]["after"])


def test_one_rank_encodes_and_keeps_its_error_and_state_round_trips() -> None:
    n = 700
    ex, twin = QuantizedAllreduce(n, bits=8, block=128), QuantizedAllreduce(n, bits=8, block=128)
    for t in range(3):
        x = _inputs(0, t, n)
        out = ex(x)
        torch.testing.assert_close(
            out.double() + ex.worker_error[:n].double(),
            x.double() + (twin.worker_error[:n].double() if t else 0.0),
            rtol=0,
            atol=1e-6 * float(x.abs().max()),
        )
        twin.load_state_dict(ex.state_dict())
    assert ex.bytes_sent == 0
    with pytest.raises(ValueError, match="use reset_error"):
        QuantizedAllreduce(n, bits=4, block=128).load_state_dict(ex.state_dict())
    ex.reset_error()
    assert not ex.worker_error.any()
    with pytest.raises(ValueError, match="contiguous float32"):
        ex(torch.zeros(n, dtype=torch.float64))


def _split_worker(rank: int, world: int) -> dict:
    """Two exchanges (the buckets of one average) started one after the other, then committed
    or discarded together, next to the same two averaged whole in calls."""
    sizes = [[700, 4], [1500, 33]]
    started = [QuantizedAllreduce(sum(s), bits=4, segments=s) for s in sizes]
    whole = [QuantizedAllreduce(sum(s), bits=4, segments=s) for s in sizes]
    outs, kept = [], []
    for t in range(4):
        xs = [_inputs(rank, 10 * t + k, sum(s)) for k, s in enumerate(sizes)]
        if t == 2 and rank == 1:
            xs[1][5] = float("inf")  # the second bucket of this call: neither goes through
        before = [ex.worker_error.clone() for ex in started]
        for ex, x in zip(started, xs, strict=True):
            torch._foreach_copy_(ex.segment_views(), list(x.split(ex.sizes)))
        finite = [ex.start_in_place() is None for ex in started]
        if all(finite):
            for ex in started:
                ex.commit()
            outs.append([torch.cat(ex.segment_views()).clone() for ex in started])
            outs.append([ex(x) for ex, x in zip(whole, xs, strict=True)])
        else:
            for ex in started:
                ex.discard()
            kept.append(
                [torch.equal(b, ex.worker_error) for b, ex in zip(before, started, strict=True)]
            )
            inputs = [torch.cat(ex.segment_views()) for ex in started]
            kept.append([torch.equal(a, x) for a, x in zip(inputs, xs, strict=True)])
            finite_seen = finite
    return {"outs": outs, "kept": kept, "finite": finite_seen}


def test_averages_started_apart_go_through_together_or_not_at_all() -> None:
    for r in run_distributed(_split_worker, 2):
        assert r["finite"] == [True, False]  # the same verdict on every rank
        assert r["kept"] == [[True, True], [True, True]]  # errors as they were; inputs kept
        for split, whole in zip(r["outs"][::2], r["outs"][1::2], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(split, whole, strict=True))
