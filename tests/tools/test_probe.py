"""``lightning-onebit probe``: on 2 CPU ranks, on 2 emulated nodes behind a ``tc tbf``-capped
link (its bandwidth estimate against the cap), and its errors on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_onebit.comm import fp32_allreduce_bytes
from lightning_onebit.probe import (
    Link,
    Measured,
    ProbeError,
    build_model,
    detect_launch,
    expected_slowest,
    fit_link,
    main,
    predict,
)
from tests.helpers.cluster import cluster_module, skip_reason
from tests.helpers.dist import script_env
from tests.helpers.probe_model import TinyLM

ROOT = Path(__file__).resolve().parents[2]
PROBE = [sys.executable, "-m", "lightning_onebit.probe"]
#: no launcher in the tests' own environment
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "SLURM_NTASKS",
               "SLURM_PROCID", "NODE_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    return script_env(**extra)


@pytest.mark.slow
def test_two_cpu_ranks_print_a_recommendation() -> None:
    """``--devices 2`` spawns two gloo ranks, times the model's forward/backward and every
    method at its size, and prints the table and a recommendation."""
    out = subprocess.run(
        [*PROBE, "--devices", "2", "--model", "tests.helpers.probe_model:TinyLM", "--repeats", "2",
         "--steps", "500", "--warmup-fraction", "0.1"],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    numel = sum(p.numel() for p in TinyLM().parameters())
    assert f"2 ranks (1 node(s) x 2), gloo on cpu, {numel:,} parameters" in text
    assert "inside a node" in text and "between nodes" not in text  # one machine
    for row in ("DDP (fp32 allreduce)", "DDP + bf16 hook", "1-bit flat "):
        assert row in text
    assert "1-bit two-level" not in text  # one node: nothing to split
    rec = next(ln for ln in text.splitlines() if ln.startswith("recommendation:"))
    assert "stay with DDP" in rec or "OneBitStrategy(algorithm='onebit_adam'" in rec
    assert "run of 500 (50 warmup)" in text


@pytest.mark.slow
def test_two_emulated_nodes_measure_the_capped_link() -> None:
    """Two network namespaces joined by a 200 Mbit/s ``tc tbf`` link, one rank each, started as
    torchrun would (RANK, WORLD_SIZE, MASTER_ADDR): the bandwidth estimate between nodes is
    within 20% of the cap, the byte counts are the exchange's, and it recommends."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    cluster = cluster_module()
    rate_bps = 200e6
    with cluster.Cluster(2, 1) as c:
        c.set_rate("200mbit")
        procs = []
        for r in range(2):
            cmd = ["ip", "netns", "exec", c.ranks[r], "env", f"MASTER_ADDR={c.addrs[0]}",
                   f"MASTER_PORT={20000 + os.getpid() % 20000}", f"RANK={r}", "WORLD_SIZE=2", "LOCAL_WORLD_SIZE=1",
                   f"GLOO_SOCKET_IFNAME={c.ifname}", *PROBE, "--params", "1e6",
                   "--step-ms", "50", "--repeats", "2", "--json"]  # fmt: skip
            pipe = subprocess.PIPE
            procs.append(
                subprocess.Popen(cmd, stdout=pipe, stderr=pipe, text=True, env=_env(), cwd=ROOT)
            )
        outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert outs[1][0].strip() == ""  # rank 0 reports
    got = json.loads(outs[0][0])
    m = got["measured"]
    assert list(m["links"]) == ["inter"]
    bw_bits = 8 * m["links"]["inter"]["bandwidth_Bps"]
    assert abs(bw_bits / rate_bps - 1) < 0.2, bw_bits
    n = 1_000_000
    assert m["numel"] == n and m["compute_s"] >= 0.05  # --step-ms, plus contention if any
    assert m["bytes_step"]["fp32"] == fp32_allreduce_bytes(n, 2)
    assert m["bytes_step"]["bf16"] == fp32_allreduce_bytes(n, 2) // 2
    # 1 bit per value each way (and a 4-byte scale per record): 32x fewer than fp32
    assert m["bytes_step"]["onebit"] == pytest.approx(m["bytes_step"]["fp32"] / 32, rel=0.01)
    ddp = got["methods"]["ddp"]["compression"]
    # at 200 Mbit/s the fp32 allreduce of 4 MB is ~160 ms, what the prediction must include
    assert ddp["comm_alone_s"] == pytest.approx(8 * 4e6 / rate_bps, rel=0.35)
    assert got["recommendation"]["choice"] in ("OneBitStrategy", "stay with DDP")


# --------------------------------------------------------------------------- bad input


def test_no_launcher_environment_is_an_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    assert main(["--params", "1e6"]) == 2
    err = capsys.readouterr().err
    assert "no launcher environment" in err and "--devices" in err and "torchrun" in err


def test_world_size_one_is_an_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    assert main(["--params", "1e6", "--devices", "1"]) == 2
    assert "needs at least 2" in capsys.readouterr().err
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    with pytest.raises(ProbeError, match="world size 1"):
        detect_launch(None, env=env)


def test_a_model_that_does_not_import_is_an_error(capsys: pytest.CaptureFixture) -> None:
    assert main(["--devices", "2", "--model", "no_such_package.models:Net"]) == 2
    err = capsys.readouterr().err
    assert "importing 'no_such_package.models' failed" in err
    assert main(["--devices", "2", "--model", "tests.helpers.probe_model:Missing"]) == 2
    assert "has no attribute 'Missing'" in capsys.readouterr().err
    assert main(["--devices", "2", "--model", "tests.helpers.probe_model"]) == 2
    assert "expected module:Class" in capsys.readouterr().err
    with pytest.raises(ProbeError, match="no example_input_array"):
        build_model("tests.helpers.probe_model:NoExample", {}, torch.device("cpu"))


def test_the_launchers_are_read() -> None:
    torchrun = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                "MASTER_ADDR": "node0", "MASTER_PORT": "1234", "TORCHELASTIC_RUN_ID": "x"}  # fmt: skip
    info = detect_launch(None, env=torchrun)
    assert (info.launcher, info.rank, info.world_size, info.ranks_per_node) == ("torchrun", 3, 8, 4)
    assert (info.master_addr, info.master_port) == ("node0", 1234)
    slurm = {"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
             "SLURM_TASKS_PER_NODE": "4(x2)", "MASTER_ADDR": "n1"}  # fmt: skip
    info = detect_launch(None, env=slurm)
    assert (info.launcher, info.rank, info.ranks_per_node, info.local_rank) == ("slurm", 5, 4, 1)
    lightning = {"MASTER_ADDR": "n0", "MASTER_PORT": "2345", "NODE_RANK": "1"}
    info = detect_launch(4, num_nodes=2, env=lightning)
    assert (info.launcher, info.world_size, info.node_rank, info.rank) == ("lightning", 8, 1, None)
    with pytest.raises(ProbeError, match="MASTER_ADDR"):
        detect_launch(4, num_nodes=2, env={})


# --------------------------------------------------------------------------- the model


def test_the_link_fit_recovers_latency_and_bandwidth() -> None:
    """Times made from a known link (2 ranks: the wire carries the buffer once) give it back."""
    lat, bw = 2e-4, 1.25e8
    pts = [(b, lat + b / bw) for b in (4096, 2**14, 2**16, 2**18, 2**20, 2**22, 2**24)]
    link = fit_link(pts, 2)
    assert link.latency_s == pytest.approx(lat + 4096 / bw)
    assert link.bandwidth_Bps == pytest.approx(bw, rel=1e-6)


def test_the_compute_term_is_the_expected_slowest_rank() -> None:
    """Ranks that start every step together wait for the slowest: the expectation of the
    largest of one call time per rank, against a brute-force average over every combination."""
    # equal means, out of phase: the slowest is 0.03 unless both draw 0.01 (1 in 4)
    alternating = torch.tensor([[0.01, 0.03, 0.01, 0.03], [0.03, 0.01, 0.03, 0.01]])
    assert expected_slowest(alternating) == pytest.approx(0.025, rel=1e-6)
    assert expected_slowest(torch.tensor([[1.0, 2.0, 6.0]])) == pytest.approx(3.0)  # one rank
    assert expected_slowest(torch.tensor([[1.0, 1.0], [2.0, 2.0]])) == 2.0  # a slower rank
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    times = torch.rand(3, 5, generator=gen, dtype=torch.float64)
    combos = torch.cartesian_prod(*[torch.arange(5)] * 3)  # every draw, one per rank
    brute = times[torch.arange(3), combos].max(1).values.mean()
    assert expected_slowest(times) == pytest.approx(float(brute), rel=1e-12)
    assert expected_slowest(times) > times.mean(1).max()  # the spread costs time


def _measured(comm_s: float, exposed: dict[str, float], nodes: int = 1) -> Measured:
    n = 25_000_000
    names = ("fp32", "bf16", "onebit") + (
        ("onebit_hier", "fp32_hier", "bf16_hier") if nodes > 1 else ()
    )
    names += tuple(k for k in exposed if k not in names)  # e.g. "int4", where measured
    return Measured(
        world_size=4, ranks_per_node=4 // nodes, backend="gloo", device="cpu", numel=n,
        compute_s=0.5, compute_source="test",
        links={"inter": Link(2, 1e-3, 1.25e8)},
        comm_s={k: exposed.get(k, comm_s) for k in names},  # exposed: nothing hidden
        exposed_s={k: exposed.get(k, 0.0) for k in names},
        update_s={"torch_adam": 0.02, "adam_warmup": 0.01, "frozen_adam": 0.01},
        kernels_s={}, bytes_step=dict.fromkeys(names, 1), bytes_node=dict.fromkeys(names, 1),
        bucket_mb=25.0,
    )  # fmt: skip


def test_the_recommendation_follows_the_exposed_communication() -> None:
    # communication hidden behind backward: nothing to win
    pred = predict(_measured(0.05, {}), steps=1000, warmup_fraction=0.2)
    assert pred["recommendation"]["choice"] == "stay with DDP"
    assert pred["methods"]["ddp"]["compression"]["step_s"] == pytest.approx(0.52)
    # 1.2 s of fp32 allreduce exposed, 0.6 s bf16, 0.05 s 1-bit: 1-bit Adam, bf16 warmup
    slow = {"fp32": 1.2, "bf16": 0.6, "onebit": 0.05}
    pred = predict(_measured(1.2, slow), steps=1000, warmup_fraction=0.2)
    rec = pred["recommendation"]
    assert rec["choice"] == "OneBitStrategy" and rec["options"]["average_dtype"] == "bf16"
    assert rec["options"]["hierarchical"] is False
    # nothing was hidden behind backward: the fewest buckets (round trips) are best
    assert rec["options"]["overlap_bucket_mb"] == 100.0
    run = 200 * (0.5 + 0.6 + 0.01) + 800 * (0.5 + 0.05 + 0.01)
    assert rec["run_s"] == pytest.approx(run) and rec["baseline_run_s"] == pytest.approx(1720)
    # two nodes, the two-level exchange cheaper: hierarchical
    hier = {**slow, "onebit_hier": 0.02, "fp32_hier": 0.9, "bf16_hier": 0.45}
    rec = predict(_measured(1.2, hier, nodes=2), 1000, 0.2)["recommendation"]
    assert rec["options"]["hierarchical"] is True and rec["method"] == "onebit_hier_bf16"
    # the warmup in int4 codes (in step(): all of it exposed) cheaper than bf16: int4
    coded = {**slow, "int4": 0.16}
    pred = predict(_measured(1.2, coded), 1000, 0.2)
    rec = pred["recommendation"]
    assert rec["method"] == "onebit_int4" and rec["options"]["average_dtype"] == "int4"
    assert pred["methods"]["onebit_int4"]["warmup"]["step_s"] == pytest.approx(0.5 + 0.16 + 0.01)
    assert pred["methods"]["onebit_bf16"]["run_s"] > rec["run_s"]
    # with int8 measured too, the variance window's steps (at torch Adam's beta2 0.999, 1000
    # steps, at most the warmup) are int8's: a warmup of 200 all int8, of 4000 a quarter
    window = {**coded, "int8": 0.3}
    for steps, share in ((1000, 1.0), (20000, 0.25)):
        warm = predict(_measured(1.2, window), steps, 0.2)["methods"]["onebit_int4"]["warmup"]
        exposed = (1 - share) * 0.16 + share * 0.3
        assert warm["step_s"] == pytest.approx(0.5 + exposed + 0.01)
