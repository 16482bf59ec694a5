"""Finished runs exit 0 on every rank: many short 2-rank fits under each launcher, counting
aborts and non-zero exit statuses per rank (CI runs it after the test suite)::

    python scripts/exit_check.py [--runs 60] [--ddp-runs 12] [--json PATH]

Each run is ``tests/scripts/exit_fit.py`` (a small attention model, a few steps past the switch to
1-bit compression) under one of the three ways Lightning starts ranks:

* ``popen``: the script run as is; Lightning's launcher starts rank 1 as a new process.
* ``torchrun``: ``python -m torch.distributed.run --nproc-per-node 2``.
* ``fork``: the notebook strategies (``start_method="fork"``) fork both ranks from the script.

The 1-bit runs cycle through the launchers, the three algorithms and the overlap on and off;
the ``strategy="ddp"`` runs through the launchers. A rank counts as aborted when its exit status
is SIGABRT or the output shows ``terminate called`` / ``Fatal Python error``; every rank must exit
0. Ranks that outlive the process that started them (popen's rank 1 after rank 0) are reparented
to this script (``PR_SET_CHILD_SUBREAPER``), which collects their exit statuses.

Prints a table per launcher and algorithm; exits 1 if any 1-bit run aborted or had a rank exit
non-zero (``strategy="ddp"`` is reported, not required: it is Lightning's and torch's exit).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "exit_fit.py"
LAUNCHERS = ("popen", "torchrun", "fork")
ALGORITHMS = ("onebit_adam", "zero_one_adam", "onebit_lamb")
ABORT_MARKERS = ("terminate called", "Fatal Python error", "core dumped")
PR_SET_CHILD_SUBREAPER = 36


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(launcher: str, algorithm: str, overlap: bool, steps: int) -> list[str]:
    args = [str(SCRIPT), algorithm, "--fits", "1", "--steps", str(steps)]
    args += [] if overlap else ["--no-overlap"]
    if launcher == "torchrun":
        return [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(_free_port()), *args,
        ]  # fmt: skip
    return [sys.executable, *args, *(["--fork"] if launcher == "fork" else [])]


def _reap_orphans(deadline: float) -> dict[int, int]:
    """Exit statuses (``os.waitstatus_to_exitcode``) of descendants reparented to this process,
    until none is left or the deadline passes (then they are killed and reported as -9)."""
    statuses: dict[int, int] = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # none left
            return statuses
        if pid:
            statuses[pid] = os.waitstatus_to_exitcode(status)
        elif time.monotonic() > deadline:
            for p in _children():
                os.kill(p, signal.SIGKILL)
            deadline = float("inf")
        else:
            time.sleep(0.05)


def _children() -> list[int]:
    pids = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        with open(task / "children") as f:
            pids += [int(p) for p in f.read().split()]
    return pids


def _rank_statuses(launcher: str, rc: int, out: str, orphans: dict[int, int]) -> dict[int, int]:
    """Each rank's exit status, as far as the launcher reports it."""
    pids = {int(p): int(r) for r, p in re.findall(r"exit-check: rank (\d) pid (\d+) done", out)}
    ranks = {0: 0, 1: 0}
    if launcher == "popen":  # rank 0 is the launcher; rank 1 its child (reaped here or by it)
        ranks[0] = rc
        for pid, status in orphans.items():
            if pids.get(pid, 1) == 1:
                ranks[1] = status
    elif launcher == "torchrun":  # torchrun's failure report names each failed rank
        for rank, code in re.findall(r"rank\s*:\s*(\d+).*?\n\s*exitcode\s*:\s*(-?\d+)", out):
            ranks[int(rank)] = int(code)
        if rc != 0 and not any(ranks.values()):
            ranks[0] = rc
    else:  # fork: the parent re-raises a rank's failure ("process 1 terminated with ...")
        for rank, how in re.findall(
            r"process (\d+) terminated with (signal \w+|exit code -?\d+)", out
        ):
            ranks[int(rank)] = -6 if "SIGABRT" in how else rc or 1
        if rc != 0 and not any(ranks.values()):
            ranks[0] = rc
    return ranks


def run_once(launcher: str, algorithm: str, overlap: bool, steps: int, timeout: float) -> dict:
    """One run: its ranks' exit statuses, whether any aborted, its seconds."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory() as cwd:  # (where Lightning or a core dump writes)
            proc = subprocess.run(
                _command(launcher, algorithm, overlap, steps),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd,
                timeout=timeout,
            )  # fmt: skip
        rc, out = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as e:
        rc, out = -9, (e.stdout or b"").decode(errors="replace") + "\n[exit_check: timed out]"
    orphans = _reap_orphans(time.monotonic() + 60)
    ranks = _rank_statuses(launcher, rc, out, orphans)
    done = len(set(re.findall(r"exit-check: rank (\d) pid", out)))
    aborted = any(m in out for m in ABORT_MARKERS) or -6 in ranks.values()
    return {
        "launcher": launcher,
        "algorithm": algorithm,
        "overlap": overlap,
        "rank_exit": ranks,
        "aborted": aborted,
        "clean": not aborted
        and not any(ranks.values())
        and done == (1 if launcher == "fork" else 2),
        "seconds": round(time.monotonic() - t0, 1),
        "tail": "" if rc == 0 and not aborted else out[-3000:],
    }


def _plan(runs: int, ddp_runs: int) -> list[tuple[str, str, bool]]:
    combos = list(itertools.product(LAUNCHERS, ALGORITHMS, (True, False)))
    plan = [combos[i % len(combos)] for i in range(runs)]
    plan += [(LAUNCHERS[i % len(LAUNCHERS)], "ddp", False) for i in range(ddp_runs)]
    return plan


def _table(results: list[dict]) -> str:
    rows = [
        "| launcher | strategy | runs | aborts | runs with a rank exit != 0 |",
        "|---|---|---|---|---|",
    ]
    for launcher in LAUNCHERS:
        for algorithm in (*ALGORITHMS, "ddp"):
            rs = [r for r in results if r["launcher"] == launcher and r["algorithm"] == algorithm]
            if rs:
                aborts = sum(r["aborted"] for r in rs)
                bad = sum(any(r["rank_exit"].values()) for r in rs)
                rows.append(f"| {launcher} | {algorithm} | {len(rs)} | {aborts} | {bad} |")
    for name, rs in (
        ("all 1-bit", [r for r in results if r["algorithm"] != "ddp"]),
        ("all ddp", [r for r in results if r["algorithm"] == "ddp"]),
    ):
        if rs:
            aborts = sum(r["aborted"] for r in rs)
            bad = sum(any(r["rank_exit"].values()) for r in rs)
            rows.append(f"| **{name}** | | {len(rs)} | {aborts} | {bad} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=60, help="1-bit runs (default 60)")
    parser.add_argument("--ddp-runs", type=int, default=12, help='strategy="ddp" runs')
    parser.add_argument("--steps", type=int, default=12, help="steps per fit (default 12)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per run")
    parser.add_argument("--json", type=Path, help="write every run's result here")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    args = parser.parse_args()
    # (orphaned ranks come back to this process, which reaps them: one run at a time)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    t0 = time.monotonic()
    results = []
    for i, (launcher, algorithm, overlap) in enumerate(_plan(args.runs, args.ddp_runs)):
        r = run_once(launcher, algorithm, overlap, args.steps, args.timeout)
        results.append(r)
        status = "ok" if r["clean"] else f"FAILED {r['rank_exit']} aborted={r['aborted']}"
        name = (
            f"{algorithm}{'' if algorithm == 'ddp' else ' overlap' if overlap else ' no-overlap'}"
        )
        print(f"[{i + 1:3d}] {launcher:8s} {name:26s} {r['seconds']:5.1f} s  {status}", flush=True)
        if not r["clean"]:
            print(r["tail"], flush=True)
    minutes = (time.monotonic() - t0) / 60
    print(f"\n{_table(results)}\n\n{len(results)} runs in {minutes:.1f} min")
    if args.markdown is not None:
        import platform

        import torch

        args.markdown.write_text(
            f"# Exit statuses of finished runs\n\n{time.strftime('%Y-%m-%d %H:%M')} · "
            f"{platform.node()} · {os.cpu_count()} CPUs · torch {torch.__version__} · "
            f"`python scripts/exit_check.py --runs {args.runs} --ddp-runs {args.ddp_runs}` · "
            f"{minutes:.1f} min\n\n{_table(results)}\n"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"minutes": round(minutes, 2), "runs": results}, indent=1))
    failed = [r for r in results if r["algorithm"] != "ddp" and not r["clean"]]
    if failed:
        print(f"exit check FAILED: {len(failed)} 1-bit run(s) did not exit 0 on every rank")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
