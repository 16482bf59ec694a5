"""How closely a ``strategy="ddp"`` job switched to 1-bit Adam follows a 1-bit run from step 0.

    python benchmarks/ddp_resume.py                                # switch at 12 and 100, bf16 and fp32
    python benchmarks/ddp_resume.py --switch 12 --after 100 --average-dtype float32
    python benchmarks/ddp_resume.py --json /tmp/ddp_resume.json    # also write the results

What ``docs/checkpoints.md`` compares: the tests' character model (``tests/helpers/char_model.py``,
torch AdamW, 2 fork-started CPU ranks, gloo) trained ``S`` steps under ``strategy="ddp"``, its
checkpoint resumed under ``OneBitStrategy(freeze_step=S, rescale_variance=False)`` for ``K``
more steps, against ``OneBitStrategy`` with the same options from step 0 for ``S + K`` steps
(the same batches: epochs of ``S`` steps). Reported: the largest ``|parameter difference|`` on
rank 0 at the switch (what the two warmups left: DDP with torch's AdamW, and the 1-bit run's own
warmup) and ``k`` steps after it, for each ``--average-dtype`` of the 1-bit runs' warmup.

Then, to say where the fp32 difference comes from, one Adam step of ``OneBitAdam`` (one process,
bias correction on) against ``torch.optim.Adam`` on the same 100k values: how many values of
``exp_avg``, ``exp_avg_sq`` and the parameters differ, and which formula reproduces torch's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests.helpers`

from lightning_onebit import OneBitAdam, OneBitStrategy
from tests.helpers.char_model import _fit

REPORTED = (1, 3, 10, 100)


class ParamsPerStep(Callback):
    """Rank 0's parameters after every optimizer step, saved at the end of fit."""

    def __init__(self, out: Path) -> None:
        self.out, self.steps = out, {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        params = [p.detach().clone() for p in pl_module.parameters()]
        self.steps[trainer.global_step] = params

    def on_fit_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if trainer.global_rank == 0:
            torch.save(self.steps, self.out / "params.pt")


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def compare(tmp: Path, switch: int, after: int, average_dtype: str) -> dict[str, Any]:
    """The DDP job resumed at ``switch`` vs the 1-bit run from step 0, ``after`` steps on."""
    ckpt = ModelCheckpoint(dirpath=tmp / "ckpt", every_n_train_steps=switch)
    ddp = ParamsPerStep(tmp)
    _fit(tmp / "ddp", "ddp_notebook", steps=switch, epoch_steps=switch, callbacks=[ckpt, ddp])
    (path,) = (tmp / "ckpt").glob("*.ckpt")
    ddp_at_switch = torch.load(tmp / "params.pt")[switch]
    runs = {}
    for name, ckpt_path in (("resumed", str(path)), ("whole", None)):
        out = tmp / name
        out.mkdir()
        strategy = OneBitStrategy(
            freeze_step=switch,
            rescale_variance=False,
            average_dtype=average_dtype,
            start_method="fork",
        )
        record = ParamsPerStep(out)
        _fit(out, strategy, steps=switch + after, epoch_steps=switch, ckpt_path=ckpt_path,
             callbacks=[record])  # fmt: skip
        runs[name] = torch.load(out / "params.pt")
    resumed, whole = runs["resumed"], runs["whole"]
    return {
        "switch": switch,
        "average_dtype": average_dtype,
        "at_switch": _max_diff(ddp_at_switch, whole[switch]),
        "after": {
            k: _max_diff(resumed[switch + k], whole[switch + k])
            for k in (*REPORTED, after)
            if k <= after
        },
    }


def one_adam_step(n: int = 100_000) -> dict[str, Any]:
    """``OneBitAdam``'s warmup step vs ``torch.optim.Adam`` (CPU, its single-tensor step), and
    the formulas that reproduce torch's rounding."""
    b1, b2, lr, eps = 0.9, 0.999, 3e-3, 1e-8
    gen = torch.Generator().manual_seed(0)
    p0, g = torch.randn(n, generator=gen), 1e-2 * torch.randn(n, generator=gen)
    ours, theirs = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    opt = OneBitAdam([ours], lr=lr, betas=(b1, b2), eps=eps, bias_correction=True, freeze_step=10)
    ref = torch.optim.Adam([theirs], lr=lr, betas=(b1, b2), eps=eps)
    counts = []
    for t in range(1, 3):
        ours.grad, theirs.grad = g * t, g * t
        opt.step()
        ref.step()
        st = ref.state[theirs]
        counts.append(
            {
                "step": t,
                "exp_avg": int((opt.flat.states["exp_avg"] != st["exp_avg"]).sum()),
                "exp_avg_sq": int((opt.flat.states["exp_avg_sq"] != st["exp_avg_sq"]).sum()),
                "params": int((ours != theirs).sum()),
            }
        )
    one_b2 = torch.tensor(1 - b2)  # (float32, as the kernel's)
    torch_v = torch.zeros(n).addcmul_(g, g, value=1 - b2)
    m0 = 1e-2 * torch.randn(n, generator=gen)
    torch_m = m0.clone().lerp_(g, 1 - b1)
    return {
        "n": n,
        "differ": counts,
        # torch: exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2), i.e. ((1 - b2) * g) * g
        "v: (1-b2)*(g*g) vs torch": int((one_b2 * (g * g) != torch_v).sum()),
        "v: ((1-b2)*g)*g vs torch": int(((one_b2 * g) * g != torch_v).sum()),
        # torch: exp_avg.lerp_(g, 1 - b1)
        "m: b1*m + (1-b1)*g vs torch's lerp": int(
            (m0 * b1 + torch.tensor(1 - b1) * g != torch_m).sum()
        ),
        # torch: p.addcdiv_(m, sqrt(v) / sqrt(bc2) + eps, value=-lr / bc1); the kernel takes
        # the correction folded into its lr and eps: p - lr'* m / (sqrt(v) + eps')
        "p: correction folded into lr and eps vs torch's (same m, v)": _folded_vs_torch(
            p0, torch_m, torch_v + torch_m.square(), lr, b1, b2, eps
        ),
    }


def _folded_vs_torch(
    p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, lr: float, b1: float, b2: float, eps: float
) -> int:
    """Values where Adam's bias-corrected update at step 1 rounds differently when the
    correction is folded into ``lr`` and ``eps`` (as ``optim._ops.adam_step_`` passes them)."""
    bc1, bc2 = 1 - b1, 1 - b2
    torch_p = p.clone().addcdiv_(m, (v.sqrt() / bc2**0.5).add_(eps), value=-lr / bc1)
    lr_c, eps_c = torch.tensor(lr * bc2**0.5 / bc1), torch.tensor(eps * bc2**0.5)
    return int((p - lr_c * (m / (v.sqrt() + eps_c)) != torch_p).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--switch", type=int, nargs="+", default=[12, 100])
    parser.add_argument("--after", type=int, default=100, help="steps after the switch")
    parser.add_argument("--average-dtype", nargs="+", default=["float32", "bf16"])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    rows = []
    for switch in args.switch:
        for dtype in args.average_dtype:
            with tempfile.TemporaryDirectory() as tmp:
                rows.append(compare(Path(tmp), switch, args.after, dtype))
    ks = [k for k in (*REPORTED, args.after) if k <= args.after]
    ks = list(dict.fromkeys(ks))
    print(
        "\n| switch at | warmup average | at the switch | " + " | ".join(f"+{k}" for k in ks) + " |"
    )
    print("|---|---|---|" + "---|" * len(ks))
    for r in rows:
        cells = " | ".join(f"{r['after'][k]:.2g}" for k in ks)
        print(f"| {r['switch']} | {r['average_dtype']} | {r['at_switch']:.2g} | {cells} |")
    step = one_adam_step()
    print("\nOne warmup step of OneBitAdam vs torch.optim.Adam (values that differ):")
    print(json.dumps(step, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "adam_step": step}, indent=1))


if __name__ == "__main__":
    main()
