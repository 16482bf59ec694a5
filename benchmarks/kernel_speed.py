"""Micro-benchmark of the fused kernels against the pure-torch reference and a plain copy.

    python benchmarks/kernel_speed.py [--n 25000000] [--world 4] [--repeat 15] [--threads T]
    python benchmarks/kernel_speed.py --device cuda      # the CUDA kernels (adam/lamb: torch ops there)
    python benchmarks/kernel_speed.py --only decompress  # the kernels whose name matches

For each kernel it prints the median time, GB/s of input, and the fraction of the memory-traffic
floor: the fewest bytes the kernel must read and write, divided by the bandwidth of a plain
fp32 copy of the same buffer measured in the same run (copy moves 8 bytes per value).
A ratio of 1.0x means the kernel runs at copy speed for the bytes it cannot avoid. The last
row, an fp32 fill (writes only, its floor 4 bytes per value), shows how close to that a kernel
that mostly writes (decompress) can come on the machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import time
from collections.abc import Callable

import torch

from lightning_onebit import kernels as K


def _median_seconds(fn: Callable[[], object], repeat: int, device: torch.device) -> float:
    """Median seconds per call of ``fn``.

    CPU: the median of ``repeat`` timed calls. CUDA: the device time of ``repeat`` calls issued
    back to back between two events, divided by ``repeat``; the median of five such batches. The
    calls queue up on the stream, so this is the kernels' time, not the host's launch overhead
    or a synchronisation per call.
    """
    fn()  # warm-up: page faults, thread pool start, CUDA module load
    if device.type == "cuda":
        torch.cuda.synchronize()
        per_call = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeat):
                fn()
            end.record()
            end.synchronize()
            per_call.append(start.elapsed_time(end) / 1e3 / repeat)
        return statistics.median(per_call)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=25_000_000, help="values per buffer (default 2.5e7)")
    p.add_argument("--world", type=int, default=4, help="W: chunks / ranks (default 4)")
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument(
        "--threads", type=int, default=None, help="torch/OpenMP threads (default: torch's)"
    )
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument(
        "--only", default=None, help="time only the kernels whose name matches this regex"
    )
    args = p.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not (torch.cuda.is_available() and K.HAS_CUDA):
        raise SystemExit("--device cuda needs a CUDA GPU and the extension built with CUDA")
    if args.threads:
        torch.set_num_threads(args.threads)
    w = args.world
    n = -(-args.n // (8 * w)) * 8 * w
    m = n  # the server kernel is timed on a chunk of n values too (W input rows of n / 8 bytes)
    gen = torch.Generator().manual_seed(0)

    x = torch.randn(n, generator=gen).to(dev)
    e = (torch.randn(n, generator=gen) * 0.1).to(dev)
    bits = torch.empty(w, n // (8 * w), dtype=torch.uint8, device=dev)
    dbits = torch.randint(0, 256, (w, n // (8 * w)), generator=gen, dtype=torch.uint8).to(dev)
    scale = torch.empty(1, device=dev)
    # the exchange's one-pass form: y into a second buffer, the previous call's update pending
    y, pbits = torch.empty(n, device=dev), bits.clone().random_(0, 256)
    pscale = torch.full((1,), 0.01, device=dev)
    deferred = {"deferred": True, "error_out": y, "pending": True}
    deferred.update(prev_bits=pbits, prev_scale=pscale)
    dst = torch.empty(n, device=dev)
    copy_s = _median_seconds(lambda: dst.copy_(x), args.repeat, dev)
    copy_bw = 8 * n / copy_s  # bytes moved per second (read + write)
    # write-only reference: what a kernel that mostly writes (decompress) can hope for
    fill_s = _median_seconds(lambda: dst.fill_(1.0), args.repeat, dev)

    sbits = torch.randint(0, 256, (w, m // 8), generator=gen, dtype=torch.uint8).to(dev)
    sscales = torch.rand(w, generator=gen).to(dev)
    se = (torch.randn(m, generator=gen) * 0.1).to(dev)
    sout = torch.zeros(m // 8, dtype=torch.uint8, device=dev)
    sscale = torch.zeros(
        1, device=dev
    )  # steady state: every call applies the previous deferred update
    out = torch.empty(n, device=dev)

    # 1-bit LAMB's compression-phase update: 10 layers, weight decay on
    lb = [(torch.rand(n, generator=gen) + 0.01).to(dev) for _ in range(6)]  # x, m, v, v_fresh, p, u
    lb[2] = K.Denominator(lb[2], [1e-8] * 10)  # d = sqrt(v) + eps, computed as read
    lo = [n * k // 10 for k in range(11)]
    lh = {"scaling": [1.0] * 10, "beta1": [0.9] * 10, "beta2": [0.95] * 10, "eps": [1e-8] * 10}
    lh["weight_decay"] = [0.01] * 10

    # Adam's warmup step: 10 parameters of the flat buffers g, m, v, updated in place
    ab = [(torch.rand(n, generator=gen) + 0.01).to(dev) for _ in range(3)]
    ap = [torch.rand(hi - lo_, generator=gen).to(dev) for lo_, hi in itertools.pairwise(lo)]
    ah = {"lr": [1e-4] * 10, "beta1": [0.9] * 10, "beta2": [0.95] * 10, "eps": [1e-8] * 10}
    ah["weight_decay"] = [0.01] * 10

    # The exchange's source (1-bit Adam's momentum over 10 parameters, gradients of their own),
    # and that source compressed as it is read; the momentum_source and worker_deferred rows
    # together are the same work with the source written to a buffer and read back
    sm, sv, su = (torch.randn(n, generator=gen).to(dev) for _ in range(3))
    sg = [torch.randn(hi - lo_, generator=gen).to(dev) for lo_, hi in itertools.pairwise(lo)]
    sd = K.Denominator(sv.abs_(), [1e-8] * 10)  # the preconditioned form: d from v as read
    src = (sm, sg, sd, su, lo[:-1], [hi - lo_ for lo_, hi in itertools.pairwise(lo)])
    coef = ([0.9] * 10, [0.1] * 10)

    # The integer codec at 4 bits, blocks of 256 (the warmup's average): the worker's quantize of
    # x + e (error in place), the server's reduce of W rows of a chunk of nq values (as the server
    # kernel above), and the decoding of W rows of nq / W values
    qb = 256
    nq = -(-n // (qb * w)) * qb * w
    qe = torch.zeros(nq, device=dev)
    qe[:n] = e
    qrows = torch.zeros(w, K.row_bytes(nq // w, 4, qb), dtype=torch.uint8, device=dev)
    K.quantize(x, qe.clone(), qrows, bits=4, block=qb)
    srows = torch.zeros(w, K.row_bytes(nq, 4, qb), dtype=torch.uint8, device=dev)
    for j in range(w):
        K.quantize(x, None, srows[j : j + 1], bits=4, block=qb, n=nq)
    sqe, sqout = qe.clone(), torch.zeros(K.row_bytes(nq, 4, qb), dtype=torch.uint8, device=dev)
    qout = torch.empty(n, device=dev)
    coded = nq // 2 + 4 * (nq // qb)  # bytes of nq values in codes and scales

    def _source_compress(ref: bool) -> None:
        if ref:
            K.reference_momentum_source(*src, *coef)
            K.reference_worker_compress(su, e, bits, scale, **deferred)
        else:
            K.worker_compress(K.MomentumSource(*src, *coef), e, bits, scale, **deferred)

    # (name, fused call, reference call, input bytes, traffic-floor bytes)
    cases = [
        (
            "worker_compress",
            lambda: K.worker_compress(x, e, bits, scale),
            lambda: K.reference_worker_compress(x, e, bits, scale),
            8 * n,
            12 * n + n // 8,
        ),
        (
            "worker_deferred",
            lambda: K.worker_compress(x, e, bits, scale, **deferred),
            lambda: K.reference_worker_compress(x, e, bits, scale, **deferred),
            8 * n + n // 8,
            12 * n + n // 4,
        ),
        (
            "momentum_source",
            lambda: K.momentum_source(*src, *coef),
            lambda: K.reference_momentum_source(*src, *coef),
            12 * n,
            16 * n,  # reads m, g, v (d); writes u
        ),
        (
            "source_compress",
            lambda: _source_compress(False),
            lambda: _source_compress(True),
            16 * n + n // 8,
            20 * n + n // 4,  # reads m, g, v (d), the error, the previous bits; writes y, bits
        ),
        (
            "server_reduce",
            lambda: K.server_reduce(sbits, sscales, se, sout, sscale, pending=True),
            lambda: K.reference_server_reduce(sbits, sscales, se, sout, sscale, pending=True),
            w * m // 8 + 4 * m,
            w * m // 8 + 8 * m + m // 8,
        ),
        (
            "decompress",
            lambda: K.decompress(dbits, sscales, out),
            lambda: K.reference_decompress(dbits, sscales, out),
            n // 8,
            n // 8 + 4 * n,
        ),
        (
            "quantize_int4",
            lambda: K.quantize(x, qe, qrows, bits=4, block=qb),
            lambda: K.reference_quantize(x, qe, qrows, bits=4, block=qb),
            8 * n,
            8 * n + 4 * nq + coded,  # reads x, e; writes e, the rows
        ),
        (
            "qreduce_int4",
            lambda: K.quantized_reduce(srows, sqe, sqout, m=nq, bits=4, block=qb),
            lambda: K.reference_quantized_reduce(srows, sqe, sqout, m=nq, bits=4, block=qb),
            w * coded + 4 * nq,
            w * coded + 8 * nq + coded,  # reads W rows, e; writes e, a row
        ),
        (
            "dequantize_int4",
            lambda: K.dequantize(qrows, qout, m=nq // w, bits=4, block=qb),
            lambda: K.reference_dequantize(qrows, qout, m=nq // w, bits=4, block=qb),
            coded,
            coded + 4 * n,
        ),
        (
            "lamb_update",
            lambda: K.lamb_frozen_update(*lb, lo, **lh),
            lambda: K.reference_lamb_frozen_update(*lb, lo, **lh),
            20 * n,
            32 * n,  # reads x, m, v (d), v_fresh, p; writes m, v_fresh, u
        ),
        (
            "adam_update",
            lambda: K.adam_update(*ab, ap, lo[:-1], **ah),
            lambda: K.reference_adam_update(*ab, ap, lo[:-1], **ah),
            16 * n,
            28 * n,  # reads g, m, v, p; writes m, v, p
        ),
    ]
    print(
        f"n = {n:,} values, W = {w}, device = {dev}, threads = {torch.get_num_threads()}, "
        f"fp32 copy: {copy_s * 1e3:.2f} ms = {copy_bw / 1e9:.1f} GB/s moved"
    )
    print()
    hdr = f"| {'kernel':<16} | {'impl':<9} | {'ms':>8} | {'GB/s in':>8} | {'x floor':>7} | {'vs ref':>6} |"
    print(hdr)
    print("|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|")
    rows = []
    for name, fused, ref, in_bytes, floor_bytes in cases:
        if args.only and not re.search(args.only, name):
            continue
        floor_s = floor_bytes / copy_bw
        t_fused = _median_seconds(fused, args.repeat, dev)
        t_ref = _median_seconds(ref, max(3, args.repeat // 3), dev)
        for impl, t in (("CUDA" if dev.type == "cuda" else "C++", t_fused), ("torch ref", t_ref)):
            print(
                f"| {name:<16} | {impl:<9} | {t * 1e3:8.2f} | {in_bytes / t / 1e9:8.2f} | "
                f"{t / floor_s:6.2f}x | {t_ref / t:5.1f}x |"
            )
        rows.append(
            {
                "kernel": name,
                "cpp_ms": t_fused * 1e3,
                "ref_ms": t_ref * 1e3,
                "floor_ms": floor_s * 1e3,
                "x_floor": t_fused / floor_s,
                "speedup_vs_ref": t_ref / t_fused,
            }
        )
    print(
        f"| {'fp32 copy':<16} | {'torch':<9} | {copy_s * 1e3:8.2f} | {4 * n / copy_s / 1e9:8.2f} | "
        f"{'1.00x':>7} | {'':>6} |"
    )
    print(
        f"| {'fp32 fill':<16} | {'torch':<9} | {fill_s * 1e3:8.2f} | {'-':>8} | "
        f"{fill_s / (4 * n / copy_bw):6.2f}x | {'':>6} |"
    )
    print(
        json.dumps(
            {
                "n": n,
                "world": w,
                "device": str(dev),
                "threads": torch.get_num_threads(),
                "copy_ms": copy_s * 1e3,
                "fill_ms": fill_s * 1e3,
                "kernels": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
