"""Smoke test of the emulated-cluster benchmark (benchmarks/cluster.py): W = 2 network
namespaces on a 100 Mbit/s link, a tiny model, a few steps of DDP + Adam and 1-bit Adam, the
latter in the plain loop, through ``L.Trainer(strategy=OneBitStrategy(...))`` and through
``L.Fabric(strategy=OneBitFabricStrategy(...))``, all under the cosine LR schedule (the LR
scheduler the strategies re-point at the optimizer they build).

Needs root and iproute2 (``ip netns add``); skipped with the reason elsewhere.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cluster import SCRIPT, cluster_module, skip_reason


def test_the_cosine_schedule_warms_up_linearly_then_decays_to_a_tenth() -> None:
    spec = importlib.util.spec_from_file_location(
        "_bench_worker", SCRIPT.with_name("cluster_worker.py")
    )
    assert spec and spec.loader
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    assert worker.lr_factor({"steps": 100}) is None  # constant: no scheduler at all
    f = worker.lr_factor({"steps": 100, "lr_schedule": "cosine", "lr_warmup": 4})
    # the k-th optimizer step (k = 0, 1, ...) runs at lr * f(k)
    assert [f(k) for k in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert f(4) == pytest.approx(1.0)
    assert f(99) == pytest.approx(0.1)  # the last step
    mid = 4 + (99 - 4) / 2
    assert f(int(mid)) == pytest.approx(0.55, abs=0.02)
    falling = [f(k) for k in range(4, 100)]
    assert all(a >= b for a, b in itertools.pairwise(falling))
    assert math.isclose(min(falling), 0.1)


def _run_cluster(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """``benchmarks/cluster.py ARGS --out-dir tmp_path`` (skipped where namespaces cannot be
    made); asserts it succeeded and returns the process and its stdout. On a timeout it gets
    SIGTERM, whose handler tears the namespaces down (SIGKILL would leave them)."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    cmd = [sys.executable, str(SCRIPT), *args, "--out-dir", str(tmp_path), "--timeout", "120"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-4000:]
    return proc, out


@pytest.mark.slow
def test_cluster_smoke(tmp_path: Path) -> None:
    proc, out = _run_cluster(
        tmp_path,
        "--world-sizes", "2", "--rates", "100mbit", "--model", "tiny",
        "--workloads", "finetune", "--methods",
        "ddp_adam,onebit_adam,pl_onebit_adam,fabric_onebit_adam,nocomm_sync",
        "--steps", "8", "--warmup", "4", "--eval-every", "4", "--val-windows", "8",
        "--lr-schedule", "cosine", "--lr-warmup", "2", "--name", "smoke",
    )  # fmt: skip
    summary = json.loads(out.strip().splitlines()[-1])

    # the run's namespaces are gone
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"obc{proc.pid}x" not in left  # pid of `cluster.py` is in every name it creates

    for ext in ("json", "md", "png"):
        assert (tmp_path / f"smoke.{ext}").is_file()
    rows = {r["method"]: r for r in summary["rows"]}
    synced = rows.pop("nocomm_sync")
    assert set(rows) == {"ddp_adam", "onebit_adam", "pl_onebit_adam", "fabric_onebit_adam"}
    # the synchronised floor: no bytes of its own, but its one-value all-reduce on the wire
    assert "error" not in synced and synced["step_time_compression"] > 0
    assert synced["bytes_compression"] == 0 and 0 < synced["tx_bytes_compression"] < 4096
    for r in rows.values():
        assert "error" not in r
        assert r["step_time_warmup"] > 0 and r["step_time_compression"] > 0
        assert r["after_backward_compression"] > 0
        # a thread's CPU time fits in the step's wall time; the other threads' is not negative
        assert 0 < r["cpu_main_compression"] <= 1.1 * r["step_time_compression"]
        assert r["cpu_other_compression"] >= 0
        assert r["final_val_loss"] is not None
        # the project's counters agree with the interface's (which add TCP/IP headers)
        for ph in ("warmup", "compression"):
            assert r[f"bytes_{ph}"] * 0.9 < r[f"tx_bytes_{ph}"] < r[f"bytes_{ph}"] * 1.5 + 4096
    ddp, onebit = rows["ddp_adam"], rows["onebit_adam"]
    # fp32 averaging in the warmup; the optimizer used directly (plain torch.distributed) adds
    # the ranks' agreement on parameters without a gradient, one byte per tensor (ring)
    agreement = onebit["bytes_warmup"] - ddp["bytes_warmup"]
    numel = json.loads((tmp_path / "smoke.json").read_text())["rows"][0]["numel"]
    assert 0 < agreement < 1e-3 * numel, agreement
    assert onebit["bytes_compression"] < ddp["bytes_compression"] / 20  # ~32x less
    # through the Trainer and through Fabric: the same phases, bytes and (up to summation
    # order) the same training
    full = {r["method"]: r for r in json.loads((tmp_path / "smoke.json").read_text())["rows"]}
    for r in full.values():  # (each rank's time after backward is part of its own step)
        pairs = zip(r["after_backward_times"], r["own_step_times"], strict=True)
        assert all(0 <= a <= s for a, s in pairs), r["method"]
    for method in ("pl_onebit_adam", "fabric_onebit_adam"):
        pl = rows[method]
        assert full[method]["phases"] == full["onebit_adam"]["phases"]
        assert full[method]["opt_phases"] == full["onebit_adam"]["opt_phases"]
        for ph in ("warmup", "compression"):  # (DDP's gradients: nothing to agree on)
            assert pl[f"bytes_{ph}"] == onebit[f"bytes_{ph}"] - agreement
        loss = onebit["final_val_loss"]
        assert abs(pl["final_val_loss"] - loss) < 0.02 * loss, method


def test_repeats_rotate_the_methods_and_take_ratios_within_a_repeat() -> None:
    cluster = cluster_module()
    assert cluster.run_order(["a", "b", "c"], 4) == [
        (0, "a"), (0, "b"), (0, "c"),
        (1, "b"), (1, "c"), (1, "a"),
        (2, "c"), (2, "a"), (2, "b"),
        (3, "a"), (3, "b"), (3, "c"),
    ]  # fmt: skip
    rng = random.Random(7)
    cell = {"workload": "finetune", "world_size": 2, "rate": "100mbit", "batch": 4, "samples": 8}
    runs, steps = [], {}
    for rep, method in cluster.run_order(["nocomm", "nocomm_sync", "onebit_adam"], 3):
        t = rng.uniform(0.5, 1.5)
        steps[rep, method] = t
        runs.append(
            cell
            | {
                "method": method,
                "repeat": rep,
                "step_time_compression": t,
                "step_time_warmup": 2 * t,
                "after_backward_compression": t / 10,
                "final_val_loss": None if method.startswith("nocomm") else 3.0,
            }
        )
    # a second cell, where one repeat of one method failed
    other = cell | {"rate": "1gbit"}
    runs += [
        other | {"method": "nocomm", "repeat": 0, "step_time_compression": 1.0},
        other | {"method": "onebit_adam", "repeat": 0, "error": "rank 1 exited with 1"},
        other | {"method": "onebit_adam", "repeat": 1, "step_time_compression": 1.2},
        other | {"method": "nocomm", "repeat": 1, "step_time_compression": 0.8},
    ]
    rows = {(r["rate"], r["method"]): r for r in cluster.aggregate(runs)}
    assert len(rows) == 5
    one = rows["100mbit", "onebit_adam"]
    assert one["repeats"] == 3 and "repeat" not in one
    assert one["step_time_compression"] == statistics.median(
        steps[k, "onebit_adam"] for k in range(3)
    )
    assert one["step_time_warmup"] == statistics.median(
        2 * steps[k, "onebit_adam"] for k in range(3)
    )
    assert one["x_floor_runs"] == [steps[k, "onebit_adam"] / steps[k, "nocomm"] for k in range(3)]
    assert one["x_sync_floor_runs"] == [
        steps[k, "onebit_adam"] / steps[k, "nocomm_sync"] for k in range(3)
    ]
    assert one["final_val_loss_runs"] == [3.0] * 3
    assert rows["100mbit", "nocomm"]["x_floor_runs"] == [1.0] * 3
    failed = rows["1gbit", "onebit_adam"]
    assert failed["error"] == "rank 1 exited with 1"
    assert failed["step_time_compression"] == 1.2  # the median of the repeat that ran
    assert failed["x_floor_runs"] == [None, 1.2 / 0.8]
    assert "x_sync_floor_runs" not in failed  # no synchronised floor in that cell

    meta = {
        "when": "now", "host": "h", "cpus": 2, "torch": "t", "model": "base", "steps": 27,
        "warmup": 3, "threads": 1, "repeats": 3,
    }  # fmt: skip
    table = cluster.markdown(list(rows.values()), meta)
    ratios = sorted(one["x_floor_runs"])
    expect = f"{ratios[1]:.2f} ({ratios[0]:.2f}-{ratios[2]:.2f})"
    assert "### x floor (`nocomm`)" in table and "### x synchronised floor" in table
    matrix_row = next(
        line for line in table.splitlines() if line.startswith("| finetune (batch 4)")
    )
    assert expect in matrix_row


@pytest.mark.slow
def test_cluster_repeats(tmp_path: Path) -> None:
    _run_cluster(
        tmp_path,
        "--world-sizes", "2", "--rates", "100mbit", "--model", "tiny",
        "--workloads", "finetune", "--methods", "nocomm,onebit_adam", "--repeats", "2",
        "--steps", "6", "--warmup", "3", "--eval-every", "3", "--val-windows", "4",
        "--name", "rep",
    )  # fmt: skip
    record = json.loads((tmp_path / "rep.json").read_text())
    order = [(r["repeat"], r["method"]) for r in record["runs"]]
    assert order == [(0, "nocomm"), (0, "onebit_adam"), (1, "onebit_adam"), (1, "nocomm")]
    rows = {r["method"]: r for r in record["rows"]}
    runs = {(r["repeat"], r["method"]): r for r in record["runs"]}
    one = rows["onebit_adam"]
    assert one["x_floor_runs"] == [
        runs[k, "onebit_adam"]["step_time_compression"] / runs[k, "nocomm"]["step_time_compression"]
        for k in range(2)
    ]
    # the same seed and data: both repeats train the same model to the same loss
    a, b = one["final_val_loss_runs"]
    assert a is not None and a == b
    assert "### x floor (`nocomm`)" in (tmp_path / "rep.md").read_text()
