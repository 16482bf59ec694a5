"""What the 1-bit optimizers hold in memory: bytes per parameter value, next to torch's Adam.

    python benchmarks/memory.py [--params 4000000] [--worlds 1,2,4] [--json FILE]

Every rank builds the same MLP (about ``--params`` values in 8 layers) and trains it with each
optimizer, directly, on real gloo ranks: one step in the warmup, the switch, then three
compression steps (0/1 Adam: its sync steps), exchanged in ``step()`` or overlapped with
backward (25 MiB buckets). Each 1-bit optimizer runs twice: averaging the warmup's gradients
itself (``average_warmup_grads=True``, its default, for plain ``torch.distributed`` code), and
as the strategies use it (``average_warmup_grads=False``: the loop all-reduces every ``.grad``
before the warmup's steps, as DDP does, and leaves the compression steps' local). Then every
tensor the optimizer object reaches (its state, its flat buffers, the exchange's buffers and
records, the overlap's) is counted once per storage, the parameters and their gradients left out
(the model holds those under any optimizer).

Counted after a warmup step and after the last compression step; each number is the bytes held
divided by 4 times the number of parameter values, i.e. how many fp32 copies of the model the
optimizer keeps between steps; torch's Adam keeps 2 (``exp_avg``, ``exp_avg_sq``). Rank 0's
count; every rank holds the same sizes. The counts do not depend on
the device: on a GPU the same buffers are in device memory.
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
#: warmup steps (the last one switches), then compression steps
WARMUP, STEPS = 2, 5


def _model(n: int) -> torch.nn.Module:
    torch.manual_seed(0)
    width = max(8, int((n / 8) ** 0.5))
    layers: list[torch.nn.Module] = []
    for _ in range(8):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _run(rank: int, world: int, n: int) -> list[dict[str, Any]]:
    rows = []
    for name, make in OPTIMIZERS.items():
        if name == "torch_adam":
            runs = [("ddp", False)]
        else:
            runs = [(by, overlap) for by in AVERAGED_BY for overlap in (False, True)]
        for averaged_by, overlap in runs:
            model = _model(n)
            params = list(model.parameters())
            opt = make(params, average_warmup_grads=averaged_by == "optimizer")
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
                    model(torch.randn(16, width, generator=gen)).square().mean().backward()
                    averaged = name == "torch_adam" or opt.expects_averaged_grads
                    if world > 1 and averaged_by == "ddp" and averaged:
                        for p in params:
                            torch.distributed.all_reduce(p.grad)
                            p.grad.div_(world)
                    opt.step()
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
                        row[f"{phase}_by"] = {
                            k: v / (4 * numel) for k, v in sorted(by.items(), key=lambda kv: -kv[1])
                        }
            rows.append(row)
            if overlap:
                opt.overlap_with_backward(None)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=4_000_000)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for world in (int(w) for w in args.worlds.split(",")):
        rows += run_distributed(_run, world, args.params)[0]
    n = rows[0]["params"]
    print(f"# optimizer memory · {n:,} parameter values · torch {torch.__version__}\n")
    print(
        "| W | optimizer | warmup grads averaged by | exchange | warmup | compression "
        "| what the warmup holds | what the compression phase holds |"
    )
    print("|---:|---|---|---|---:|---:|---|---|")
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
            f"{r['compression']:.2f} | {held['warmup']} | {held['compression']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
