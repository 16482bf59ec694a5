"""Timing collectives and calls across ranks: the slowest rank's medians, the links fitted as
``time = latency + wire bytes / bandwidth``, the buckets of a flat buffer, and the expected
slowest call of ranks that start together."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "FIRST_BUCKET_BYTES",
    "Link",
    "buckets",
    "expected_slowest",
    "fit_link",
    "max_over_ranks",
    "measure_link",
    "paired",
    "slowest_of_free_running",
    "sync",
    "timed",
]

#: The first bucket's size (DDP's and the 1-bit overlap's first bucket cap).
FIRST_BUCKET_BYTES = 2**20


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``fn`` until the slowest rank has finished (barriers before and after
    each call), the largest of the ranks' medians, on every rank."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync(device)
        dist.barrier()  # the slowest rank's time
        times.append(time.perf_counter() - t0)
    return max_over_ranks(statistics.median(times))


def max_over_ranks(x: float) -> float:
    """The largest of every rank's ``x``, on every rank (a collective: every rank calls it)."""
    t = torch.tensor([x], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _ring_wire_bytes(nbytes: int, group_size: int) -> int:
    return 2 * (group_size - 1) * nbytes // group_size


@dataclass
class Link:
    """One kind of link: ``time = latency + wire bytes / bandwidth`` fitted to timed
    ``all_reduce`` calls (``points``: bytes per call, seconds)."""

    ranks: int
    latency_s: float
    bandwidth_Bps: float
    points: list[tuple[int, float]] = field(default_factory=list)

    def time(self, wire_bytes: float, calls: int = 1) -> float:
        """Predicted seconds of ``calls`` calls sending ``wire_bytes`` in all."""
        return calls * self.latency_s + wire_bytes / self.bandwidth_Bps


def fit_link(points: list[tuple[int, float]], group_size: int) -> Link:
    """Latency: the smallest call's time; bandwidth: the least-squares slope of time over
    wire bytes of the calls of >= 256 KiB (where the bytes, not the round trips, dominate)."""
    lat = min(t for _, t in points)
    big = [(_ring_wire_bytes(b, group_size), t) for b, t in points if b >= 2**18]
    if len(big) >= 2:
        mx = statistics.fmean(x for x, _ in big)
        my = statistics.fmean(y for _, y in big)
        sxx = sum((x - mx) ** 2 for x, _ in big)
        slope = sum((x - mx) * (y - my) for x, y in big) / sxx if sxx else 0.0
    else:
        slope = 0.0
    if slope <= 0:  # too few points, or noise: the largest call alone
        x, y = max((_ring_wire_bytes(b, group_size), t) for b, t in points)
        slope = max(y - lat, 1e-9) / max(x, 1)
    return Link(group_size, lat, 1.0 / slope, points)


def measure_link(
    group: Any, member: bool, group_size: int, device: torch.device, max_s: float, max_bytes: int
) -> Link:
    """Timed ``all_reduce`` on ``group`` (``member``: this rank takes part; the others wait at
    the barriers) from 4 KiB up, x4 each time, until a call takes ``max_s`` or ``max_bytes``."""
    points, nbytes = [], 4096
    while True:
        buf = torch.ones(nbytes // 4, device=device)
        reps = 5 if nbytes < 2**20 else 3

        def call(buf: torch.Tensor = buf) -> None:
            if member:
                dist.all_reduce(buf, group=group)

        t = timed(call, device, reps)
        points.append((nbytes, t))
        if t >= max_s or nbytes * 4 > max_bytes:
            break
        nbytes *= 4
    return fit_link(points, group_size)


def buckets(nbytes: int, cap_mb: float) -> list[int]:
    """Bucket sizes in the order backward completes them: the first (last layers) at most
    1 MiB, then ``cap_mb`` each, the remainder last (the strategies' and DDP's layout)."""
    out = [min(FIRST_BUCKET_BYTES, nbytes)]
    rest, cap = nbytes - out[0], max(int(cap_mb * 2**20), 4)
    while rest > 0:
        out.append(min(cap, rest))
        rest -= out[-1]
    return out


def expected_slowest(times: torch.Tensor) -> float:
    """The expected largest of one value drawn from each row of ``times`` (ranks x samples),
    each row's uniformly and independently: the compute time of a step whose ranks start
    together and wait for the slowest, from each rank's own call times. Exact, not sampled:
    ``P(max <= t)`` is the product over the rows of the fraction of the row ``<= t``.

    Args:
        times: one row per rank, one column per timed call (seconds; any real dtype).

    Returns:
        The expectation, in the unit of ``times``.
    """
    times = times.to(torch.float64)
    values = times.flatten().unique(sorted=True)
    cdf = torch.ones_like(values)
    for row in times:
        cdf *= (row[None, :] <= values[:, None]).to(torch.float64).mean(1)
    pmf = torch.diff(cdf, prepend=cdf.new_zeros(1))
    return float((values * pmf).sum())


def slowest_of_free_running(fn: Callable[[], None], device: torch.device, steps: int) -> float:
    """The expected time of the slowest rank's call when every call starts the ranks together,
    as the exchange of every training step does, from ``steps`` calls run freely in a row
    (``expected_slowest`` of every rank's call times).

    Timed in lockstep (a barrier around each call) the estimate would carry the barriers and
    whatever else the machine did in those few calls; run freely, each rank times its own calls
    and the ranks meet only before and after. The expectation charges a rank that is slower on
    average and the spread of the calls (with more ranks than free cores, or a straggler, some
    rank lags on every step)."""
    fn()
    sync(device)
    dist.barrier()
    own = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        own.append(time.perf_counter() - t0)
    dist.barrier()
    times = torch.tensor(own, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        times = times.cuda()
    every = [torch.empty_like(times) for _ in range(dist.get_world_size())]
    dist.all_gather(every, times)
    return expected_slowest(torch.stack(every).cpu())


def paired(
    compute: Callable[[], None],
    fns: dict[str, Callable[[], None]],
    device: torch.device,
    repeats: int,
    warmup: int = 1,
) -> tuple[float, dict[str, float]]:
    """The compute's time and each function's time beyond it: every round runs the compute
    and then each function, each right after a compute run, and a function's excess is the
    median of its differences from the compute run just before it (on a shared machine a slow
    spell lands on both of a pair; the difference is what the communication adds)."""
    base: list[float] = []
    excess: dict[str, list[float]] = {k: [] for k in fns}

    def once(fn: Callable[[], None]) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync(device)
        dist.barrier()  # the slowest rank's time, as a training step's
        return max_over_ranks(time.perf_counter() - t0)

    for r in range(warmup + repeats):
        for k, fn in fns.items():
            c = once(compute)
            t = once(fn)
            if r >= warmup:
                base.append(c)
                excess[k].append(t - c)
    return statistics.median(base), {k: statistics.median(v) for k, v in excess.items()}
