"""Runs that one rank kills finish, and finish exactly: ``torchrun --max-restarts 1`` restarts
both ranks from the last checkpoint, and every rank must end with the parameters of a run that
was never interrupted::

    python scripts/restart_check.py [--runs 20] [--strategies onebit_adam,ddp]
        [--rendezvous static,c10d] [--phases warmup,compression] [--hang-after 240] [--json PATH]

Each run is ``tests/scripts/restart_fit.py`` (a small attention model, 160 steps, the switch to
1-bit compression after step 80, ``last.ckpt`` every 40 steps) under ``torchrun --nproc-per-node 2
--max-restarts 1``, with the static rendezvous (``--master-port``) or the c10d one
(``--rdzv-backend c10d``). Rank 1 SIGKILLs itself once, after step 57 (``warmup``) or step 130
(``compression``); torchrun stops rank 0 and starts both again, and they resume from step 40 or
120. A run counts as

* ``exact``: exit 0 and every rank's parameters bitwise those of the uninterrupted run (one per
  strategy and rendezvous, run first);
* ``differs``: exit 0, other parameters;
* ``failed``: a non-zero exit (the reason: the first line of the output that names one);
* ``hang``: still running after ``--hang-after`` seconds (then killed).

``--strategies torch`` runs ``tests/scripts/restart_plain.py`` instead: the same kill and
restart with ``torch.distributed`` alone (``env://``, all-reduces), which shows what torch's own
restarts do here.

Prints one table row per strategy, phase and rendezvous, and exits 1 if a 1-bit strategy hung or
finished fewer runs exactly than ``strategy="ddp"`` did in the same cell (``ddp`` is the
reference: it is Lightning's and torch's restart), or, with no ``ddp`` in the check, fewer than
all of its runs (``.ci/run`` runs a short check of that kind).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "restart_fit.py"
PLAIN = ROOT / "tests" / "scripts" / "restart_plain.py"
KILL_AT = {"warmup": 57, "compression": 130}
#: lines that name why a run failed, most specific first
REASONS = (
    r"RankFileError.*",
    r"could not create .*process group.*",
    r"connectFullMesh failed.*",
    r"DistStoreError.*",
    r"DistNetworkError.*",
    r"Connection refused.*",
    r"RendezvousTimeoutError.*",
    r"\w+Error: .*",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(strategy: str, rendezvous: str, out: Path, kill_at: int | None) -> list[str]:
    port = _free_port()
    if rendezvous == "static":
        rdzv = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    else:
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", out.name]  # fmt: skip
    args = [str(PLAIN), str(out)] if strategy == "torch" else [str(SCRIPT), strategy, str(out)]
    args += [] if kill_at is None else ["--kill-at", str(kill_at)]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--max-restarts", "1", *rdzv, *args]  # fmt: skip


def _kill_tree(out: Path) -> None:
    """SIGKILL every process of a run: torchrun's workers have sessions of their own, so the
    run's output folder on their command line is what finds them."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and str(out) in cmdline.split("\0"):
            with contextlib.suppress(OSError):
                os.kill(int(proc.name), signal.SIGKILL)


def _run(cmd: list[str], out: Path, hang_after: float) -> tuple[str, str, float]:
    """(``"exit0"`` / ``"failed"`` / ``"hang"``, the output, seconds)."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(out / "output.txt", "w") as log:  # (a pipe would stay open in orphaned workers)
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        )
        try:
            proc.wait(timeout=hang_after)
            status = "exit0" if proc.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            status = "hang"
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    _kill_tree(out)  # (also workers left behind by a torchrun that exited)
    return status, (out / "output.txt").read_text(errors="replace"), time.perf_counter() - t0


def _reason(output: str) -> str:
    for pattern in REASONS:
        found = re.search(pattern, output)
        if found:
            return found.group(0)[:160]
    return "no error line"


def _params(out: Path) -> list[dict[str, torch.Tensor]] | None:
    files = [out / f"final-rank{r}.pt" for r in range(2)]
    if not all(f.exists() for f in files):
        return None
    return [torch.load(f, weights_only=True) for f in files]


def _same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    return all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("::")[0])
    p.add_argument("--runs", type=int, default=20, help="killed runs per cell")
    p.add_argument("--strategies", default="onebit_adam,ddp")
    p.add_argument("--rendezvous", default="static,c10d")
    p.add_argument("--phases", default="warmup,compression")
    p.add_argument("--hang-after", type=float, default=240.0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--logs", type=Path, default=None, help="keep the output of every bad run here")
    a = p.parse_args()
    strategies, rdzvs, phases = (s.split(",") for s in (a.strategies, a.rendezvous, a.phases))
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="restart-check-") as tmp:
        for strategy in strategies:
            for rdzv in rdzvs:
                ref_dir = Path(tmp) / f"ref-{strategy}-{rdzv}"
                status, output, _ = _run(
                    _command(strategy, rdzv, ref_dir, None), ref_dir, a.hang_after
                )
                reference = _params(ref_dir)
                if status != "exit0" or reference is None:
                    print(f"{strategy} {rdzv}: the uninterrupted run {status}: {_reason(output)}")
                    sys.exit(1)
                for phase in phases:
                    counts: Counter[str] = Counter()
                    reasons: Counter[str] = Counter()
                    seconds = []
                    for i in range(a.runs):
                        out = Path(tmp) / f"{strategy}-{rdzv}-{phase}-{i}"
                        cmd = _command(strategy, rdzv, out, KILL_AT[phase])
                        status, output, secs = _run(cmd, out, a.hang_after)
                        seconds.append(secs)
                        if status == "exit0":
                            got = _params(out)
                            status = (
                                "exact" if got is not None and _same(got, reference) else "differs"
                            )
                        counts[status] += 1
                        if status != "exact":
                            reasons[f"{status}: {_reason(output)}"] += 1
                            if a.logs is not None:
                                a.logs.mkdir(parents=True, exist_ok=True)
                                (a.logs / f"{out.name}-{status}.log").write_text(output)
                        print(
                            f"  {strategy} {rdzv} {phase} run {i}: {status} ({secs:.0f} s)",
                            flush=True,
                        )
                    rows.append({
                        "strategy": strategy, "rendezvous": rdzv, "phase": phase,
                        "runs": a.runs, **{k: counts[k] for k in ("exact", "differs", "failed", "hang")},
                        "median_s": sorted(seconds)[len(seconds) // 2], "reasons": dict(reasons),
                    })  # fmt: skip
    print(
        "\n| strategy | rendezvous | killed in | runs | exact | differs | failed | hang | s/run |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['strategy']} | {r['rendezvous']} | {r['phase']} | {r['runs']} | {r['exact']} | "
              f"{r['differs']} | {r['failed']} | {r['hang']} | {r['median_s']:.0f} |")  # fmt: skip
    for r in rows:
        for why, n in r["reasons"].items():
            print(f"- {r['strategy']} {r['rendezvous']} {r['phase']}: {n} x {why}")
    if a.json is not None:
        a.json.write_text(json.dumps(rows, indent=1))
    bad = []
    for r in rows:
        if r["strategy"] in ("ddp", "torch"):
            continue
        ddp = [d for d in rows if d["strategy"] == "ddp" and d["rendezvous"] == r["rendezvous"]
               and d["phase"] == r["phase"]]  # fmt: skip
        least = ddp[0]["exact"] if ddp else r["runs"]  # (without DDP beside it: every run)
        if r["hang"] or r["exact"] < least:
            bad.append(f"{r['strategy']} {r['rendezvous']} {r['phase']}")
    if bad:
        print(f"restart check FAILED: {', '.join(bad)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
