"""Training-step time on one GPU: the 1-bit optimizers next to torch's fused AdamW, and what the
exchange's NaN/Inf verdict costs, read on the host or kept on the device.

    python benchmarks/gpu_step.py [--width 1024] [--layers 8] [--batch 32] [--steps 20]
    python benchmarks/gpu_step.py --only "device|fused"   # the rows whose label matches
    python benchmarks/gpu_step.py --profile                # where a compressed step's time goes

A transformer LM (``nn.TransformerEncoder``, bf16 autocast) on one GPU, so W = 1: the exchange
compresses and decodes but sends nothing, and what is measured is the optimizers' own cost
per step. Each row: the median over 3 runs of ``--steps`` steps of the wall time per step,
with one ``torch.cuda.synchronize()`` per run (never per step, so a host synchronisation inside
the step shows up as the GPU idling while the host catches up). ``verdict=device`` is what
1-bit Adam and 1-bit LAMB do on CUDA (the verdict stays on the device: predicated kernels, no
host read); ``verdict=host`` reads it on the host (``comm.all_finite``, a host synchronisation
per exchange: 0/1 Adam, and the other two with ``DEVICE_VERDICT`` off, their torch-op update);
``verdict=off`` replaces that read by ``True`` (unsafe: what the read itself costs). The
optimizers are switched to their compression phase after 2 steps (0/1 Adam: its local phase, a
sync every step; "local steps": its local step interval at 16). ``--profile`` prints, per
optimizer, the device time of forward+backward and of ``step()`` (CUDA events: kernels and the
gaps between them), the device's busy time and number of kernels per step, and the CUDA kernels
of 5 steps by device time (torch's profiler).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
import warnings
from collections.abc import Callable

import torch

import lightning_onebit.comm.flat as comm
from lightning_onebit.optim import OneBitAdam, OneBitLamb, ZeroOneAdam

VOCAB = 8192


def _model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(width, width // 64, 4 * width, batch_first=True)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, width),
        torch.nn.TransformerEncoder(layer, layers),
        torch.nn.Linear(width, VOCAB),
    ).cuda()


def _time(
    args: argparse.Namespace, make: Callable, overlap: float | None, verdict: str
) -> tuple[float, int]:
    model = _model(args.width, args.layers)
    opt = make(model.parameters())
    if verdict != "device" and hasattr(opt, "DEVICE_VERDICT"):
        opt.DEVICE_VERDICT = False  # (before the first step builds the exchange)
    if overlap is not None:
        opt.overlap_with_backward(overlap)
    x = torch.randint(0, VOCAB, (args.batch, args.seq + 1), device="cuda")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            logits = model(x[:, :-1])  # (B, T, V)
        torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), x[:, 1:].flatten()
        ).backward()
        opt.step()

    for _ in range(5):  # the warmup steps, the switch, the first compressed steps
        step()
    real = comm.all_finite
    if verdict == "off":
        comm.all_finite = lambda scales: True
    runs = []
    try:
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
            runs.append((time.perf_counter() - t0) / args.steps * 1e3)
    finally:
        comm.all_finite = real
        if overlap is not None:
            opt.overlap_with_backward(None)
    return statistics.median(runs), sum(p.numel() for p in model.parameters())


def _profile(args: argparse.Namespace, label: str, make: Callable) -> None:
    """Print where 5 compressed steps of ``make``'s optimizer spend the device's time: the span
    from the end of backward to the end of ``step()`` on the device (CUDA events: kernels and
    the gaps between them), the kernels' busy time per step, and the kernels by device time."""
    from torch.profiler import ProfilerActivity, profile

    model = _model(args.width, args.layers)
    opt = make(model.parameters())
    x = torch.randint(0, VOCAB, (args.batch, args.seq + 1), device="cuda")
    marks = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(5)]
    prof = profile(activities=[ProfilerActivity.CUDA])
    for k in range(15):  # 5 warmup steps (the switch), 5 timed by events, 5 profiled
        if k == 10:
            torch.cuda.synchronize()
            prof.__enter__()
        mark = marks[k - 5] if 5 <= k < 10 else None
        if mark:
            mark[0].record()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            logits = model(x[:, :-1])
        torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), x[:, 1:].flatten()
        ).backward()
        if mark:
            mark[1].record()
        opt.step()
        if mark:
            mark[2].record()
    torch.cuda.synchronize()
    prof.__exit__(None, None, None)
    fwd_bwd = statistics.median(m[0].elapsed_time(m[1]) for m in marks)
    in_step = statistics.median(m[1].elapsed_time(m[2]) for m in marks)
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 5 / 1e3  # (us -> ms per step)
    launches = sum(e.count for e in events if e.self_device_time_total > 0) / 5
    print(f"\n### {label}: CUDA kernels of 5 steps (forward, backward and step)")
    print(
        f"device: forward+backward {fwd_bwd:.2f} ms, step() {in_step:.2f} ms (medians of 5); "
        f"busy {busy:.2f} ms per step in {launches:.0f} kernels and copies"
    )
    print(events.table(sort_by="device_time_total", row_limit=25, max_name_column_width=60))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--only", default="", help="a regular expression: time only the rows it finds")
    p.add_argument("--profile", action="store_true", help="profile instead of timing")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_step.py needs a CUDA GPU")
    warnings.simplefilter("ignore")  # single-process and young-variance warnings

    rows: list[tuple[str, Callable, float | None, str]] = [
        ("torch AdamW (fused)", lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True), None, "-")
    ]
    for name, cls, kw in (
        ("1-bit Adam", OneBitAdam, {"freeze_step": 2}),
        ("0/1 Adam", ZeroOneAdam, {"var_freeze_step": 2}),
        # (the local step interval doubles every step up to 16: 15 of 16 timed steps are local;
        # bias-corrected: with DeepSpeed's uncorrected variance of 2 steps they diverge)
        (
            "0/1 Adam, local steps",
            ZeroOneAdam,
            {
                "var_freeze_step": 2,
                "local_step_scaler": 1,
                "local_step_clipper": 16,
                "bias_correction": True,
            },
        ),
        ("1-bit LAMB", OneBitLamb, {"freeze_step": 2}),
    ):
        for overlap in (None, args.bucket_mb):
            for verdict in ("device", "host", "off") if cls.DEVICE_VERDICT else ("host", "off"):
                where = "in step()" if overlap is None else f"overlap {overlap:g} MB"
                label = f"{name}, {where}, verdict={verdict}"
                rows.append(
                    (label, lambda ps, cls=cls, kw=kw: cls(ps, lr=1e-4, **kw), overlap, verdict)
                )
    rows = [row for row in rows if re.search(args.only, row[0])]
    if args.profile:
        for label, make, overlap, verdict in rows:
            if overlap is None and verdict in ("-", "device"):  # as shipped
                _profile(args, label, make)
        return
    print(f"| optimizer (one GPU, {torch.cuda.get_device_name()}) | ms per step |")
    print("|---|---:|")
    n = 0
    for label, make, overlap, verdict in rows:
        ms, n = _time(args, make, overlap, verdict)
        print(f"| {label} | {ms:.2f} |", flush=True)
    print(
        f"({n / 1e6:.1f}M parameters, batch {args.batch} x {args.seq} tokens, bf16 autocast; "
        f"median of 3 runs of {args.steps} steps)"
    )


if __name__ == "__main__":
    main()
