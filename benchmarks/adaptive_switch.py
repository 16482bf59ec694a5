"""When does the adaptive switch (``adaptive_freeze``) fire, and what does it cost in loss?

    python benchmarks/adaptive_switch.py                         # the cluster GPT and the zoo
    python benchmarks/adaptive_switch.py --models gpt_small conv_bn --json /tmp/a.json

Every ``window`` (50) optimizer steps of 1-bit Adam's warmup, the switch compares a fixed strided
sample of the variance with the one ``window`` steps before (``||now - before|| / ||now||``) and
switches once that is below ``threshold`` (0.05) on every rank. It compares the variance as the
switch would freeze it (``OneBitOptimizer.variance_as_frozen``: bias-corrected where the
optimizer folds the correction in, as the strategies build it); the table also gives the same
measure on the variance as stored, whose own growth ``1 - beta2**k`` keeps it above 0.05 until
about step 700 at ``beta2 = 0.999`` whatever the gradients do.

* ``gpt_small``: the GPT of ``benchmarks/cluster.py --model small`` on its data, batch 4 per rank
  at W = 4 (the end-to-end benchmark), as one process on the four ranks' batches together (16:
  the same average gradient), ``--gpt-steps`` (default 300, the benchmark's run) steps of
  warmup arithmetic; only the measure (it trains no further).
* every model of the user-model zoo (``tests/helpers/user_models.py``; 2 fork-started CPU
  ranks, the model's own steps, data and optimizer): fits under DDP, under
  ``OneBitStrategy()`` (the default switch, 0.2 of the run), and under
  ``OneBitStrategy(adaptive_freeze=True, freeze_step=0.9)`` (the adaptive switch decides, at the
  latest after 0.9 of the run), with the held-out loss of each and its ratio to DDP's.

Prints one table; ``--json`` also writes every measure.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `tests.helpers`, `benchmarks`

import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402

from lightning_onebit import OneBitStrategy  # noqa: E402
from lightning_onebit.optim import OneBitAdam, OneBitOptimizer  # noqa: E402
from tests.helpers.user_models import MODELS, compare, fit_user_model  # noqa: E402

WINDOW, THRESHOLD, SAMPLE = 50, 0.05, 1_000_000  # the strategies' defaults


def relative_change(before: torch.Tensor, now: torch.Tensor) -> float:
    """The switch's measure: ``||now - before|| / ||now||``."""
    return float((now - before).norm() / now.norm().clamp_min(1e-30))


def _samples(opt: OneBitOptimizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(the variance as frozen, as stored), the switch's strided sample of each."""
    v = opt.variance
    assert v is not None
    stride = max(1, v.numel() // SAMPLE)
    frozen = opt.variance_as_frozen(stride)
    assert frozen is not None
    return frozen, v[::stride].clone()


class Measure:
    """The relative change of both samples every ``WINDOW`` steps, and the first step where
    each is below ``THRESHOLD`` (``None``: not in this run)."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.frozen: list[float] = []
        self.stored: list[float] = []
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None

    def after_step(self, opt: OneBitOptimizer) -> None:
        if opt.step_count % WINDOW or opt.phase != opt.PHASES[0]:
            return
        now = _samples(opt)
        if self._last is not None:
            self.steps.append(opt.step_count)
            self.frozen.append(relative_change(self._last[0], now[0]))
            self.stored.append(relative_change(self._last[1], now[1]))
        self._last = now

    def fires(self, which: str) -> int | None:
        values = self.frozen if which == "frozen" else self.stored
        return next((s for s, c in zip(self.steps, values, strict=True) if c < THRESHOLD), None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "change_frozen": self.frozen,
            "change_stored": self.stored,
            "fires_frozen": self.fires("frozen"),
            "fires_stored": self.fires("stored"),
        }


class _MeasureCallback(Callback):
    """Rank 0 measures after every optimizer step (before the strategy's switch callback, which
    the strategy appends after the Trainer's callbacks) and saves the measure at the end."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.measure = Measure()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_rank == 0:
            self.measure.after_step(trainer.strategy.onebit_optimizer)  # type: ignore[attr-defined]

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps(self.measure.as_dict()))


def gpt_small(steps: int) -> dict[str, Any]:
    """The cluster benchmark's ``small`` GPT: the measure over ``steps`` warmup steps on the four
    ranks' batches of its W = 4, batch 4 run (seed 0)."""
    from benchmarks.cluster_worker import _batch, build

    cfg = {"model": {"n_layer": 4, "n_embd": 256, "n_head": 4, "block": 128}, "seed": 0}
    model, tokens, _ = build(cfg)
    block, world, batch = 128, 4, 4
    offsets = []
    for rank in range(world):  # each rank's stream, as benchmarks/cluster_worker.py draws it
        gen = torch.Generator().manual_seed(17 + rank)
        offsets.append(torch.randint(0, len(tokens) - block - 1, (steps, batch), generator=gen))
    opt = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=10**9, bias_correction=True)
    measure = Measure()
    for k in range(steps):
        x, y = _batch(tokens, torch.cat([o[k] for o in offsets]), block)
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        opt.step()
        measure.after_step(opt)
    return measure.as_dict()


def zoo_model(name: str, tmp: Path) -> dict[str, Any]:
    """DDP, the default switch and the adaptive switch on one zoo model."""
    out: dict[str, Any] = {}
    runs = {
        "ddp": lambda: "ddp_notebook",
        "default": lambda: OneBitStrategy(start_method="fork"),
        "adaptive": lambda: OneBitStrategy(
            adaptive_freeze=True, freeze_step=0.9, start_method="fork"
        ),
    }
    records = {}
    for run, make in runs.items():
        t0 = time.perf_counter()
        callbacks = [_MeasureCallback(tmp / f"{name}-measure.json")] if run == "adaptive" else []
        records[run] = fit_user_model(name, make(), tmp / name / run, callbacks=callbacks)
        out[run] = {
            "eval_loss": max(r["eval_loss"] for r in records[run]),
            "steps": records[run][0]["global_step"],
            "seconds": time.perf_counter() - t0,
        }
        if run != "ddp":
            out[run].update(compare(records["ddp"], records[run]))
        print(f"[adaptive_switch] {name} / {run}: {out[run]['seconds']:.0f} s", file=sys.stderr)
    out["measure"] = json.loads((tmp / f"{name}-measure.json").read_text())
    return out


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def table(gpt: dict[str, Any] | None, zoo: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| model | steps | fires (as frozen) | fires (as stored) | change at 100 / 150 / 200 "
        "(as frozen) | loss vs DDP: default 0.2 | adaptive | adaptive's switch |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]

    def at(m: dict[str, Any]) -> str:
        by = dict(zip(m["steps"], m["change_frozen"], strict=True))
        return " / ".join(_fmt(by.get(s), ".3f") for s in (100, 150, 200))

    def fires(m: dict[str, Any], key: str, steps: int) -> str:
        return str(m[key]) if m[key] is not None else f"not in {steps}"

    if gpt is not None:
        n = gpt["steps"][-1] if gpt["steps"] else 0
        lines.append(
            f"| gpt_small (W=4 x 4) | {n} | {fires(gpt, 'fires_frozen', n)} | "
            f"{fires(gpt, 'fires_stored', n)} | {at(gpt)} | - | - | - |"
        )
    for name, r in zoo.items():
        m, n = r["measure"], r["ddp"]["steps"]
        switch = n - r["adaptive"]["compressed_steps"]
        lines.append(
            f"| {name} | {n} | {fires(m, 'fires_frozen', n)} | {fires(m, 'fires_stored', n)} | "
            f"{at(m)} | {_fmt(r['default']['loss_ratio'])} | {_fmt(r['adaptive']['loss_ratio'])} "
            f"| after step {switch} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--models", nargs="+", choices=["gpt_small", *MODELS], default=["gpt_small", *MODELS]
    )
    p.add_argument("--gpt-steps", type=int, default=300)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    gpt = gpt_small(args.gpt_steps) if "gpt_small" in args.models else None
    zoo = {}
    with tempfile.TemporaryDirectory(prefix="adaptive_switch_") as tmp:
        for name in args.models:
            if name != "gpt_small":
                zoo[name] = zoo_model(name, Path(tmp))
    print(table(gpt, zoo))
    if args.json:
        args.json.write_text(json.dumps({"gpt_small": gpt, "zoo": zoo}, indent=1))


if __name__ == "__main__":
    main()
