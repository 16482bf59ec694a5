"""How the probe was started: the launcher's environment (torchrun, SLURM, Lightning's
variables) or ``--devices`` alone, and the probe's error for bad input."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

__all__ = ["LaunchInfo", "ProbeError", "detect_launch"]


class ProbeError(RuntimeError):
    """Bad input or an unusable launch: the message says what to do."""


@dataclass
class LaunchInfo:
    """Where this process sits in the job: what the launcher said (or ``spawn``: the probe
    starts ``local_world_size`` processes itself)."""

    launcher: str
    world_size: int
    ranks_per_node: int
    node_rank: int = 0
    rank: int | None = None  # None: spawned (the local rank decides)
    local_rank: int | None = None
    master_addr: str = "127.0.0.1"
    master_port: int = 29500


def _env_int(env: dict[str, str], *names: str) -> int | None:
    for n in names:
        v = env.get(n, "")
        if v.strip().isdigit():
            return int(v)
    return None


def _slurm_tasks_per_node(env: dict[str, str]) -> int | None:
    """``SLURM_NTASKS_PER_NODE``, or the first count of ``SLURM_TASKS_PER_NODE`` (``4(x2)``)."""
    got = _env_int(env, "SLURM_NTASKS_PER_NODE")
    if got is None and env.get("SLURM_TASKS_PER_NODE"):
        head = env["SLURM_TASKS_PER_NODE"].split(",")[0].split("(")[0]
        got = int(head) if head.isdigit() else None
    return got


def detect_launch(
    devices: int | None,
    num_nodes: int = 1,
    ranks_per_node: int | None = None,
    env: dict[str, str] | None = None,
) -> LaunchInfo:
    """How this process was started: torchrun (or anything that sets ``RANK``/``WORLD_SIZE``),
    SLURM's ``srun``, Lightning's multi-node variables (``MASTER_ADDR``, ``NODE_RANK`` with
    ``--devices``/``--num-nodes``), or ``--devices N`` alone (one machine).

    Raises:
        ProbeError: no launcher environment and no ``--devices``; a world size of 1.
    """
    env = dict(os.environ if env is None else env)
    port = _env_int(env, "MASTER_PORT") or 29500
    rank, world = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
    if rank is not None and world is not None and "MASTER_ADDR" in env:
        info = LaunchInfo(
            "torchrun" if "TORCHELASTIC_RUN_ID" in env else "env",
            world,
            ranks_per_node or _env_int(env, "LOCAL_WORLD_SIZE") or 1,
            rank=rank,
            local_rank=_env_int(env, "LOCAL_RANK"),
            master_addr=env["MASTER_ADDR"],
            master_port=port,
        )
    elif _env_int(env, "SLURM_NTASKS") and "SLURM_PROCID" in env and devices is None:
        from lightning.fabric.plugins.environments import SLURMEnvironment

        per_node = ranks_per_node or _slurm_tasks_per_node(env) or 1
        info = LaunchInfo(
            "slurm",
            int(env["SLURM_NTASKS"]),
            per_node,
            rank=int(env["SLURM_PROCID"]),
            local_rank=_env_int(env, "SLURM_LOCALID"),
            master_addr=env.get("MASTER_ADDR")
            or SLURMEnvironment.resolve_root_node_address(env.get("SLURM_NODELIST", "127.0.0.1")),
            master_port=port,
        )
    elif devices is not None:
        if devices < 1 or num_nodes < 1:
            raise ProbeError(f"--devices and --num-nodes must be >= 1, got {devices}, {num_nodes}")
        node_rank = _env_int(env, "NODE_RANK", "GROUP_RANK") or 0
        if num_nodes > 1 and "MASTER_ADDR" not in env:
            raise ProbeError(
                f"--num-nodes {num_nodes} needs Lightning's environment on every node: "
                "MASTER_ADDR (node 0's address), MASTER_PORT and NODE_RANK (0..num_nodes-1), "
                "as for Trainer(num_nodes=...)"
            )
        info = LaunchInfo(
            "lightning" if num_nodes > 1 else "local",
            devices * num_nodes,
            devices,
            node_rank=node_rank,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=port if "MASTER_PORT" in env else _free_port(),
        )
    else:
        raise ProbeError(
            "no launcher environment found (RANK/WORLD_SIZE/MASTER_ADDR from torchrun, SLURM's "
            "SLURM_PROCID/SLURM_NTASKS, or Lightning's MASTER_ADDR/NODE_RANK with --devices): "
            "start the probe the way you start training, e.g. `torchrun --nproc-per-node 4 -m "
            "lightning_onebit.probe ...`, `srun lightning-onebit probe ...`, or on one machine "
            "`lightning-onebit probe --devices 4 ...`"
        )
    if info.world_size < 2:
        raise ProbeError(
            f"world size {info.world_size}: the probe compares ways of communicating between "
            "ranks and needs at least 2 (--devices 2 or more, or more nodes/processes)"
        )
    if info.world_size % info.ranks_per_node:
        raise ProbeError(
            f"{info.ranks_per_node} ranks per node do not divide the world size "
            f"{info.world_size}: pass --ranks-per-node"
        )
    return info


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
