"""Benchmark on an emulated bandwidth-limited cluster: step time, bytes and loss per method.

    sudo .venv/bin/python benchmarks/cluster.py --quick          # < 3 min: W=2, tiny model
    python benchmarks/cluster.py --world-sizes 4 --rates 100mbit,1gbit --workloads finetune \\
        --model small --steps 40
    python benchmarks/cluster.py --world-sizes 4 --ranks-per-node 2 --rates 100mbit,1gbit \
        --methods ddp_adam,onebit_adam,onebit_adam_hier       # 2 nodes x 2 ranks
    python benchmarks/cluster.py --world-sizes 2 --rates 100mbit --workloads finetune --pin \
        --methods nocomm,nocomm_sync,onebit_adam --repeats 3  # ratios to the floor, with spread
    python benchmarks/cluster.py --cleanup-stale                 # remove namespaces of dead runs

The cluster (needs root and iproute2; see ../shared/DESIGN.md §5):

* one network namespace per rank (``--ranks-per-node L``: per node of L ranks, which talk to each
  other inside it, uncapped), ``obc<pid>x<rand>-r<i>``, with ``veth0`` at 10.77.N.(i+1)/24
  (N from the pid: addresses exist only inside namespaces this run created), and one bridge
  namespace ``obc<pid>x<rand>-br`` whose ``br0`` joins the bridge-side veth ends ``p<i>``;
* a link rate is ``tc qdisc replace dev X root tbf rate R burst 256kb latency 20ms`` on both ends
  of every veth pair (a full-duplex capped link per rank; ``uncapped`` removes the qdisc);
* every run tears its namespaces down: ``try/finally``, SIGINT/SIGTERM handlers and ``atexit``,
  also when a worker fails. Names carry the pid and a random suffix, so runs never collide.

For each workload, world size, link rate and method it starts one process per rank with
``ip netns exec NS env MASTER_ADDR=<rank 0> ... GLOO_SOCKET_IFNAME=veth0 python
benchmarks/cluster_worker.py`` (a plain gloo training loop; ``pl_<method>`` runs the same
training through ``L.Trainer(strategy=...)``, ``fabric_<method>`` through ``L.Fabric(strategy=...)``:
see that file) and reports:

* step time: per step, the time until the slowest rank finishes: ``max_r end(r, k) - max_r
  end(r, k-1)`` from timestamps every rank records (``time.monotonic``, one clock machine-wide),
  so no barrier sits in the timed region (after an evaluation, which ends in a barrier, the
  step is measured from ``max_r start(r, k)``). Medians per phase, skipping the first step of
  each phase (DDP rebuilds its buckets, the 1-bit exchange allocates its buffers);
* bytes sent per rank per step: the project's counters (``optimizer.comm_stats``) for the 1-bit
  methods, otherwise the ring-allreduce volume ``2 (W-1)/W * bytes`` of every tensor a DDP comm
  hook passes to ``dist.all_reduce`` (counted at the call; DDP without a hook: its fp32 buckets);
  cross-checked in every run against the interface's ``tx_bytes`` (which adds TCP/IP headers);
* validation loss (rank 0's model, fixed held-out windows) every ``--eval-every`` steps, so
  the loss after a fixed number of samples and the training time (evaluation excluded) to a
  target loss (``--target-loss``, default: 2% above DDP + Adam's final loss for that workload
  and world size).

Outputs ``benchmarks/results/<name>.{json,md,png}``; the last stdout line is the JSON summary.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import contextlib
import json
import math
import os
import platform
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "cluster_worker.py"

METHODS = (
    "nocomm",
    "ddp_adam",
    "ddp_fp16",
    "powersgd_r1",
    "powersgd_r4",
    "onebit_adam",
    "zero_one_adam",
    "onebit_lamb",
)
#: The floor with one one-value all-reduce per step: what waiting for the slowest rank costs
#: (not run by default).
SYNCED_FLOOR = ("nocomm_sync",)
#: The 1-bit methods with their exchange in step() after backward (not run by default).
SYNC_METHODS = ("onebit_adam_sync", "zero_one_adam_sync", "onebit_lamb_sync")
#: The same through ``L.Trainer`` (``OneBitStrategy`` / ``DDPStrategy``; not run by default).
LIGHTNING_METHODS = ("pl_ddp_adam", "pl_onebit_adam", "pl_zero_one_adam", "pl_onebit_lamb")
#: The plain loop through ``L.Fabric`` (``OneBitFabricStrategy`` / ``DDPStrategy``; not run by default).
FABRIC_METHODS = tuple(m.replace("pl_", "fabric_", 1) for m in LIGHTNING_METHODS)
#: The 1-bit methods with the two-level exchange (``hierarchical=True``; not run by default).
HIER_METHODS = ("onebit_adam_hier", "zero_one_adam_hier", "onebit_lamb_hier")
RATES = ("100mbit", "1gbit", "10gbit", "uncapped")
#: Model presets (character-level GPT, ~100 tokens). "base" is the ~19M-parameter LM of DESIGN.md §5.
MODELS = {
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 2, "block": 64},
    "small": {"n_layer": 4, "n_embd": 256, "n_head": 4, "block": 128},
    "base": {"n_layer": 6, "n_embd": 512, "n_head": 8, "block": 128},
}
#: Workloads: per-rank batch. "compute": the LM's normal batch (compute-heavy on 2 cores);
#: "finetune": a small batch as in the 1-bit Adam paper's SQuAD runs (communication-heavy).
WORKLOADS = {"compute": 8, "finetune": 4}
TBF = ("burst", "256kb", "latency", "20ms")
NAME_RE = re.compile(r"^obc(\d+)x[0-9a-f]{4}-(r\d+|br)$")


class ClusterUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no iproute2, no permission)."""


# --------------------------------------------------------------------------- shell helpers


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({res.returncode}): {res.stderr.strip()}")
    return res


def _log(msg: str) -> None:
    print(f"[cluster] {msg}", file=sys.stderr, flush=True)


def ensure_iproute2() -> None:
    """Install iproute2 with apt-get when ``ip``/``tc`` are missing (root only)."""
    if shutil.which("ip") and shutil.which("tc"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise ClusterUnavailable("`ip`/`tc` not found: install iproute2 (apt-get install iproute2)")
    _log("installing iproute2")
    _sh("apt-get", "update", "-qq", check=False)
    _sh("apt-get", "install", "-y", "-qq", "iproute2")


def check_netns() -> None:
    """Raise :class:`ClusterUnavailable` with the reason unless ``ip netns add`` works here."""
    if os.geteuid() != 0:
        raise ClusterUnavailable("network namespaces need root (run with sudo)")
    ensure_iproute2()
    probe = f"obc{os.getpid()}x{secrets.token_hex(2)}-br"
    res = _sh("ip", "netns", "add", probe, check=False)
    if res.returncode != 0:
        raise ClusterUnavailable(f"`ip netns add` failed: {res.stderr.strip()}")
    _sh("ip", "netns", "del", probe, check=False)


def cleanup_stale() -> list[str]:
    """Delete namespaces left by benchmark runs whose process is gone; return their names."""
    removed = []
    for line in _sh("ip", "netns", "list").stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = NAME_RE.match(name)
        if not m:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # its run is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _sh("ip", "netns", "del", name, check=False)
        removed.append(name)
    return removed


# --------------------------------------------------------------------------- the cluster


_LIVE: list[Cluster] = []


def _teardown_all() -> None:
    for c in list(_LIVE):
        c.down()


def _on_signal(signum: int, _frame: Any) -> None:
    # unwind through every finally (workers killed, namespaces deleted), then exit
    signal.signal(signum, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def install_cleanup_handlers() -> None:
    """atexit + SIGINT/SIGTERM/SIGHUP: every live cluster is torn down whatever ends the run."""
    atexit.register(_teardown_all)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)


class Cluster:
    """W ranks on W / L node namespaces (L ranks each), joined by capped veth links to a bridge
    namespace. The ranks of one node talk over the namespace's own addresses (the kernel's
    loopback path: uncapped, like a node's NVLink/shared memory); only traffic between nodes
    crosses a capped link. ``ranks_per_node=1`` (default): one namespace per rank.

    Use as a context manager; :meth:`down` is idempotent and also runs from ``atexit`` and the
    signal handlers of :func:`install_cleanup_handlers`.
    """

    def __init__(self, world_size: int, ranks_per_node: int = 1) -> None:
        if world_size % ranks_per_node:
            raise ValueError(f"--ranks-per-node {ranks_per_node} does not divide W={world_size}")
        self.world_size = world_size
        self.per_node = ranks_per_node
        self.tag = f"obc{os.getpid()}x{secrets.token_hex(2)}"
        self.bridge = f"{self.tag}-br"
        nodes = world_size // ranks_per_node
        self.ranks = [f"{self.tag}-r{i}" for i in range(nodes)]  # one namespace per node
        self.subnet = 1 + os.getpid() % 250
        self.addrs = [f"10.77.{self.subnet}.{i + 1}" for i in range(nodes)]
        self.ifname = "veth0"
        self.rate = "uncapped"
        self._procs: list[subprocess.Popen] = []
        self._created: list[str] = []

    def __enter__(self) -> Cluster:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        _LIVE.append(self)
        try:
            for ns in (self.bridge, *self.ranks):
                self._created.append(ns)  # first: a signal between the two lines leaks nothing
                _sh("ip", "netns", "add", ns)
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
            br = ("ip", "-n", self.bridge)
            _sh(*br, "link", "add", "br0", "type", "bridge")
            _sh(*br, "link", "set", "br0", "up")
            for i, ns in enumerate(self.ranks):
                # created in the bridge namespace, peer straight into the rank's: no name
                # ever appears in the root namespace
                _sh(*br, "link", "add", f"p{i}", "type", "veth", "peer", "name", self.ifname,
                    "netns", ns)  # fmt: skip
                _sh(*br, "link", "set", f"p{i}", "master", "br0", "up")
                _sh("ip", "-n", ns, "addr", "add", f"{self.addrs[i]}/24", "dev", self.ifname)
                _sh("ip", "-n", ns, "link", "set", self.ifname, "up")
        except BaseException:
            self.down()
            raise

    def _link_ends(self) -> Iterator[tuple[str, str]]:
        for i, ns in enumerate(self.ranks):
            yield ns, self.ifname
            yield self.bridge, f"p{i}"

    def set_rate(self, rate: str) -> None:
        """Cap every link at ``rate`` (tc syntax, e.g. ``100mbit``) or ``uncapped``."""
        for ns, dev in self._link_ends():
            if rate == "uncapped":
                _sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            else:
                _sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                    *TBF)  # fmt: skip
        self.rate = rate

    def launch(
        self, cfg: dict[str, Any], port: int, workdir: Path, timeout: float
    ) -> list[dict[str, Any]]:
        """Run one worker per rank namespace; return the ranks' results (raise on failure)."""
        cfg_json = json.dumps(cfg)
        outs = [workdir / f"rank{r}.json" for r in range(self.world_size)]
        logs = [workdir / f"rank{r}.log" for r in range(self.world_size)]
        for f in outs:
            f.unlink(missing_ok=True)
        threads = str(cfg.get("threads", 1))
        pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        self._procs = []
        ll = self.per_node
        try:
            for r in range(self.world_size):
                ns = self.ranks[r // ll]
                pin = ["taskset", "-c", str(r % (os.cpu_count() or 1))] if cfg.get("pin") else []
                cmd = [
                    *pin, "ip", "netns", "exec", ns, "env",
                    f"MASTER_ADDR={self.addrs[0]}", f"MASTER_PORT={port}",
                    f"RANK={r}", f"WORLD_SIZE={self.world_size}",
                    f"LOCAL_RANK={r % ll}", f"LOCAL_WORLD_SIZE={ll}",
                    f"GLOO_SOCKET_IFNAME={self.ifname}",
                    f"OMP_NUM_THREADS={threads}", f"MKL_NUM_THREADS={threads}",
                    f"PYTHONPATH={pythonpath}",
                    sys.executable, str(WORKER), "--config", cfg_json, "--out", str(outs[r]),
                ]  # fmt: skip
                with open(logs[r], "w") as log:
                    self._procs.append(
                        subprocess.Popen(
                            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                        )
                    )
            deadline = time.monotonic() + timeout
            while True:
                codes = [p.poll() for p in self._procs]
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if failed or all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"workers still running after {timeout:.0f} s")
                time.sleep(0.2)
            if failed:
                r = failed[0]
                tail = logs[r].read_text()[-3000:]
                raise RuntimeError(f"rank {r} exited with {codes[r]}:\n{tail}")
            return [json.loads(f.read_text()) for f in outs]
        finally:
            self._kill_workers()

    def _kill_workers(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self._procs = []

    def down(self) -> None:
        """Kill this cluster's workers and delete its namespaces (idempotent)."""
        self._kill_workers()
        while self._created:
            _sh("ip", "netns", "del", self._created.pop(), check=False)
        if self in _LIVE:
            _LIVE.remove(self)


# --------------------------------------------------------------------------- analysis


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(ranks: list[dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    """Per-step slowest-rank times, per-phase medians, bytes and the loss curve of one run."""
    world, steps, eval_every = len(ranks), cfg["steps"], cfg["eval_every"]
    recs = [r["records"] for r in ranks]
    t0 = [max(rr[k]["t0"] for rr in recs) for k in range(steps)]
    t1 = [max(rr[k]["t1"] for rr in recs) for k in range(steps)]
    times = []
    for k in range(steps):
        after_eval = k == 0 or (eval_every and k % eval_every == 0)  # barrier before step k+1
        times.append(t1[k] - (t0[k] if after_eval else t1[k - 1]))
    phases = [recs[0][k]["phase"] for k in range(steps)]
    # per step, the slowest rank's time inside step() (where optimizer-side creep would show)
    after_bwd = [
        max(rr[k]["t1"] - rr[k].get("tb", rr[k]["t1"]) for rr in recs) for k in range(steps)
    ]
    # per step, the longest time one rank spent in it, from its own start (>= its after_bwd)
    own = [max(rr[k]["t1"] - rr[k]["t0"] for rr in recs) for k in range(steps)]
    out: dict[str, Any] = {
        "numel": ranks[0]["numel"],
        "step_times": times,
        "own_step_times": own,
        "after_backward_times": after_bwd,
        "phases": phases,
    }
    for ph in ("warmup", "compression"):
        idx = [k for k in range(steps) if phases[k] == ph]
        timed = idx[1:] or idx  # skip the first step of the phase (one-off allocations)
        out[f"step_time_{ph}"] = _median([times[k] for k in timed])
        out[f"step_time_{ph}_mean"] = statistics.fmean([times[k] for k in timed]) if timed else None
        # what is left after backward (step(): the exchange's tail, the update), slowest rank
        out[f"after_backward_{ph}"] = _median([after_bwd[k] for k in timed])
        # CPU time per step, mean over the ranks: the training thread's and the other threads'
        for key in ("cpu_main", "cpu_other"):
            if all(key in rr[k] for rr in recs for k in timed):
                out[f"{key}_{ph}"] = _median(
                    [statistics.fmean(rr[k][key] for rr in recs) for k in timed]
                )
        n = len(idx) * world
        out[f"bytes_{ph}"] = sum(rr[k]["bytes"] for rr in recs for k in idx) / n if n else None
        out[f"tx_bytes_{ph}"] = (
            sum(rr[k]["tx_bytes"] for rr in recs for k in idx) / n if n else None
        )
        # what left each node, per node: the counters' inter-node part, and the interface
        per_node = cfg.get("ranks_per_node", 1)
        out[f"bytes_inter_node_{ph}"] = (
            per_node * sum(rr[k].get("bytes_inter", 0) for rr in recs for k in idx) / n
            if n
            else None
        )
        out[f"tx_bytes_node_{ph}"] = per_node * out[f"tx_bytes_{ph}"] if n else None
    cum = [0.0]
    for t in times:
        cum.append(cum[-1] + t)
    samples_per_step = world * cfg["batch"]
    out["evals"] = [
        {
            "step": e["step"],
            "samples": e["step"] * samples_per_step,
            "train_time_s": cum[e["step"]],
            "val_loss": e["val_loss"],
        }
        for e in ranks[0]["evals"]
    ]
    for e in out["evals"]:  # JSON has no NaN: a diverged run's loss is null
        if not math.isfinite(e["val_loss"]):
            e["val_loss"], out["diverged"] = None, True
    out["final_val_loss"] = out["evals"][-1]["val_loss"] if out["evals"] else None
    out["samples"] = steps * samples_per_step
    out["train_time_s"] = cum[-1]
    out["opt_phases"] = sorted({str(recs[0][k]["opt_phase"]) for k in range(steps)})
    return out


def run_order(methods: list[str], repeats: int) -> list[tuple[int, str]]:
    """``(repeat, method)`` in the order one cell runs them: repeat k runs ``methods`` rotated
    left by k, so that the machine's drift within a cell does not always fall on one method."""
    out = []
    for rep in range(repeats):
        k = rep % len(methods)
        out += [(rep, m) for m in methods[k:] + methods[:k]]
    return out


#: The per-run timings an aggregated row reports as their median over the repeats.
TIMINGS = (
    "step_time_warmup",
    "step_time_compression",
    "step_time_warmup_mean",
    "step_time_compression_mean",
    "after_backward_warmup",
    "after_backward_compression",
    "cpu_main_compression",
    "cpu_other_compression",
)


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, W, rate, method) from the runs of every repeat.

    The row is the first successful repeat's (bytes, loss curve) with each of ``TIMINGS``
    replaced by its median over the successful repeats, and, per repeat in run order, the
    compression-phase step (``step_time_compression_runs``), its ratio to the same repeat's
    ``nocomm`` (``x_floor_runs``) and ``nocomm_sync`` (``x_sync_floor_runs``) where those ran,
    and the final loss (``final_val_loss_runs``: equal in every repeat of a deterministic
    method). A method that failed in any repeat keeps that repeat's ``error``.
    """
    cells: dict[tuple, dict[str, list[dict[str, Any]]]] = {}
    for r in runs:
        key = (r["workload"], r["world_size"], r["rate"])
        cells.setdefault(key, {}).setdefault(r["method"], []).append(r)
    rows = []
    for by_method in cells.values():
        # compression-phase step per (method, repeat); None where that run failed
        step = {
            (m, r.get("repeat", 0)): None if r.get("error") else r.get("step_time_compression")
            for m, reps in by_method.items()
            for r in reps
        }
        for method, reps in by_method.items():
            ok = [r for r in reps if not r.get("error")]
            row = dict(ok[0] if ok else reps[0])
            row.pop("repeat", None)
            row["repeats"] = len(reps)
            failed = next((r["error"] for r in reps if r.get("error")), None)
            if failed:
                row["error"] = failed
            for key in TIMINGS:
                row[key] = _median([r[key] for r in ok if r.get(key) is not None])
            order = [r.get("repeat", 0) for r in reps]
            row["step_time_compression_runs"] = [step[method, k] for k in order]
            row["final_val_loss_runs"] = [r.get("final_val_loss") for r in reps]
            for ref, field in (("nocomm", "x_floor_runs"), ("nocomm_sync", "x_sync_floor_runs")):
                if ref in by_method:
                    pairs = [(step[method, k], step.get((ref, k))) for k in order]
                    row[field] = [c / f if c and f else None for c, f in pairs]
            rows.append(row)
    return rows


def _time_to(evals: list[dict[str, Any]], target: float) -> float | None:
    for e in evals:
        if e["val_loss"] is not None and e["val_loss"] <= target:
            return e["train_time_s"]
    return None


def add_targets(rows: list[dict[str, Any]], target: float | None, slack: float) -> dict[str, float]:
    """Fill ``time_to_target_s``; the target per (workload, W) is ``target`` or DDP + Adam's
    worst final loss over the rates times ``1 + slack``."""
    targets: dict[str, float] = {}
    for row in rows:
        key = f"{row['workload']}/W{row['world_size']}"
        if key in targets:
            continue
        if target is not None:
            targets[key] = target
            continue
        ref = [
            r["final_val_loss"]
            for r in rows
            if f"{r['workload']}/W{r['world_size']}" == key
            and r["method"] == "ddp_adam"
            and r.get("final_val_loss") is not None
        ]
        if ref:
            targets[key] = max(ref) * (1 + slack)
    for row in rows:
        t = targets.get(f"{row['workload']}/W{row['world_size']}")
        row["target_loss"] = t
        row["time_to_target_s"] = _time_to(row.get("evals", []), t) if t is not None else None
    return targets


# --------------------------------------------------------------------------- reporting


def parse_strategy_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` of ``--strategy-option`` (here and in ``user_models.py``): the key and the
    value as a Python literal."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise ValueError(
            f"--strategy-option {text!r}: expected KEY=VALUE, e.g. rescale_variance=False"
        )
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise ValueError(
            f"--strategy-option {text!r}: the value must be a Python literal (False, 0.1, 'bf16')"
        ) from None


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "—" if x is None else format(x, spec)


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.0f}"


def _mb(x: float | None) -> str:
    return "—" if x is None else f"{x / 1e6:.3g}"


def _ratio_cell(row: dict[str, Any], field: str) -> str:
    """A row's per-repeat ratios ``field``: median, and (min-max) when there are several."""
    vals = [x for x in row.get(field) or [] if x is not None]
    if not vals:
        return "—"
    spread = f" ({min(vals):.2f}-{max(vals):.2f})" if len(row[field]) > 1 else ""
    return f"{statistics.median(vals):.2f}{spread}"


def _ratio_matrix(groups: dict[tuple, list[dict[str, Any]]], field: str, title: str) -> list[str]:
    """A cell x method table of the per-repeat ratios ``field`` (median (min-max)); empty if no
    row has them."""
    methods = list(
        dict.fromkeys(r["method"] for g in groups.values() for r in g if r.get(field) is not None)
    )
    methods = [m for m in methods if m not in ("nocomm", *SYNCED_FLOOR)] + [
        m for m in SYNCED_FLOOR if m in methods and field == "x_floor_runs"
    ]
    if not methods:
        return []
    lines = [
        "",
        f"### {title}",
        "",
        "| workload, W, link | " + " | ".join(methods) + " |",
        "|---|" + "---:|" * len(methods),
    ]
    for (wl, w, rate), grp in groups.items():
        by = {r["method"]: r for r in grp}
        cells = [_ratio_cell(by[m], field) if m in by else "—" for m in methods]
        lines.append(
            f"| {wl} (batch {grp[0]['batch']}), W={w}, {rate} | " + " | ".join(cells) + " |"
        )
    return lines


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    overlap = f"{meta['overlap_mb']} MiB buckets" if meta.get("overlap_mb") else "no"
    lines = [
        "# Emulated-cluster benchmark",
        "",
        f"{meta['when']} · {meta['host']} · {meta['cpus']} CPUs · torch {meta['torch']} · "
        f"model `{meta['model']}` ({_fmt(meta.get('numel'), ',')} params) · "
        f"{meta['steps']} steps, warmup {meta['warmup']} · {meta['threads']} torch thread(s)/rank"
        f" · 1-bit exchange overlapped with backward: {overlap}"
        + (" · denormals flushed" if meta.get("flush_denormal") else "")
        + (" · pinned" if meta.get("pin") else "")
        + (" · exchange source materialized (two sweeps)" if meta.get("materialize") else "")
        + "".join(f" · {k}={v!r}" for k, v in meta.get("strategy_options", {}).items())
        + (
            f" · LR: linear warmup {meta['lr_warmup']} steps, cosine to 0.1x"
            if meta.get("lr_schedule") == "cosine"
            else ""
        )
        + (
            f" · 1-bit methods' warmup average in {meta['average_dtype']}"
            if meta.get("average_dtype", "float32") != "float32"
            else ""
        )
        + (
            f" · 0/1 Adam: var_freeze_step {meta['var_freeze_step']}"
            if meta.get("var_freeze_step", meta["warmup"]) != meta["warmup"]
            else ""
        )
        + (
            f" · 0/1 Adam: var_update_scaler {meta['var_update_scaler']} (the paper's phase 1: "
            "the steps between variance updates exchange 1-bit gradients)"
            if meta.get("var_update_scaler") is not None
            else ""
        ),
        "",
        "Step time = median over the phase of the time until the slowest rank finishes the step "
        "(first step of each phase skipped). *x floor*: compression-phase step / `nocomm`'s. "
        "*vs DDP*: DDP + Adam's compression-phase step / this one's. Bytes: per rank per step, "
        "warmup / compression; *counter*: the method's own count, *tx*: the veth's tx_bytes "
        "(TCP/IP headers included). Loss: rank 0's validation loss after the run's samples; "
        "time to target: training time (evaluations excluded) until the validation loss first "
        "reached the target. *after bwd*: compression phase, median of the slowest rank's time "
        "from the end of backward to the end of `step()` (DDP waits for its allreduce inside "
        "backward; the 1-bit methods finish their exchange in `step()`). *CPU ms/step*: a "
        "rank's CPU time per compression step (mean over the ranks, median over the steps) in "
        "its training thread and in its other threads (the exchange's, the process group's), "
        "which share the rank's cores.",
    ]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["world_size"], r["rate"]), []).append(r)
    per_node = meta.get("ranks_per_node", 1)
    nodes_col = per_node > 1
    if nodes_col:
        lines += [
            "",
            f"Nodes of {per_node} ranks (one network namespace each, uncapped inside, the link "
            "rate between nodes). *MB/step counter* counts all bytes a rank sent (inside its "
            "node too), *tx* only what left the node (the node's interface, per rank); *node "
            "out*: compression phase, MB per node per step that left the node, counter (its "
            "inter-node part) / interface.",
        ]
    repeats = meta.get("repeats", 1)
    if repeats > 1:
        lines += [
            "",
            f"Each cell's methods ran {repeats} times, repeat k in the order rotated by k. Step "
            "times: medians over the repeats; *x floor*: the ratio to the floor within each "
            "repeat, median (min-max).",
        ]
        lines += _ratio_matrix(groups, "x_floor_runs", "x floor (`nocomm`)")
        lines += _ratio_matrix(groups, "x_sync_floor_runs", "x synchronised floor (`nocomm_sync`)")
    for (wl, w, rate), grp in groups.items():
        ddp = next((r.get("step_time_compression") for r in grp if r["method"] == "ddp_adam"), None)
        target = grp[0].get("target_loss")
        where = f"W={w} ({w // per_node} nodes x {per_node})" if nodes_col else f"W={w}"
        lines += [
            "",
            f"## {wl} (batch {grp[0]['batch']}/rank) · {where} · {rate}",
            "",
            f"| method | warmup s/step | compression s/step | x floor | vs DDP | after bwd | "
            f"CPU ms/step training / other threads | "
            f"MB/step counter | MB/step tx | {'node out | ' if nodes_col else ''}"
            f"val loss @ {grp[0]['samples']} samples | s to loss ≤ {_fmt(target)} |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
            + ("---:|" if nodes_col else "")
            + "---:|---:|",
        ]
        for r in grp:
            if r.get("error"):
                lines.append(f"| {r['method']} | failed: {r['error'].splitlines()[0][:80]} |")
                continue
            c = r.get("step_time_compression")
            lines.append(
                f"| {r['method']} | {_fmt(r.get('step_time_warmup'))} | {_fmt(c)} | "
                f"{_ratio_cell(r, 'x_floor_runs')} | "
                f"{_fmt(ddp / c if c and ddp else None, '.2f')} | "
                f"{_fmt(r.get('after_backward_compression'))} | "
                f"{_ms(r.get('cpu_main_compression'))} / {_ms(r.get('cpu_other_compression'))} | "
                f"{_mb(r.get('bytes_warmup'))} / {_mb(r.get('bytes_compression'))} | "
                f"{_mb(r.get('tx_bytes_warmup'))} / {_mb(r.get('tx_bytes_compression'))} | "
                + (
                    f"{_mb(r.get('bytes_inter_node_compression'))} / "
                    f"{_mb(r.get('tx_bytes_node_compression'))} | "
                    if nodes_col
                    else ""
                )
                + f"{'diverged' if r.get('diverged') else _fmt(r.get('final_val_loss'))} | "
                f"{_fmt(r.get('time_to_target_s'), '.1f')} |"
            )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    """Compression-phase step time vs link rate, one line per method, one panel per
    (workload, W). Returns False (and writes nothing) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log("matplotlib not installed: no PNG")
        return False
    x_of = {"100mbit": 0.1, "1gbit": 1.0, "10gbit": 10.0, "uncapped": 100.0}
    panels = sorted({(r["workload"], r["world_size"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (wl, w) in zip(axes[0], panels, strict=True):
        for m in dict.fromkeys(r["method"] for r in rows):
            pts = sorted(
                (x_of.get(r["rate"], 100.0), r["step_time_compression"])
                for r in rows
                if (r["workload"], r["world_size"], r["method"]) == (wl, w, m)
                and r.get("step_time_compression")
            )
            if pts:
                style = "--" if m == "nocomm" else "-"
                ax.plot(*zip(*pts, strict=True), style, marker="o", label=m)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ticks = sorted({x_of.get(r["rate"], 100.0) for r in rows})
        ax.set_xticks(ticks, [next(k for k, v in x_of.items() if v == t) for t in ticks])
        ax.set_xlabel("link rate per rank")
        ax.set_ylabel("compression-phase step time (s)")
        ax.set_title(f"{wl}, W={w}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- main


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="W=2, tiny model, 100mbit, 24 steps")
    p.add_argument("--world-sizes", default="2,4", help="comma-separated (default 2,4)")
    p.add_argument("--rates", default=",".join(RATES), help=f"comma-separated from {RATES}")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated (default: all)")
    p.add_argument("--workloads", default="compute,finetune", help=f"from {tuple(WORKLOADS)}")
    p.add_argument("--model", default="base", choices=sorted(MODELS))
    p.add_argument("--model-source", default="builtin", choices=("builtin", "examples"))
    p.add_argument("--batch", type=int, default=None, help="per-rank batch (overrides workload)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="warmup steps (default max(16, 20%% of steps)): 1-bit Adam diverged here when it "
        "started compressing after 8 steps",
    )
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--val-windows", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--lr-lamb", type=float, default=1e-2, help="1-bit LAMB's lr (LAMB takes larger ones)"
    )
    p.add_argument(
        "--lr-schedule",
        choices=("constant", "cosine"),
        default="constant",
        help="cosine: linear warmup over --lr-warmup steps, then a half cosine to 0.1 x lr at "
        "the last step (every method, through its optimizer's LR scheduler)",
    )
    p.add_argument(
        "--lr-warmup",
        type=int,
        default=None,
        help="the cosine schedule's linear warmup steps (default 5%% of --steps)",
    )
    p.add_argument(
        "--betas",
        default="0.9,0.999",
        help="Adam betas for every method (examples/gpt.py uses 0.9,0.95 for short runs)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument(
        "--seed", type=int, default=0, help="data order and model initialisation (0: as before)"
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="pin rank r (and its threads) to core r mod #cores (taskset): less scheduling "
        "noise when comparing step times",
    )
    p.add_argument(
        "--materialize",
        action="store_true",
        help="1-bit methods: compute the exchange's source (1-bit Adam's and 1-bit LAMB's "
        "momentum, 0/1 Adam's sync-step update) into its buffer, then compress it (two sweeps, "
        "as a build without the fused kernel; the same floats)",
    )
    p.add_argument(
        "--overlap-mb",
        type=float,
        default=25.0,
        help="1-bit methods: bucket size of the exchange overlapped with backward (0: exchange "
        "in step() after backward)",
    )
    p.add_argument(
        "--flush-denormal",
        action="store_true",
        help="torch.set_flush_denormal(True) in every rank: a model that sharpens (low loss) "
        "produces denormal floats, which slow CPU forward/backward several-fold and drown the "
        "communication being measured",
    )
    p.add_argument(
        "--average-dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="1-bit methods: dtype of the warmup's gradient average (optimizer average_dtype); "
        "float32 for every method unless given, also for the Trainer and Fabric methods, whose "
        "strategies default to bfloat16",
    )
    p.add_argument(
        "--strategy-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="1-bit methods: one more OneBitStrategy option (a Python literal, e.g. "
        "rescale_variance=False), in every front end; repeatable",
    )
    p.add_argument(
        "--var-freeze-step",
        type=int,
        default=None,
        help="0/1 Adam: freeze the variance after this step (default: --warmup)",
    )
    p.add_argument(
        "--var-update-scaler",
        type=int,
        default=None,
        help="0/1 Adam: variance updates (fp32 gradient averages) before their interval doubles; "
        "given, the other phase-1 steps exchange 1-bit gradients (the paper's phase 1); default: "
        "every phase-1 step averages in full precision (the strategy's default)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every cell's methods this many times, repeat k in the order rotated by k "
        "(no method always first or last); the table reports medians over the repeats, and "
        "each ratio to a floor is taken within a repeat, then its median and range",
    )
    p.add_argument("--target-loss", type=float, default=None)
    p.add_argument("--target-slack", type=float, default=0.02)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per method run")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=1,
        help="ranks per emulated node (one namespace each, uncapped inside; the rate caps the "
        "links between nodes); *_hier methods exchange in two levels",
    )
    p.add_argument("--name", default=None, help="output file stem (default cluster-<time>)")
    p.add_argument("--cleanup-stale", action="store_true", help="delete dead runs' namespaces")
    args = p.parse_args(argv)
    if args.quick:
        args.world_sizes, args.rates, args.model = "2", "100mbit", "tiny"
        args.workloads, args.steps, args.eval_every, args.val_windows = "finetune", 24, 8, 8
        args.name = args.name or "cluster-quick"
    args.world_sizes = [int(w) for w in _csv(args.world_sizes)]
    args.rates, args.methods, args.workloads = map(_csv, (args.rates, args.methods, args.workloads))
    for what, got, ok in (
        ("rate", args.rates, None),
        (
            "method",
            args.methods,
            METHODS
            + SYNCED_FLOOR
            + SYNC_METHODS
            + HIER_METHODS
            + LIGHTNING_METHODS
            + FABRIC_METHODS,
        ),
        ("workload", args.workloads, WORKLOADS),
    ):
        bad = [g for g in got if ok is not None and g not in ok]
        if bad:
            p.error(f"unknown {what}(s) {bad}; choose from {list(ok)}")
    for r in args.rates:
        if r != "uncapped" and not re.fullmatch(r"\d+(\.\d+)?[kmg]?bit", r):
            p.error(f"rate {r!r} is not tc syntax like 100mbit / 1gbit, or 'uncapped'")
    args.betas = [float(b) for b in _csv(args.betas)]
    if len(args.betas) != 2:
        p.error("--betas takes two numbers, e.g. 0.9,0.999")
    if args.warmup is None:
        args.warmup = min(max(16, round(0.2 * args.steps)), args.steps - 2)
    try:
        args.strategy_option = dict(parse_strategy_option(o) for o in args.strategy_option)
    except ValueError as err:
        p.error(str(err))
    if args.lr_warmup is None:
        args.lr_warmup = round(0.05 * args.steps) if args.lr_schedule == "cosine" else 0
    if not 0 <= args.lr_warmup < args.steps:
        p.error("need 0 <= --lr-warmup < --steps")
    if not 2 <= args.warmup < args.steps:
        p.error("need 2 <= --warmup < --steps (each phase needs a timed step)")
    if args.repeats < 1:
        p.error("need --repeats >= 1")
    if args.ranks_per_node < 1 or any(w % args.ranks_per_node for w in args.world_sizes):
        p.error("--ranks-per-node must be >= 1 and divide every world size")
    if args.var_freeze_step is None:
        args.var_freeze_step = args.warmup
    if args.var_freeze_step < 0 or (
        args.var_update_scaler is not None and args.var_update_scaler < 1
    ):
        p.error("need --var-freeze-step >= 0 and --var-update-scaler >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_netns()
    except ClusterUnavailable as err:
        print(f"cannot emulate a cluster here: {err}", file=sys.stderr)
        return 2
    install_cleanup_handlers()
    if args.cleanup_stale:
        _log(f"removed stale namespaces: {cleanup_stale() or 'none'}")
        return 0

    import torch

    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = args.name or f"cluster-{stamp}"
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "model": args.model,
        "model_config": MODELS[args.model],
        "model_source": args.model_source,
        "overlap_mb": args.overlap_mb,
        "average_dtype": args.average_dtype,
        "strategy_options": args.strategy_option,
        "var_freeze_step": args.var_freeze_step,
        "var_update_scaler": args.var_update_scaler,
        "flush_denormal": args.flush_denormal,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": args.threads,
        "lr": args.lr,
        "lr_lamb": args.lr_lamb,
        "lr_schedule": args.lr_schedule,
        "lr_warmup": args.lr_warmup,
        "betas": args.betas,
        "ranks_per_node": args.ranks_per_node,
        "seed": args.seed,
        "pin": args.pin,
        "materialize": args.materialize,
        "repeats": args.repeats,
        "timing": "per step: max over ranks of end(k) - max over ranks of end(k-1); median/phase",
    }
    rows: list[dict[str, Any]] = []
    port = 29500
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="obcluster-") as tmp:
        for w in args.world_sizes:
            with Cluster(w, args.ranks_per_node) as cluster:
                _log(f"W={w}: namespaces {cluster.ranks} + {cluster.bridge}")
                for rate in args.rates:
                    cluster.set_rate(rate)
                    for wl in args.workloads:
                        batch = args.batch or WORKLOADS[wl]
                        for rep, method in run_order(args.methods, args.repeats):
                            port += 1
                            cfg = {
                                "method": method,
                                "model": MODELS[args.model],
                                "model_source": args.model_source,
                                "batch": batch,
                                "steps": args.steps,
                                "warmup": args.warmup,
                                "eval_every": args.eval_every,
                                "val_windows": args.val_windows,
                                "lr": args.lr,
                                "lr_lamb": args.lr_lamb,
                                "lr_schedule": args.lr_schedule,
                                "lr_warmup": args.lr_warmup,
                                "betas": args.betas,
                                "threads": args.threads,
                                "timeout": max(60, args.timeout / 2),
                                "overlap_mb": args.overlap_mb,
                                "average_dtype": args.average_dtype,
                                "strategy_options": args.strategy_option,
                                "var_freeze_step": args.var_freeze_step,
                                "var_update_scaler": args.var_update_scaler,
                                "flush_denormal": args.flush_denormal,
                                "ranks_per_node": args.ranks_per_node,
                                "seed": args.seed,
                                "pin": args.pin,
                                "materialize": args.materialize,
                            }
                            row = {
                                "workload": wl,
                                "world_size": w,
                                "rate": rate,
                                "method": method,
                                "batch": batch,
                                "samples": args.steps * w * batch,
                                "repeat": rep,
                            }
                            t0 = time.monotonic()
                            try:
                                ranks = cluster.launch(cfg, port, Path(tmp), args.timeout)
                                row.update(summarize(ranks, cfg))
                                meta["numel"] = row["numel"]
                            except RuntimeError as err:
                                row["error"] = str(err)
                                _log(
                                    f"{wl} W={w} {rate} {method} (repeat {rep + 1}): FAILED\n{err}"
                                )
                            _log(
                                f"{wl} W={w} {rate} {method} (repeat {rep + 1}): warmup "
                                f"{_fmt(row.get('step_time_warmup'))} s, compression "
                                f"{_fmt(row.get('step_time_compression'))} s, loss "
                                f"{_fmt(row.get('final_val_loss'))} "
                                f"({time.monotonic() - t0:.0f} s wall)"
                            )
                            rows.append(row)
    meta["wall_s"] = round(time.monotonic() - t_start, 1)
    runs, rows = rows, aggregate(rows)
    targets = add_targets(rows, args.target_loss, args.target_slack)

    paths = {k: out_dir / f"{name}.{k}" for k in ("json", "md", "png")}
    record = {"meta": meta, "targets": targets, "rows": rows}
    if args.repeats > 1:
        record["runs"] = runs
    paths["json"].write_text(json.dumps(record, indent=1))
    table = markdown(rows, meta)
    paths["md"].write_text(table)
    has_png = plot(rows, paths["png"])
    print(table)
    keep = [
        "workload", "world_size", "rate", "method", "batch", "samples", "numel",
        "step_time_warmup", "step_time_compression", "after_backward_compression",
        "cpu_main_compression", "cpu_other_compression", "bytes_warmup", "bytes_compression",
        "tx_bytes_warmup", "tx_bytes_compression", "bytes_inter_node_compression",
        "tx_bytes_node_compression", "final_val_loss", "target_loss",
        "time_to_target_s", "repeats", "step_time_compression_runs", "x_floor_runs",
        "x_sync_floor_runs", "final_val_loss_runs",
    ]  # fmt: skip
    summary = {
        "json": str(paths["json"]),
        "md": str(paths["md"]),
        "png": str(paths["png"]) if has_png else None,
        "wall_s": meta["wall_s"],
        "targets": targets,
        "rows": [
            {k: row.get(k) for k in keep}
            | ({"error": row["error"][:500]} if "error" in row else {})
            for row in rows
        ],
    }
    print(json.dumps(summary))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
