"""The table of e2e-int4-default-cluster-2026-12-04.md from cluster.py's JSON files:
``python analyse.py 's*.json'`` (100 Mbit/s) or ``'g0-*.json'`` (1 Gbit/s), in this folder.

Per seed and run: final loss against DDP's, training time, time to DDP's final loss and to
1.01x it (the first evaluation at or below, training time without evaluations) against DDP's own,
bytes per rank over the run, median step time per phase."""

import glob
import json
import sys


def first_time(row: dict, target: float) -> float | None:
    return next((e["train_time_s"] for e in row["evals"] if e["val_loss"] <= target), None)


def run_bytes(row: dict) -> float:
    warm = sum(1 for p in row["phases"] if p == "warmup")
    comp = len(row["phases"]) - warm
    return (row.get("bytes_warmup") or 0) * warm + (row.get("bytes_compression") or 0) * comp


def main(pattern: str) -> None:
    seeds: dict[int, dict[str, dict]] = {}
    for path in sorted(glob.glob(pattern)):
        with open(path) as f:
            data = json.load(f)
        variant = path.rsplit("-", 1)[-1].removesuffix(".json")
        for row in data["rows"]:
            name = row["method"] if row["method"] == "ddp_adam" else f"{row['method']}:{variant}"
            seeds.setdefault(data["meta"]["seed"], {})[name] = row
    print(
        "| seed | run | final loss (vs DDP) | train s | vs DDP | to DDP final | to DDP+1% "
        "| bytes/rank whole run | vs DDP | warm / comp s/step |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for seed, runs in sorted(seeds.items()):
        ddp = runs["ddp_adam"]
        loss, time = ddp["final_val_loss"], ddp["train_time_s"]
        to_final, to_1 = first_time(ddp, loss), first_time(ddp, 1.01 * loss)
        ddp_bytes = run_bytes(ddp)
        for name, row in runs.items():
            t_final, t_1 = first_time(row, loss), first_time(row, 1.01 * loss)
            final, b = row["final_val_loss"], run_bytes(row)
            print(
                f"| {seed} | {name} | {final:.4f} ({(final / loss - 1) * 100:+.1f}%) | "
                f"{row['train_time_s']:.1f} | {time / row['train_time_s']:.2f}x | "
                f"{to_final / t_final if t_final else float('nan'):.2f}x | "
                f"{to_1 / t_1 if t_1 else float('nan'):.2f}x | {b / 1e6:.1f} MB | "
                f"{ddp_bytes / b:.1f}x | {row.get('step_time_warmup') or 0:.3f} / "
                f"{row.get('step_time_compression') or 0:.3f} |"
            )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "s*.json")
