"""What the 1-bit optimizers hold in memory: bytes per parameter value, next to torch's Adam.

    python benchmarks/memory.py [--params 4000000] [--worlds 1,2,4] [--device cpu|cuda]
        [--average-dtype float32|bf16|int4|int8] [--json FILE]

Every rank builds the same MLP (about ``--params`` values in 8 layers) and trains it with each
optimizer, directly, on real gloo ranks: two steps in the warmup, the switch, then three
compression steps (0/1 Adam: its sync steps), exchanged in ``step()`` or overlapped with
backward (25 MiB buckets). Each 1-bit optimizer runs twice: averaging the warmup's gradients
itself (``average_warmup_grads=True``, its default, for plain ``torch.distributed`` code), and
as the strategies use it (``average_warmup_grads=False``: the loop all-reduces every ``.grad``
before the warmup's steps, as DDP does, and leaves the compression steps' local). Then every
tensor the optimizer object reaches (its state, its flat buffers, the exchange's buffers and
records, the overlap's) is counted once per storage, the parameters and their gradients left out
(the model holds those under any optimizer).

Counted after the second warmup step and after the last compression step; each number is the bytes held
divided by 4 times the number of parameter values, i.e. how many fp32 copies of the model the
optimizer keeps between steps; torch's Adam keeps 2 (``exp_avg``, ``exp_avg_sq``). Rank 0's
count; every rank holds the same sizes.

*Peak*: what ``optimizer.step()`` itself takes above what the process held just before it, in the
same unit, for that warmup step and that compression step: on the CPU the resident set's high
water mark (``VmHWM``, reset through ``/proc/self/clear_refs`` before the step; a page counts
once touched), on a GPU ``torch.cuda.max_memory_allocated``. It includes what the step makes
and keeps (the first steps make buffers; these are steady steps), transient scratch, and the
collectives' buffers; the allocator's caching can hide a transient that reuses freed memory.

On the CPU the script runs with glibc's ``MALLOC_MMAP_THRESHOLD_=65536`` (it restarts itself
with it): every allocation of 64 KiB or more is then its own mapping, returned at its free, so a
step's transient buffers raise the high water mark instead of reusing pages an earlier free left
in the heap.

``--average-dtype`` is the 1-bit optimizers' ``average_dtype`` (default float32); an integer
one (``int4``/``int8``) is averaged by the optimizer itself, as under the strategies, so its
runs are the ``average_warmup_grads=True`` ones only.

``--device cuda`` runs one process on the current GPU (``W = 1``: no process group; the exchange
still compresses), so that a lent GPU measures the same counts, and its peaks, in one command:
``python benchmarks/memory.py --device cuda``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_onebit.optim import OneBitAdam, OneBitLamb, ZeroOneAdam
from tests.helpers.dist import run_distributed
from tests.helpers.memory import held

OPTIMIZERS = {
    "torch_adam": lambda params, **kw: torch.optim.Adam(params, lr=1e-3),
    "onebit_adam": lambda params, **kw: OneBitAdam(params, lr=1e-3, freeze_step=WARMUP, **kw),
    "zero_one_adam": lambda params, **kw: ZeroOneAdam(
        params, lr=1e-3, var_freeze_step=WARMUP, local_step_scaler=1_000_000, **kw
    ),
    "onebit_lamb": lambda params, **kw: OneBitLamb(params, lr=1e-3, freeze_step=WARMUP, **kw),
}
#: who averages the warmup's gradients: the optimizer, or the loop before the step (as DDP under
#: the strategies, which pass ``average_warmup_grads=False``), and how the table says so
AVERAGED_BY = {
    "optimizer": "the optimizer (`average_warmup_grads=True`)",
    "ddp": "DDP (`average_warmup_grads=False`, the strategies)",
}
#: warmup steps (the last one switches), then compression steps; counted and timed: the
#: second warmup step (the first makes the states) and the last step
WARMUP, STEPS = 3, 6


def _model(n: int) -> torch.nn.Module:
    torch.manual_seed(0)
    width = max(8, int((n / 8) ** 0.5))
    layers: list[torch.nn.Module] = []
    for _ in range(8):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _resident() -> int:
    """This process's resident set and its high water mark, in bytes (Linux)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def _peak_of(step: Any, device: torch.device) -> int:
    """Bytes ``step()`` took above what was held just before it, at its peak (see the module
    docstring)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with open("/proc/self/clear_refs", "w") as f:  # the high water mark := the resident set
        f.write("5")
    before, _ = _resident()
    step()
    return _resident()[1] - before


def _run(
    rank: int, world: int, n: int, device: str = "cpu", dtype: str = "float32"
) -> list[dict[str, Any]]:
    dev = torch.device(device)
    rows = []
    for name, make in OPTIMIZERS.items():
        if name == "torch_adam":
            runs = [("ddp", False)]
        else:
            by_whom = ["optimizer"] if dtype in ("int4", "int8") else list(AVERAGED_BY)
            runs = [(by, overlap) for by in by_whom for overlap in (False, True)]
        for averaged_by, overlap in runs:
            model = _model(n).to(dev)
            params = list(model.parameters())
            kw = {} if name == "torch_adam" else {"average_dtype": dtype}
            opt = make(params, average_warmup_grads=averaged_by == "optimizer", **kw)
            if overlap:
                opt.overlap_with_backward(25.0)
            gen = torch.Generator().manual_seed(rank)
            width = params[0].shape[1]
            numel = sum(p.numel() for p in params)
            row: dict[str, Any] = {
                "optimizer": name, "averaged_by": averaged_by, "overlap": overlap,
                "world": world, "params": numel,
            }  # fmt: skip
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for t in range(1, STEPS + 1):
                    opt.zero_grad()
                    x = torch.randn(16, width, generator=gen).to(dev)
                    model(x).square().mean().backward()
                    averaged = name == "torch_adam" or opt.expects_averaged_grads
                    if world > 1 and averaged_by == "ddp" and averaged:
                        for p in params:
                            torch.distributed.all_reduce(p.grad)
                            p.grad.div_(world)
                    peak = _peak_of(opt.step, dev)
                    if t in (WARMUP - 1, STEPS):
                        skip = {p.untyped_storage().data_ptr() for p in params}
                        skip |= {
                            p.grad.untyped_storage().data_ptr()
                            for p in params
                            if p.grad is not None
                        }
                        by = held(opt, skip)
                        phase = "warmup" if t < WARMUP else "compression"
                        row[phase] = sum(by.values()) / (4 * numel)
                        row[f"{phase}_peak"] = peak / (4 * numel)
                        row[f"{phase}_by"] = {
                            k: v / (4 * numel) for k, v in sorted(by.items(), key=lambda kv: -kv[1])
                        }
            rows.append(row)
            if overlap:
                opt.overlap_with_backward(None)
    return rows


def main() -> None:
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:  # (see the module docstring)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=4_000_000)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--average-dtype", default="float32", choices=["float32", "bf16", "int4", "int8"]
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    if args.device == "cuda":  # one process on the current GPU
        rows = _run(0, 1, args.params, "cuda", args.average_dtype)
    else:
        for world in (int(w) for w in args.worlds.split(",")):
            rows += run_distributed(_run, world, args.params, "cpu", args.average_dtype)[0]
    n = rows[0]["params"]
    print(
        f"# optimizer memory · {n:,} parameter values · {args.device} · "
        f"average_dtype {args.average_dtype} · torch {torch.__version__}\n"
    )
    print(
        "| W | optimizer | warmup grads averaged by | exchange | warmup | compression "
        "| peak: warmup | compression | what the warmup holds | what the compression phase holds |"
    )
    print("|---:|---|---|---|---:|---:|---:|---:|---|---|")
    for r in rows:
        held = {
            phase: ", ".join(f"{k} {v:.2f}" for k, v in r[f"{phase}_by"].items() if v >= 0.01)
            for phase in ("warmup", "compression")
        }
        torch_adam = r["optimizer"] == "torch_adam"
        ex = "—" if torch_adam else ("overlapped" if r["overlap"] else "in step()")
        by = "DDP (the loop)" if torch_adam else AVERAGED_BY[r["averaged_by"]]
        print(
            f"| {r['world']} | {r['optimizer']} | {by} | {ex} | {r['warmup']:.2f} | "
            f"{r['compression']:.2f} | {r['warmup_peak']:+.2f} | {r['compression_peak']:+.2f} | "
            f"{held['warmup']} | {held['compression']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
