"""Train the same GPT with fp32 DDP and with each 1-bit algorithm; compare loss and bytes.

    python examples/compare.py            # 5 runs x 300 steps on 4 local CPU processes (minutes)
    python examples/compare.py --quick    # 5 runs x 60 steps on 2 processes (a smoke test)
    python examples/compare.py --strategy-option average_dtype=int4   # an option of the 1-bit runs
    python examples/compare.py --seed 1   # every run from another seed (default: the configs')

Each run is ``python examples/train.py fit --config examples/configs/<run>.yaml`` in a
subprocess (Lightning starts the ranks; you see its progress bar), with the same steps, devices
and validation schedule for all. Rank 0 of each run writes a JSON record (``RunSummary`` in
``train.py``); this script reads them, prints a markdown table and plots:

* validation loss vs training samples seen, and
* cumulative bytes sent per rank vs step,

to ``<out>/compare.png`` (``<out>`` = ``runs/compare`` by default). Bytes of the 1-bit runs are
the optimizers' own counters (``comm_stats``: exactly what was handed to the collectives,
uncompressed warmup included); bytes of the DDP runs are those of an fp32 ring allreduce of the
gradients, ``2 (W - 1) / W * 4`` bytes per parameter per step.

The LAMB baseline is the 1-bit LAMB config with ``strategy=ddp`` and ``model.optimizer=lamb``:
plain LAMB (see ``GPT.configure_optimizers``) with exactly 1-bit LAMB's hyperparameters.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FREEZE_FRACTION = 0.2  # the configs' freeze_step: the 1-bit warmup is 20% of the steps

# name, config, extra CLI arguments, 1-bit strategy it needs (None: plain DDP), its baseline
RUNS = [
    ("DDP + AdamW", "ddp_adam.yaml", [], None, None),
    ("1-bit Adam", "onebit_adam.yaml", [], "onebit_adam", "DDP + AdamW"),
    ("0/1 Adam", "zero_one_adam.yaml", [], "zero_one_adam", "DDP + AdamW"),
    (
        "DDP + LAMB",
        "onebit_lamb.yaml",
        ["--trainer.strategy", "ddp", "--model.optimizer", "lamb"],
        None,
        None,
    ),
    ("1-bit LAMB", "onebit_lamb.yaml", [], "onebit_lamb", "DDP + LAMB"),
]


def available_strategies() -> set[str]:
    """The 1-bit strategy names that ``import lightning_onebit`` registers in this install."""
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_onebit

    if not hasattr(lightning_onebit, "OneBitStrategy"):
        return set()
    return {
        name for name in ("onebit_adam", "zero_one_adam", "onebit_lamb") if name in StrategyRegistry
    }


def run_one(name: str, config: str, extra: list[str], args, out: Path) -> dict | None:
    json_path = out / (name.replace(" ", "_").replace("/", "").replace("+", "").lower() + ".json")
    json_path.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        str(HERE / "train.py"),
        "fit",
        "--config",
        str(HERE / "configs" / config),
        *extra,
        *(["--model.weight_decay", str(args.weight_decay)] if args.weight_decay else []),
        *(["--seed_everything", str(args.seed)] if args.seed is not None else []),
        "--trainer.devices",
        str(args.devices),
        "--trainer.max_steps",
        str(args.steps),
        "--trainer.val_check_interval",
        str(args.val_every),
        "--trainer.default_root_dir",
        str(json_path.with_suffix("")),
        "--summary.json_path",
        str(json_path),
    ]
    print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.call(cmd)
    wall = time.perf_counter() - t0
    if rc != 0 or not json_path.exists():
        print(f"=== {name} FAILED (exit code {rc}); left out of the table", flush=True)
        return None
    record = json.loads(json_path.read_text())
    record["wall_s"] = wall
    return record


def compression_ratio(record: dict, baseline: dict, after_step: int) -> float | None:
    """fp32 DDP bytes / this run's bytes over the steps after ``after_step`` (the 1-bit phase)."""
    ours, ddp = record["bytes_curve"], baseline["bytes_curve"]
    if len(ours) <= after_step or len(ddp) != len(ours):
        return None
    sent = ours[-1] - ours[after_step - 1]
    return (ddp[-1] - ddp[after_step - 1]) / sent if sent else math.inf


def table(results: dict[str, dict], freeze: int) -> str:
    rows = [
        "| run | final val loss | vs baseline | steps/s | MB sent per rank | "
        "fewer bytes than fp32 DDP (whole run) | (after step " + str(freeze) + ") | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ddp = results.get("DDP + AdamW")
    for name, _, _, _, base_name in RUNS:
        r = results.get(name)
        if r is None:
            continue
        base = results.get(base_name) if base_name else None
        loss = r["final_val_loss"]
        rel = f"{100 * (loss / base['final_val_loss'] - 1):+.1f}%" if base else "baseline"
        whole = (
            r["fp32_ddp_bytes_per_rank"] / r["bytes_per_rank"] if r["bytes_per_rank"] else math.inf
        )
        phase = compression_ratio(r, ddp, freeze) if ddp else None
        rows.append(
            f"| {name} | {loss:.4f} | {rel} | {r['steps_per_s']:.2f} | "
            f"{r['bytes_per_rank'] / 1e6:.1f} | {whole:.1f}x | "
            f"{'' if phase is None else f'{phase:.1f}x'} | {r['wall_s']:.0f} |"
        )
    return "\n".join(rows)


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in results.items():
        # baselines thick and solid, 1-bit runs thin and dashed: curves that coincide stay visible
        style = {"lw": 3, "alpha": 0.6} if name.startswith("DDP") else {"lw": 1.5, "ls": "--"}
        curve = r["val_curve"]
        samples, losses = [c["samples"] for c in curve], [c["val_loss"] for c in curve]
        ax_loss.plot(samples, losses, marker="o", label=name, **style)
        steps = range(1, len(r["bytes_curve"]) + 1)
        ax_bytes.plot(steps, [b / 1e6 for b in r["bytes_curve"]], label=name, **style)
    ax_loss.set(xlabel="training samples (all ranks)", ylabel="validation loss (nats/byte)")
    ax_loss.set_title("Validation loss")
    ax_bytes.set(xlabel="step", ylabel="MB sent per rank (cumulative)")
    ax_bytes.set_title("Communication")
    for ax in (ax_loss, ax_bytes):
        ax.grid(alpha=0.3)
        ax.legend()
    world = next(iter(results.values()))["world_size"]
    fig.suptitle(f"byte-level GPT on the Python standard library, {world} CPU processes (gloo)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="60 steps on 2 processes")
    parser.add_argument("--devices", type=int, help="local processes per run (default 4; 2 quick)")
    parser.add_argument("--steps", type=int, help="training steps per run (default 300; 60 quick)")
    parser.add_argument("--out", type=Path, default=Path("runs/compare"), help="output folder")
    parser.add_argument("--only", nargs="*", help="run only these (e.g. --only 'DDP + AdamW')")
    parser.add_argument(
        "--seed", type=int, help="the seed of every run (default: the configs' 1234)"
    )
    parser.add_argument(
        "--weight-decay",
        type=float,
        default=0.0,
        help="the model's weight decay (above 0: two param groups, matrices decayed; default 0)",
    )
    parser.add_argument(
        "--strategy-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an OneBitStrategy option for the 1-bit runs (repeatable), e.g. average_dtype=int4",
    )
    args = parser.parse_args()
    args.devices = args.devices or (2 if args.quick else 4)
    args.steps = args.steps or (60 if args.quick else 300)
    args.val_every = max(1, args.steps // 6)
    freeze = round(FREEZE_FRACTION * args.steps)
    args.out.mkdir(parents=True, exist_ok=True)

    available = available_strategies()
    results: dict[str, dict] = {}
    for name, config, extra, needs, _ in RUNS:
        if args.only and name not in args.only:
            continue
        if needs and needs not in available:
            print(
                f"\n=== {name}: skipped: strategy {needs!r} is not registered by this "
                "lightning_onebit (it needs lightning_onebit.OneBitStrategy)",
                flush=True,
            )
            continue
        if needs:
            for option in args.strategy_option:
                key, _, value = option.partition("=")
                extra = [*extra, f"--trainer.strategy.init_args.{key}", value]
        record = run_one(name, config, extra, args, args.out)
        if record is not None:
            results[name] = record
    if not results:
        sys.exit("no run finished")

    md = table(results, freeze)
    png = args.out / "compare.png"
    plot(results, png)
    (args.out / "compare.md").write_text(md + "\n")
    print(
        f"\n{args.steps} steps on {args.devices} processes; 1-bit warmup: {freeze} steps\n\n{md}\n\n"
        f"plot: {png.resolve()}\ntable: {(args.out / 'compare.md').resolve()}"
    )


if __name__ == "__main__":
    main()
