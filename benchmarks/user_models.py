"""The user-model zoo under DDP and the 1-bit strategies: does each one train like DDP does?

    python benchmarks/user_models.py                                  # all models, all algorithms
    python benchmarks/user_models.py --models conv_bn gpt2 --algos onebit_adam --steps 100
    python benchmarks/user_models.py --json /tmp/zoo.json             # also write the results
    python benchmarks/user_models.py --seeds 0 1 2                    # + every seed's ratios
    python benchmarks/user_models.py --strategy-option rescale_variance=False  # another option

Every model of ``tests/helpers/user_models.py`` (plain LightningModules whose ``configure_optimizers``
returns ``torch.optim.Adam``/``AdamW``: a conv net with BatchNorm, an MLP with dead ReLUs,
``nn.MultiheadAttention``, a regression MLP, tied embeddings, and Hugging Face GPT-2, BERT (a
classifier, and a masked LM under ``bf16-mixed``), ResNet and ViT) is trained on 2 fork-started
CPU ranks (gloo), from the same seed on the same batches, at the model's precision, under

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
sys.path.insert(0, str(ROOT))  # `tests.helpers`

from lightning_onebit import OneBitStrategy  # noqa: E402
from tests.helpers.cluster import cluster_module  # noqa: E402
from tests.helpers.user_models import MODELS, compare, fit_user_model, ranks_in_sync  # noqa: E402

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


def _strategies(
    algos: list[str], lamb_lr: float | None = None, options: dict[str, Any] | None = None
) -> dict[str, Any]:
    runs: dict[str, Any] = {"ddp": lambda: "ddp_notebook"}
    lamb = {"lamb_lr": lamb_lr}
    extra = options or {}
    for a in algos:
        kw = {**(lamb if a == "onebit_lamb" else {}), **extra}
        runs[a] = lambda a=a, kw=kw: OneBitStrategy(algorithm=a, start_method="fork", **kw)
    if "onebit_lamb" in algos:
        runs[LAMB_BASELINE] = lambda: OneBitStrategy(
            algorithm="onebit_lamb", start_method="fork", **{**lamb, **extra, "freeze_step": 10**9}
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
    name: str,
    algos: list[str],
    steps: int | None,
    tmp: Path,
    lamb_lr: float | None = None,
    seed: int = 0,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {"model": name, "seed": seed, "options": options or {}, "runs": {}}
    records: dict[str, list[dict]] = {}
    for run, make in _strategies(algos, lamb_lr, options).items():
        t0 = time.perf_counter()
        entry: dict[str, Any] = {}
        try:
            records[run] = fit_user_model(
                name, make(), tmp / name / run.split()[0], steps=steps, seed=seed
            )
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
            f"{name} (seed {seed}) / {run}: {entry['seconds']:.1f} s, "
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


def _cell(entries: list[dict[str, Any]]) -> str:
    """``loss / DDP`` and ``max |p| / DDP`` of one model and run over the seeds (in seed order,
    ``/``-separated; bold past the test bars)."""
    if any("error" in e or "loss_ratio" not in e for e in entries):
        return "**error**"
    loss = "/".join(
        _flag(f"{e['loss_ratio']:.2f}", not e["loss_ratio"] <= LOSS_LIMIT) for e in entries
    )
    param = "/".join(
        _flag(f"{e['param_ratio']:.1f}", not e["param_ratio"] <= PARAM_LIMIT) for e in entries
    )
    return f"{loss} \\| {param}x"


def seeds_table(results: list[dict[str, Any]]) -> str:
    """One row per model, one column per 1-bit run: every seed's held-out loss ÷ DDP's and
    largest ``max |p|`` ÷ DDP's (1-bit LAMB also ÷ LAMB never frozen, in parentheses)."""
    seeds = sorted({r["seed"] for r in results})
    models = list(dict.fromkeys(r["model"] for r in results))
    runs = [k for k in results[0]["runs"] if k not in ("ddp", LAMB_BASELINE)]
    lines = [
        f"| model (seeds {', '.join(map(str, seeds))}) | "
        + " | ".join(f"{r}: loss / DDP \\| max \\|p\\| / DDP" for r in runs)
        + " |",
        "|---" * (len(runs) + 1) + "|",
    ]
    for m in models:
        by_seed = sorted((r for r in results if r["model"] == m), key=lambda r: r["seed"])
        cells = []
        for run in runs:
            entries = [r["runs"].get(run, {"error": "missing"}) for r in by_seed]
            cell = _cell(entries)
            if run == "onebit_lamb" and all("loss_ratio_vs_lamb" in e for e in entries):
                vs = "/".join(f"{e['loss_ratio_vs_lamb']:.2f}" for e in entries)
                cell += f" (vs LAMB {vs})"
            cells.append(cell)
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
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
    p.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=[0],
        help="model seeds (initial weights; the data order stays); several add a table of "
        "every seed's ratios",
    )
    p.add_argument(
        "--strategy-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more OneBitStrategy option for every 1-bit run (a Python literal, e.g. "
        "rescale_variance=False); repeatable",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--verbose", action="store_true", help="keep Lightning's logs and warnings")
    args = p.parse_args()
    try:
        parse = cluster_module().parse_strategy_option
        options = dict(parse(o) for o in args.strategy_option)
    except ValueError as err:
        p.error(str(err))
    if not args.verbose:
        _quiet()
    results = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="user_models_") as tmp:
        for seed in args.seeds:
            for name in args.models:
                results.append(
                    run_model(name, args.algos, args.steps, Path(tmp), args.lamb_lr, seed, options)
                )
    _log(f"total {time.perf_counter() - t0:.0f} s")
    for seed in args.seeds:
        if len(args.seeds) > 1:
            print(f"\nseed {seed}:\n")
        print(table([r for r in results if r["seed"] == seed]))
    if len(args.seeds) > 1:
        print("\nevery seed:\n")
        print(seeds_table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
