"""The user-model zoo under DDP and the 1-bit strategies: does each one train like DDP does?

    python benchmarks/user_models.py                                  # all models, all algorithms
    python benchmarks/user_models.py --models conv_bn gpt2 --algos onebit_adam --steps 100
    python benchmarks/user_models.py --json /tmp/zoo.json             # also write the results

Every model of ``tests/_user_models.py`` (plain LightningModules whose ``configure_optimizers``
returns ``torch.optim.Adam``/``AdamW``: a conv net with BatchNorm, an MLP with dead ReLUs,
``nn.MultiheadAttention``, a regression MLP, tied embeddings, and Hugging Face GPT-2, BERT,
ResNet and ViT) is trained on 2 fork-started CPU ranks (gloo), from the same seed on the same
batches, under

* ``"ddp_notebook"``: the reference;
* ``OneBitStrategy(algorithm=a, start_method="fork")`` for each ``--algos`` entry (compression
  after the default 20% warmup);
* for ``onebit_lamb`` also ``lamb (never frozen)``: 1-bit LAMB with ``freeze_step=10**9``, i.e.
  LAMB with fp32 allreduces, the baseline 1-bit LAMB should match (its loss ratio against it is
  given in parentheses in the ``onebit_lamb`` row).

One row per model and run: the held-out loss (every rank computes it at the end of fit; the
worst rank counts) and its ratio to DDP's; the largest ``max |p| / max(max |p_DDP|, 1e-3)`` over
the parameters and where it is reached, and the same over the buffers (BatchNorm's running
variance follows the scale of the conv weights before it); whether every rank ended with
bitwise equal parameters (``differ*``: 0/1 Adam between synchronisations, which it allows;
"buffers differ": BatchNorm's running statistics, which every rank updates from its own batches
after DDP's last broadcast, under DDP too); the final phase and the number of steps run in the
compression phase; the mean bytes a rank sent per compression-phase step relative to an fp32
ring allreduce of the gradients; the wall time of the fit (starting the processes included).

In bold: what the zoo's tests fail on (a loss above 1.25x DDP's, a parameter above 10x DDP's,
ranks out of sync, no compression step) and errors: a fit that fails (e.g. ``NonFiniteError``,
the run diverged) is reported in its row and the table goes on.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from _user_models import MODELS, compare, fit_user_model, ranks_in_sync  # noqa: E402

from lightning_onebit import OneBitStrategy  # noqa: E402

ALGOS = ("onebit_adam", "zero_one_adam", "onebit_lamb")
LAMB_BASELINE = "lamb (never frozen)"
LOSS_LIMIT = 1.25  # a held-out loss above this times DDP's is shown in bold
PARAM_LIMIT = 10.0  # as is a parameter whose max |p| exceeds this times DDP's


def _log(msg: str) -> None:
    print(f"[user_models] {msg}", file=sys.stderr, flush=True)


def _quiet() -> None:
    """Lightning's per-fit banners and deprecation notes would drown the progress lines."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=r".*litlogger.*")


def _strategies(algos: list[str], lamb_lr: float | None = None) -> dict[str, Any]:
    runs: dict[str, Any] = {"ddp": lambda: "ddp_notebook"}
    lamb = {"lamb_lr": lamb_lr}
    for a in algos:
        kw = lamb if a == "onebit_lamb" else {}
        runs[a] = lambda a=a, kw=kw: OneBitStrategy(algorithm=a, start_method="fork", **kw)
    if "onebit_lamb" in algos:
        runs[LAMB_BASELINE] = lambda: OneBitStrategy(
            algorithm="onebit_lamb", freeze_step=10**9, start_method="fork", **lamb
        )
    return runs


_ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)):\s*(.*)$")


def _error_summary(err: BaseException) -> str:
    """``Type: message`` of the innermost error: a rank's failure reaches the launching process
    as an exception whose message carries the rank's traceback."""
    found = None
    for line in str(err).splitlines():
        m = _ERROR_LINE.match(line.strip())
        if m:
            found = f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2)}"
    if found is None:
        lines = str(err).strip().splitlines()
        found = f"{type(err).__name__}: {lines[-1] if lines else ''}"
    text = found.replace("|", "\\|")  # a markdown cell
    return text if len(text) <= 110 else text[:107] + "..."


def _fmt(x: float | None, spec: str = ".3f") -> str:
    if x is None:
        return "-"
    if math.isinf(x) or math.isnan(x):
        return str(x)
    return format(x, spec)


def _ratio(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x) or math.isnan(x):
        return str(x)
    return f"{x:.3g}"


def run_model(
    name: str, algos: list[str], steps: int | None, tmp: Path, lamb_lr: float | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {"model": name, "runs": {}}
    records: dict[str, list[dict]] = {}
    for run, make in _strategies(algos, lamb_lr).items():
        t0 = time.perf_counter()
        entry: dict[str, Any] = {}
        try:
            records[run] = fit_user_model(name, make(), tmp / name / run.split()[0], steps=steps)
        except Exception as err:
            entry["error"] = _error_summary(err)
        entry["seconds"] = time.perf_counter() - t0
        if run in records:
            entry["eval_loss"] = max(r["eval_loss"] for r in records[run])
            entry["steps"] = records[run][0]["global_step"]
            entry["in_sync"] = ranks_in_sync(records[run])
            entry["buffers_in_sync"] = ranks_in_sync(records[run], buffers=True)
        out["runs"][run] = entry
        _log(
            f"{name} / {run}: {entry['seconds']:.1f} s, "
            + (entry["error"] if "error" in entry else f"eval loss {entry['eval_loss']:.4f}")
        )
    if "ddp" in records:
        for run, entry in out["runs"].items():
            if run != "ddp" and run in records:
                entry.update(compare(records["ddp"], records[run]))
        lamb, base = out["runs"].get("onebit_lamb"), out["runs"].get(LAMB_BASELINE)
        if lamb and base and "eval_loss" in lamb and "eval_loss" in base:
            lamb["loss_ratio_vs_lamb"] = lamb["eval_loss"] / base["eval_loss"]
    return out


def _sync(e: dict[str, Any]) -> str:
    if "in_sync" not in e:
        return "-"
    text = "yes" if e["in_sync"] else ("differ*" if e.get("may_differ") else "**NO**")
    return text if e.get("buffers_in_sync", True) else text + " (buffers differ)"


def _flag(text: str, bad: bool) -> str:
    return f"**{text}**" if bad else text


def _worst(e: dict[str, Any], kind: str, limit: float | None) -> str:
    ratio = e.get(f"{kind}_ratio")
    if ratio is None:
        return "-"
    return (
        _flag(_ratio(ratio), limit is not None and not ratio <= limit) + f" (`{e[kind + '_name']}`)"
    )


def _row(model: str, ddp: dict[str, Any], run: str, e: dict[str, Any]) -> str:
    cells = [model, run, _fmt(ddp.get("eval_loss"))]
    if "error" in e:
        cells += [f"**{e['error']}**", "-", "-", "-", "-", "-", "-"]
    elif run == "ddp":
        cells += [_fmt(e.get("eval_loss")), "1", "1", "1", _sync(e), "-", "1"]
    else:
        loss = _flag(_ratio(e.get("loss_ratio")), not e.get("loss_ratio", math.inf) <= LOSS_LIMIT)
        if "loss_ratio_vs_lamb" in e:
            loss += f" ({_ratio(e['loss_ratio_vs_lamb'])} vs LAMB)"
        phase = e.get("phase")
        if phase is not None:
            steps = e.get("compressed_steps", 0)
            phase = f"{phase} ({_flag(str(steps), steps == 0 and run != LAMB_BASELINE)})"
        cells += [
            _fmt(e.get("eval_loss")),
            loss,
            _worst(e, "param", PARAM_LIMIT),
            _worst(e, "buffer", None),
            _sync(e),
            phase or "-",
            _ratio(e.get("bytes_ratio")),
        ]
    return "| " + " | ".join([*cells, f"{e['seconds']:.1f}"]) + " |"


def table(results: list[dict[str, Any]]) -> str:
    """Markdown, one row per model and run; in bold what a test would fail on: a loss above
    ``LOSS_LIMIT`` x DDP's, a parameter above ``PARAM_LIMIT`` x DDP's, ranks out of sync, no
    compression step, an error."""
    lines = [
        "| model | run | DDP eval loss | eval loss | loss / DDP | max \\|p\\| / DDP (param) "
        "| max \\|buffer\\| / DDP | ranks in sync | phase (compressed steps) | bytes / fp32 | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        ddp = res["runs"].get("ddp", {})
        for run, e in res["runs"].items():
            lines.append(_row(res["model"], ddp, run, e))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--algos", nargs="+", choices=ALGOS, default=list(ALGOS))
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: per model)")
    p.add_argument(
        "--lamb-lr", type=float, default=None, help="OneBitStrategy(lamb_lr=...) for 1-bit LAMB"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--verbose", action="store_true", help="keep Lightning's logs and warnings")
    args = p.parse_args()
    if not args.verbose:
        _quiet()
    results = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="user_models_") as tmp:
        for name in args.models:
            results.append(run_model(name, args.algos, args.steps, Path(tmp), args.lamb_lr))
    _log(f"total {time.perf_counter() - t0:.0f} s")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
