"""1-bit LAMB's trust ratios, step by step and layer by layer, on one model of the user zoo.

    python benchmarks/lamb_diagnostics.py --model bert_mlm --lamb-lr 1e-2 --json /tmp/lamb.json
    python benchmarks/lamb_diagnostics.py --model bert_mlm --lamb-lr 1e-2 --never   # LAMB itself

Trains ``tests/helpers/user_models.py``'s model on 2 fork-started CPU ranks under
``OneBitStrategy(algorithm="onebit_lamb", lamb_lr=...)`` (``--never``: ``freeze_step=10**9``,
i.e. LAMB with fp32 allreduces) and records on rank 0, after every optimizer step and for every
parameter: the effective trust ratio the step applied (``lamb_coeffs``), the frozen ratio
(``lamb_coeff_freeze``) and factor (``last_factor``), the unclamped fresh-variance factor the next
step starts from (``max((sqrt(v) + eps) / (sqrt(v_fresh) + eps))``), the median of
``v_fresh / v``, the tensor's RMS, and the unclamped ratio ``||p|| / ||u||`` that LAMB would
compute now from ``m`` and the *fresh* variance (warmup: the live one). The summary prints, per
parameter at a few steps, these numbers; ``--compare`` puts a ``--never`` JSON next to them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `tests.helpers`

from lightning_onebit import OneBitStrategy  # noqa: E402
from tests.helpers.cluster import cluster_module  # noqa: E402
from tests.helpers.fit import inner_optimizer  # noqa: E402
from tests.helpers.user_models import MODELS, fit_user_model  # noqa: E402


class RecordRatios(Callback):
    """Rank 0 appends one record per optimizer step to ``out`` (JSON lines; the first also holds
    the parameter names)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.names: list[str] = []

    @torch.no_grad()
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, *_: Any) -> None:
        if trainer.global_rank != 0:
            return
        opt = inner_optimizer(trainer)
        flat = opt.flat
        layout = flat.layout
        if not self.names:
            names = {p: n for n, p in pl_module.named_parameters()}
            self.names = [names.get(p, str(j)) for j, p in enumerate(layout.params)]
        m, v = flat.views["exp_avg"], flat.views["exp_avg_sq"]
        fresh = flat.views["exp_avg_sq_fresh"] if opt.phases.switched else None
        wd = [opt.param_groups[g]["weight_decay"] for g in layout.group_of]
        eps = [opt.param_groups[g]["eps"] for g in layout.group_of]
        live_bc = 1.0
        if opt.bias_correction and not opt.phases.switched:  # warmup: v uncorrected
            b1, b2 = opt.param_groups[0]["betas"]
            live_bc = math.sqrt(1 - b2**opt.step_count) / (1 - b1**opt.step_count)
        keys = ("raw_factor", "fresh_over_v", "rms", "live", "frozen_live")
        per: dict[str, list[float]] = {k: [] for k in keys}
        for j, p in enumerate(layout.params):
            pf = p.detach().float()
            vf = v[j] if fresh is None else fresh[j]
            u = live_bc * m[j] / (vf.sqrt() + eps[j]) + wd[j] * pf
            un, pn = float(u.norm()), float(pf.norm())
            per["live"].append(pn / un if un > 0 and pn > 0 else math.nan)
            per["rms"].append(pn / math.sqrt(max(p.numel(), 1)))
            uf = live_bc * m[j] / (v[j].sqrt() + eps[j]) + wd[j] * pf  # the frozen variance
            ufn = float(uf.norm())
            per["frozen_live"].append(pn / ufn if ufn > 0 and pn > 0 else math.nan)
            if fresh is None:
                per["raw_factor"].append(math.nan)
                per["fresh_over_v"].append(math.nan)
            else:
                ratio = (v[j].sqrt() + eps[j]) / (fresh[j].sqrt() + eps[j])
                per["raw_factor"].append(float(ratio.max()))
                per["fresh_over_v"].append(float((fresh[j] / v[j].clamp_min(1e-30)).median()))
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        row = {
            "step": opt.step_count,
            "phase": str(opt.phase),
            "loss": float(loss),
            "coeff": opt.lamb_coeffs,
            "freeze": flat.scalars["lamb_coeff_freeze"].tolist(),
            "factor": flat.scalars["last_factor"].tolist(),
            **per,
        }
        with self.out.open("a") as f:  # line by line: a rank that fails keeps what it had
            f.write(json.dumps({"names": self.names, **row} if row["step"] == 1 else row) + "\n")


def run(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {"lamb_lr": args.lamb_lr, "start_method": "fork"}
    if args.never:
        kw["freeze_step"] = 10**9
    elif args.freeze_step is not None:
        kw["freeze_step"] = args.freeze_step
    kw.update(cluster_module().parse_strategy_option(o) for o in args.option)
    with tempfile.TemporaryDirectory(prefix="lamb_diag_") as tmp:
        out = Path(tmp) / "rows.json"
        try:
            records = fit_user_model(
                args.model,
                OneBitStrategy(algorithm="onebit_lamb", **kw),
                Path(tmp),
                seed=args.seed,
                steps=args.steps,
                callbacks=[RecordRatios(out)],
            )
        except Exception as err:  # a failed fit: its rows up to the failure
            records = [{"eval_loss": math.nan}]
            print(f"fit failed: {str(err)[-300:]}", file=sys.stderr)
        rows = [json.loads(line) for line in out.read_text().splitlines()]
    data = {"names": rows[0].pop("names"), "rows": rows}
    data["eval_loss"] = max(r["eval_loss"] for r in records)
    data["options"] = {k: v for k, v in kw.items() if k != "start_method"}
    data["seed"] = args.seed
    return data


def summary(data: dict[str, Any], steps: list[int], other: dict[str, Any] | None) -> str:
    rows = {r["step"]: r for r in data["rows"]}
    ref = {r["step"]: r for r in other["rows"]} if other else {}
    head = (
        "| param | step | coeff | LAMB's coeff | freeze | factor | raw factor | v_fresh/v | RMS |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for j, name in enumerate(data["names"]):
        for s in steps:
            if s not in rows:
                continue
            r = rows[s]
            lamb = ref[s]["coeff"][j] if s in ref and ref[s]["coeff"] else math.nan
            cells = [
                r["coeff"][j] if r["coeff"] else math.nan,
                lamb,
                r["freeze"][j],
                r["factor"][j],
                r["raw_factor"][j],
                r["fresh_over_v"][j],
                r["rms"][j],
            ]
            lines.append(f"| {name} | {s} | " + " | ".join(f"{c:.3g}" for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", choices=list(MODELS), default="bert_mlm")
    p.add_argument("--lamb-lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--freeze-step", type=float, default=None)
    p.add_argument("--never", action="store_true", help="freeze_step=10**9: LAMB itself")
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more OneBitStrategy option (a Python literal, e.g. trust_ratio='update_norm')",
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--load", type=Path, default=None, help="summarise this JSON, train nothing")
    p.add_argument("--compare", type=Path, default=None, help="a --never JSON to compare with")
    p.add_argument("--at", type=int, nargs="+", default=[60, 61, 100, 200, 300])
    args = p.parse_args()
    if args.freeze_step is not None and args.freeze_step >= 1:
        args.freeze_step = int(args.freeze_step)
    data = json.loads(args.load.read_text()) if args.load else run(args)
    if args.json:
        args.json.write_text(json.dumps(data))
    other = json.loads(args.compare.read_text()) if args.compare else None
    print(f"eval loss {data['eval_loss']:.4f} ({data.get('options')}, seed {data.get('seed')})")
    print(summary(data, args.at, other))


if __name__ == "__main__":
    main()
