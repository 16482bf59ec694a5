"""Several nodes, emulated on one machine: two launches of the same script, one per "node", as a
cluster scheduler would start them.

Each launch is a node of one rank: ``Trainer(num_nodes=2, devices=1)`` under Lightning's own
environment variables (``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) or under
``torchrun --nnodes 2 --node-rank N``. Every algorithm (``tests/scripts/multinode_fit.py``) fits 8 steps
(4 compressed), saves, and is resumed to 16 steps by two new launches whose ``NODE_RANK``s are
swapped. What must hold: the ranks Lightning assigns are the node's; the parameters and losses
equal those of a single-node run with the same world size (bit for bit: the same collectives
over the same ranks); 1-bit Adam's and 1-bit LAMB's ranks are identical; every rank writes its
own 1-bit state beside the checkpoint and reads it back after the swap.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.dist import script_env

pytestmark = [pytest.mark.slow, pytest.mark.long]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "multinode_fit.py"
ALGORITHMS = ("onebit_adam", "zero_one_adam", "onebit_lamb")
_single: dict[str, Path] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    return script_env(**extra)


def _run_all(cmds: list[tuple[list[str], dict[str, str]]]) -> None:
    procs = [
        subprocess.Popen(c, env=e, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for c, e in cmds
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"a launch exited with {p.returncode}:\n{out[-4000:]}"


def _launch(mode: str, out: Path, stage: str, swap: bool = False, per_node: int = 1) -> None:
    """Run ``stage`` as one single-node launch (``mode="single"``, 2 ranks) or as two node
    launches of ``per_node`` ranks each; ``swap`` gives launch ``i`` the node rank ``1 - i``."""
    port = str(_free_port())
    if mode == "single":
        cmd = [sys.executable, str(SCRIPT), str(out), "1", "2", stage]
        _run_all([(cmd, _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port))])
        return
    cmds = []
    for i in range(2):
        node = str(1 - i if swap else i)
        if mode == "lightning_env":
            cmd = [sys.executable, str(SCRIPT), str(out), "2", str(per_node), stage]
            env = _env(NODE_RANK=node, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        else:
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--node-rank", node, "--nproc-per-node", str(per_node), "--master-addr",
                "127.0.0.1", "--master-port", port, str(SCRIPT), str(out), "2", str(per_node),
                stage,
            ]  # fmt: skip
            env = _env()
        cmds.append((cmd, env))
    _run_all(cmds)


def _records(out: Path, stage: str, algorithm: str, world: int = 2) -> list[dict]:
    return [
        torch.load(out / f"{stage}-{algorithm}-rank{r}.pt", weights_only=True) for r in range(world)
    ]


def _single_node(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if "out" not in _single:  # one reference run, shared by the launch modes
        out = tmp_path_factory.mktemp("single")
        _launch("single", out, "first")
        _launch("single", out, "resume")
        _single["out"] = out
    return _single["out"]


@pytest.mark.parametrize("mode", ["lightning_env", "torchrun"])
def test_two_nodes_train_and_resume_like_one(
    mode: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    single = _single_node(tmp_path_factory)
    out = tmp_path_factory.mktemp(mode)
    _launch(mode, out, "first")
    _launch(mode, out, "resume", swap=True)
    for algorithm in ALGORITHMS:
        for stage in ("first", "resume"):
            got, want = _records(out, stage, algorithm), _records(single, stage, algorithm)
            where = f"{algorithm}, {stage}"
            for r, (g, w) in enumerate(zip(got, want, strict=True)):
                assert (g["global_rank"], g["node_rank"], g["local_rank"]) == (r, r, 0), where
                assert g["world_size"] == w["world_size"] == 2, where
                assert g["phase"] == w["phase"] != "warmup", where
                assert torch.isfinite(g["params"]).all(), where
                assert torch.equal(g["params"], w["params"]), (
                    f"{where}: rank {r} differs from the single-node run by "
                    f"{(g['params'] - w['params']).abs().max():.3g}"
                )
                assert g["loss"] == w["loss"], where
            if algorithm != "zero_one_adam":  # (0/1 Adam's ranks differ between synchronisations)
                assert torch.equal(got[0]["params"], got[1]["params"]), where
            files = [f"{algorithm}.ckpt.onebit-rank{r}-of-2" for r in range(2)]
            assert got[0]["rank_files"] == files, (where, got[0]["rank_files"])


def test_two_nodes_of_two_ranks_exchange_in_two_levels_and_resume_with_nodes_swapped(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """2 nodes x 2 ranks, Lightning's environment and torchrun: the default
    ``hierarchical="auto"`` exchanges in two levels (``HierarchicalAllreduce`` per bucket, the
    inter-node counters at about half of what crossed the nodes' links in the flat exchange);
    both launchers give the same bits; every rank identical (1-bit Adam, 1-bit LAMB); the
    per-rank (per-shard) files resume with the node ranks swapped."""
    runs = {}
    for mode in ("lightning_env", "torchrun"):
        out = tmp_path_factory.mktemp(f"{mode}-2x2")
        _launch(mode, out, "first", per_node=2)
        _launch(mode, out, "resume", swap=True, per_node=2)
        runs[mode] = out
    for algorithm in ALGORITHMS:
        for stage in ("first", "resume"):
            got = _records(runs["lightning_env"], stage, algorithm, 4)
            want = _records(runs["torchrun"], stage, algorithm, 4)
            where = f"{algorithm}, {stage}"
            for r, (g, w) in enumerate(zip(got, want, strict=True)):
                assert (g["global_rank"], g["world_size"]) == (r, 4), where
                assert (g["node_rank"], g["local_rank"]) == divmod(r, 2), where
                assert g["exchange"] == "HierarchicalAllreduce", where
                assert g["phase"] == w["phase"] != "warmup", where
                assert torch.isfinite(g["params"]).all(), where
                assert torch.equal(g["params"], w["params"]), where
                stats = g["comm_stats"]
                assert 0 < stats["bytes_total_inter"] < stats["bytes_total"], where
                assert {"onebit/bytes_step_inter", "onebit/ratio_vs_ddp_inter"} <= set(
                    g["metrics"]
                ), (where, g["metrics"])
            if algorithm != "zero_one_adam":
                for g in got[1:]:
                    assert torch.equal(g["params"], got[0]["params"]), where
            files = [f"{algorithm}.ckpt.onebit-rank{r}-of-4" for r in range(4)]
            assert got[0]["rank_files"] == files, (where, got[0]["rank_files"])
