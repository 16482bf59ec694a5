"""The probe's predicted step times against measured training, on the emulated cluster.

    sudo .venv/bin/python benchmarks/probe_validation.py                       # the full matrix
    sudo .venv/bin/python benchmarks/probe_validation.py --cells 2x1/100mbit/4,2x2/1gbit/8

For each cell (layout ``NxL``: N nodes of L ranks, ``benchmarks/cluster.py``'s namespaces; link
rate; per-rank batch), side by side on the same cluster: ``lightning-onebit probe`` started in the
ranks' namespaces as a training job would be (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``,
``--model`` = :class:`ClusterGPT`, the benchmark's GPT with that batch), then the benchmark's
training loop (``benchmarks/cluster_worker.py``) with 1-bit Adam (two-level on nodes of several
ranks) and with DDP + Adam. Compared: the warmup and the compression phase's median step times
(the slowest rank's, first step of each phase skipped) and DDP's, with the miss
``predicted / measured - 1`` per cell. Writes ``benchmarks/results/<name>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import cluster  # noqa: E402
from benchmarks.cluster_worker import GPT, load_corpus  # noqa: E402

#: The full matrix (layout/rate/batch), in an order whose prefixes of 3 cover every layout and
#: rate, and of 6 both batches of each.
CELLS = (
    "2x1/1gbit/4", "4x1/100mbit/8", "2x2/10gbit/4",
    "2x1/100mbit/8", "4x1/10gbit/4", "2x2/1gbit/8",
    "2x1/10gbit/8", "4x1/1gbit/4", "2x2/100mbit/4",
    "2x1/1gbit/8", "4x1/100mbit/4", "2x2/10gbit/8",
    "2x1/100mbit/4", "4x1/10gbit/8", "2x2/1gbit/4",
    "2x1/10gbit/4", "4x1/1gbit/8", "2x2/100mbit/8",
)  # fmt: skip
#: the corpus the worker trains on (its vocabulary sets the parameter count)
CORPUS_BYTES = 2_000_000


class ClusterGPT(pl.LightningModule):
    """The cluster benchmark's GPT (``preset`` of ``cluster.MODELS``) as a LightningModule, with
    one rank's batch as ``example_input_array`` (what the probe times)."""

    def __init__(self, preset: str = "small", batch: int = 4) -> None:
        super().__init__()
        cfg = cluster.MODELS[preset]
        _, vocab = load_corpus(CORPUS_BYTES)
        self.net = GPT(vocab, cfg["block"], cfg["n_layer"], cfg["n_embd"], cfg["n_head"])
        idx = torch.randint(0, vocab, (batch, cfg["block"]))
        self.example_input_array = (idx, torch.roll(idx, -1, 1))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.net(idx, targets)


def _run_probe(
    c: cluster.Cluster, port: int, preset: str, batch: int, steps: int, warmup: int, tmp: Path
) -> dict[str, Any]:
    """The probe in the cluster's namespaces (one process per rank, as a launcher starts it)."""
    procs, logs, ll = [], [], c.per_node
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    for r in range(c.world_size):
        log = tmp / f"probe{r}.log"
        cmd = [
            "ip", "netns", "exec", c.ranks[r // ll], "env",
            f"MASTER_ADDR={c.addrs[0]}", f"MASTER_PORT={port}",
            f"RANK={r}", f"WORLD_SIZE={c.world_size}",
            f"LOCAL_RANK={r % ll}", f"LOCAL_WORLD_SIZE={ll}",
            f"GLOO_SOCKET_IFNAME={c.ifname}", "OMP_NUM_THREADS=1", "MKL_NUM_THREADS=1",
            f"PYTHONPATH={pythonpath}",
            sys.executable, "-m", "lightning_onebit.probe", "--json",
            "--model", "benchmarks.probe_validation:ClusterGPT",
            "--model-kwargs", json.dumps({"preset": preset, "batch": batch}),
            "--steps", str(steps), "--warmup-fraction", str(warmup / steps),
        ]  # fmt: skip
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT))
        logs.append(log)
    codes = [p.wait(timeout=900) for p in procs]
    if any(codes):
        bad = next(r for r, code in enumerate(codes) if code)
        raise RuntimeError(f"probe rank {bad} failed:\n{logs[bad].read_text()[-3000:]}")
    line = next(ln for ln in logs[0].read_text().splitlines() if ln.startswith("{"))
    return json.loads(line)


def _train(
    c: cluster.Cluster, port: int, method: str, preset: str, batch: int, steps: int, warmup: int,
    tmp: Path,
) -> dict[str, Any]:  # fmt: skip
    cfg = {
        "method": method,
        "model": cluster.MODELS[preset],
        "model_source": "builtin",
        "batch": batch,
        "steps": steps,
        "warmup": warmup,
        "eval_every": 0,
        "val_windows": 8,
        "lr": 1e-3,
        "lr_lamb": 1e-2,
        "betas": [0.9, 0.999],
        "threads": 1,
        "timeout": 600,
        "overlap_mb": 25.0,
        "average_dtype": "float32",
        "ranks_per_node": c.per_node,
        "seed": 0,
    }
    return cluster.summarize(c.launch(cfg, port, tmp, 1200), cfg)


def _miss(pred: float, meas: float | None) -> float | None:
    return None if not meas else pred / meas - 1


def _cell(p: float, m: float | None) -> str:
    miss = _miss(p, m)
    if miss is None:
        return f"{p:.3f} / — | —"
    flag = "" if abs(miss) <= 0.2 else " **miss**"
    return f"{p:.3f} / {m:.3f} | {miss:+.0%}{flag}"


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# The probe's predicted step times vs measured training (emulated cluster)",
        "",
        f"{meta['when']} · {meta['cpus']} CPUs (shared by all ranks) · model `{meta['preset']}` "
        f"({meta['numel']:,} params) · {meta['steps']} steps, warmup {meta['warmup']} · "
        "1 torch thread per rank · overlap buckets 25 MiB · `lightning-onebit probe --model` "
        "and the training loop (`benchmarks/cluster_worker.py`) back to back on the same "
        "namespaces and rate.",
        "",
        "Seconds per step, predicted / measured (median of the phase, slowest rank), and the "
        "miss = predicted / measured - 1. *1-bit*: 1-bit Adam, two-level on nodes of 2 ranks; "
        "*warmup*: its full-precision phase; *DDP*: DDP + torch Adam. *probe says*: its "
        "recommendation.",
        "",
        "| layout | rate | batch | 1-bit warmup | miss | 1-bit compression | miss | DDP | miss "
        "| probe says |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layout']} | {r['rate']} | {r['batch']} | failed: "
                         f"{r['error'].splitlines()[0][:80]} |||||||")  # fmt: skip
            continue
        lines.append(
            f"| {r['layout']} | {r['rate']} | {r['batch']} | "
            f"{_cell(r['pred_warmup'], r['meas_warmup'])} | "
            f"{_cell(r['pred_compression'], r['meas_compression'])} | "
            f"{_cell(r['pred_ddp'], r['meas_ddp'])} | {r['says']} |"
        )
    lines += [
        "",
        "Where the time goes, seconds, predicted / measured: *fwd+bwd* until the end of "
        "backward (predicted: the probe's forward + backward on every rank at once; measured: "
        "the step less *after bwd*), *after bwd* from the end of backward to the end of the "
        "step (predicted: the communication left exposed + the update; measured: the slowest "
        "rank's median in the training loop).",
        "",
        "| layout | rate | batch | warmup fwd+bwd | warmup after bwd | compression fwd+bwd "
        "| compression after bwd |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            continue
        key = "onebit_hier" if r["layout"].endswith("x2") else "onebit"
        pred, run = r["probe"]["methods"][key], r["onebit_run"]
        cells = []
        for ph in ("warmup", "compression"):
            p, after = pred[ph], run[f"after_backward_{ph}"]
            cells.append(f"{p['compute_s']:.3f} / {run[f'step_time_{ph}'] - after:.3f}")
            cells.append(f"{p['comm_exposed_s'] + p['update_s']:.3f} / {after:.3f}")
        lines.append(f"| {r['layout']} | {r['rate']} | {r['batch']} | " + " | ".join(cells) + " |")
    if meta.get("notes"):  # what the runs showed (written into the .json by hand)
        lines += ["", "## Notes", "", *meta["notes"]]
    return "\n".join(lines) + "\n"


def measure(
    c: cluster.Cluster, rate: str, batch: int, a: argparse.Namespace, port: int, tmp: Path
) -> dict[str, Any]:
    """One cell: the probe, then 1-bit Adam's and DDP's training, on the same cluster."""
    ll = c.per_node
    probe = _run_probe(c, port, a.preset, batch, a.steps, a.warmup, tmp)
    key = "onebit_hier" if ll > 1 else "onebit"
    method = "onebit_adam_hier" if ll > 1 else "onebit_adam"
    run = (a.preset, batch, a.steps, a.warmup, tmp)
    onebit = _train(c, port + 1, method, *run)
    ddp = None if a.no_ddp else _train(c, port + 2, "ddp_adam", *run)
    meth, rec = probe["methods"], probe["recommendation"]
    says = rec["choice"]
    if says != "stay with DDP":
        says += f" ({rec['step_speedup']:.2f}x)"
    return {
        "pred_warmup": meth[key]["warmup"]["step_s"],
        "pred_compression": meth[key]["compression"]["step_s"],
        "pred_ddp": meth["ddp"]["compression"]["step_s"],
        "meas_warmup": onebit["step_time_warmup"],
        "meas_compression": onebit["step_time_compression"],
        "meas_ddp": ddp and ddp["step_time_compression"],
        "says": says,
        "probe": probe,
        "onebit_run": {k: v for k, v in onebit.items() if not isinstance(v, list)},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cells",
        default=",".join(CELLS),
        help="layout/rate/batch, comma-separated, run in this order (layout NxL: N nodes of L "
        "ranks)",
    )
    p.add_argument("--preset", default="small", choices=sorted(cluster.MODELS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--no-ddp", action="store_true", help="skip the DDP runs")
    p.add_argument("--name", default="probe-validation")
    p.add_argument(
        "--update",
        action="store_true",
        help="keep the cells of the existing results/<name>.json, replacing those run again",
    )
    p.add_argument("--report", action="store_true", help="only rewrite the .md from the .json")
    a = p.parse_args(argv)
    out = ROOT / "benchmarks" / "results"
    if a.report:
        saved = json.loads((out / f"{a.name}.json").read_text())
        (out / f"{a.name}.md").write_text(markdown(saved["rows"], saved["meta"]))
        return 0
    cluster.check_netns()
    cluster.install_cleanup_handlers()
    rows: list[dict[str, Any]] = []
    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(),
        "preset": a.preset,
        "steps": a.steps,
        "warmup": a.warmup,
        "numel": 0,
    }
    if a.update:
        saved = json.loads((out / f"{a.name}.json").read_text())
        rows, meta["notes"] = saved["rows"], saved["meta"].get("notes", [])
    port = 29700 + os.getpid() % 200
    with tempfile.TemporaryDirectory(prefix="obprobe-") as tmp:
        for cell in a.cells.split(","):
            layout, rate, batch = cell.split("/")
            n, ll = (int(x) for x in layout.split("x"))
            row: dict[str, Any] = {"layout": layout, "rate": rate, "batch": int(batch)}
            t0, port = time.monotonic(), port + 3
            with cluster.Cluster(n * ll, ll) as c:
                c.set_rate(rate)
                try:
                    row.update(measure(c, rate, int(batch), a, port, Path(tmp)))
                    meta["numel"] = row["probe"]["measured"]["numel"]
                except (RuntimeError, StopIteration) as err:
                    row["error"] = str(err) or type(err).__name__
            shown = {k: v for k, v in row.items() if k not in ("probe", "onebit_run")}
            cluster._log(f"{shown} ({time.monotonic() - t0:.0f} s)")
            rows = [
                r
                for r in rows
                if r["layout"] != layout or (r["rate"], r["batch"]) != (rate, int(batch))
            ]
            rows.append(row)
            (out / f"{a.name}.json").write_text(
                json.dumps({"meta": meta, "rows": rows}, indent=1, default=float)
            )
            (out / f"{a.name}.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
