"""A long run stays steady: 10,000+ compressed steps of a small model on 2 ranks, recording every
500 steps each rank's resident memory, open file descriptors, live threads and step time::

    python benchmarks/soak.py                            # 10,100 steps, then the checkpoint run
    python benchmarks/soak.py --steps 2000 --algorithm zero_one_adam --no-overlap
    python benchmarks/soak.py --skip-checkpoints --name soak-quick

Two runs, each under Lightning's popen launcher (this script re-run as rank 1, as a user's
script is), ``Trainer(strategy=OneBitStrategy(...))``, compression from step 100 on:

1. ``plain``: ``--steps`` steps, no checkpoints.
2. ``checkpoints``: the same with a checkpoint every 1,000 steps (``ModelCheckpoint``, every one
   kept: the per-rank files included), stopped at half the steps; then ``resume``: a new pair of
   processes resumes from the last checkpoint and trains to ``--steps``.

Every 500 steps each rank records (from ``/proc/self``): RSS (MiB), open fds, live threads (the
process's native threads: Python's, gloo's, OpenMP's, ours) and the mean step time of the last
500 steps (ms). Flat means no growth beyond noise: the last record minus the first one after
warm-up (step 1,000) is reported per rank. Writes ``benchmarks/results/<name>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_onebit import OneBitStrategy

ROOT = Path(__file__).resolve().parents[1]
EVERY = 500
FREEZE_STEP = 100


class Mlp(L.LightningModule):
    """A small regression MLP (~70k parameters) that returns AdamW, as a user's module does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(),
            torch.nn.Linear(256, 1),
        )  # fmt: skip

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, betas=(0.9, 0.95))


def _proc_stats() -> dict[str, float]:
    """This process's RSS (MiB), open fds and native threads, from /proc/self."""
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    return {
        "rss_mib": rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20,
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
    }


class Recorder(Callback):
    """Every ``EVERY`` steps: this rank's stats and the mean step time since the last record."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, float]] = []
        self._t = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if step % EVERY:
            return
        now = time.perf_counter()
        self.rows.append({"step": step, **_proc_stats(), "step_ms": (now - self._t) / EVERY * 1e3})
        self._t = now
        self.path.write_text(json.dumps(self.rows))


def train(args: argparse.Namespace) -> None:
    """One fit (this process is one rank of it)."""
    torch.manual_seed(1)
    x = torch.randn(8192, 32)
    y = (x[:, :8].sum(1, keepdim=True)).sin() + 0.1 * torch.randn(8192, 1)
    strategy = OneBitStrategy(
        args.algorithm,
        freeze_step=FREEZE_STEP,
        overlap_bucket_mb=0.05 if not args.no_overlap else None,  # (several buckets)
    )
    callbacks: list[Callback] = []
    out = Path(args.out)
    trainer_kw: dict[str, Any] = {"enable_checkpointing": False}
    if args.checkpoint_dir:
        trainer_kw = {"enable_checkpointing": True, "default_root_dir": args.checkpoint_dir}
        callbacks.append(
            ModelCheckpoint(
                dirpath=args.checkpoint_dir, every_n_train_steps=1000, save_top_k=-1,
                save_last=True,
            )
        )  # fmt: skip
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=args.stop_at or args.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **trainer_kw,
    )
    recorder = Recorder(out / f"{args.phase}-rank{trainer.global_rank}.json")
    trainer.callbacks.append(recorder)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    trainer.fit(Mlp(), loader, ckpt_path="last" if args.resume else None)
    opt = trainer.strategy.onebit_optimizer
    info = {"phase": opt.phase, "compression_steps": opt.step_count - FREEZE_STEP}
    (out / f"{args.phase}-rank{trainer.global_rank}-end.json").write_text(json.dumps(info))


def _launch(args: argparse.Namespace, out: Path, phase: str, *extra: str) -> float:
    cmd = [sys.executable, __file__, "--rank-run", "--out", str(out), "--phase", phase]
    cmd += ["--algorithm", args.algorithm, "--steps", str(args.steps), *extra]
    cmd += ["--no-overlap"] if args.no_overlap else []
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, cwd=ROOT)
    return time.monotonic() - t0


def _read(out: Path, phase: str) -> dict[int, list[dict[str, float]]]:
    return {r: json.loads((out / f"{phase}-rank{r}.json").read_text()) for r in (0, 1)}


def _table(phase: str, rows: dict[int, list[dict[str, float]]]) -> list[str]:
    lines = [
        f"### {phase}",
        "",
        "| step | RSS MiB r0 / r1 | fds r0 / r1 | threads r0 / r1 | step ms r0 / r1 |",
        "|---:|---:|---:|---:|---:|",
    ]
    for a, b in zip(rows[0], rows[1], strict=False):
        lines.append(
            f"| {a['step']} | {a['rss_mib']:.1f} / {b['rss_mib']:.1f} | {a['fds']} / {b['fds']} | "
            f"{a['threads']} / {b['threads']} | {a['step_ms']:.2f} / {b['step_ms']:.2f} |"
        )
    return [*lines, ""]


def _growth(rows: list[dict[str, float]]) -> dict[str, float]:
    """Last record minus the first one at or after step 1,000 (warm-up: allocator, buffers)."""
    base = next((r for r in rows if r["step"] >= 1000), rows[0])
    last = rows[-1]
    return {
        "from_step": base["step"],
        "to_step": last["step"],
        "rss_mib": round(last["rss_mib"] - base["rss_mib"], 2),
        "fds": last["fds"] - base["fds"],
        "threads": last["threads"] - base["threads"],
        "step_ms": round(last["step_ms"] - base["step_ms"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10_100)  # 10,000 compressed
    parser.add_argument("--algorithm", default="onebit_adam")
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--skip-checkpoints", action="store_true")
    parser.add_argument("--name", default=None, help="results file name (default soak-ALGO)")
    # (internal: one fit, as one rank)
    parser.add_argument("--rank-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-dir", help=argparse.SUPPRESS)
    parser.add_argument("--stop-at", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_run:
        train(args)
        return

    name = args.name or f"soak-{args.algorithm}{'-no-overlap' if args.no_overlap else ''}"
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.node()} · {os.cpu_count()} CPUs · torch {torch.__version__}",
        "algorithm": args.algorithm,
        "overlap": not args.no_overlap,
        "steps": args.steps,
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        phases = [("plain", ())]
        if not args.skip_checkpoints:
            ckpt = str(out / "ckpt")
            half = str(args.steps // 2)
            phases += [
                ("checkpoints", ("--checkpoint-dir", ckpt, "--stop-at", half)),
                ("resume", ("--checkpoint-dir", ckpt, "--resume")),
            ]
        for phase, extra in phases:
            seconds = _launch(args, out, phase, *extra)
            rows = _read(out, phase)
            end = {r: json.loads((out / f"{phase}-rank{r}-end.json").read_text()) for r in (0, 1)}
            results["runs"][phase] = {
                "seconds": round(seconds, 1),
                "rows": rows,
                "end": end,
                "growth": {r: _growth(rows[r]) for r in (0, 1)},
            }
            print(
                f"{phase}: {seconds:.0f} s, growth {results['runs'][phase]['growth']}", flush=True
            )
        if not args.skip_checkpoints:
            results["checkpoint_files"] = sorted(p.name for p in (out / "ckpt").iterdir())

    lines = [
        f"# Soak: {args.steps} steps, {args.algorithm}"
        f" (overlap {'on' if not args.no_overlap else 'off'}), 2 ranks",
        "",
        f"{results['date']} · {results['machine']} · `python benchmarks/soak.py"
        f"{' --steps ' + str(args.steps) if args.steps != 10_100 else ''}"
        f" --algorithm {args.algorithm}{' --no-overlap' if args.no_overlap else ''}`",
        "",
        f"A {sum(p.numel() for p in Mlp().parameters()):,}-parameter MLP, batch 32 per rank, "
        f"Lightning's popen launcher, compression from step {FREEZE_STEP + 1} on. Every "
        f"{EVERY} steps per rank: RSS, open fds, native threads, mean step time of the last "
        f"{EVERY} steps (the first record includes setup). Growth: last record minus the first "
        "at or after step 1,000.",
        "",
        "| run | seconds | compressed steps | RSS growth MiB r0 / r1 | fds | threads "
        "| step ms change r0 / r1 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for phase, run in results["runs"].items():
        g0, g1 = run["growth"][0], run["growth"][1]
        lines.append(
            f"| {phase} (steps {g0['from_step']}→{g0['to_step']}) | {run['seconds']} | "
            f"{run['end'][0]['compression_steps']} | {g0['rss_mib']:+.1f} / {g1['rss_mib']:+.1f} "
            f"| {g0['fds']:+d} / {g1['fds']:+d} | {g0['threads']:+d} / {g1['threads']:+d} | "
            f"{g0['step_ms']:+.2f} / {g1['step_ms']:+.2f} |"
        )
    lines.append("")
    for phase, run in results["runs"].items():
        lines += _table(phase, run["rows"])
    if "checkpoint_files" in results:
        lines += [f"Checkpoint files at the end: {', '.join(results['checkpoint_files'])}", ""]
    dest = ROOT / "benchmarks" / "results"
    (dest / f"{name}.md").write_text("\n".join(lines))
    (dest / f"{name}.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
