"""Run a function in W real processes joined by a gloo process group (test helper).

Children are forked (fast: no re-import of torch) and run with one torch/OpenMP thread each:
GNU OpenMP is not fork-safe once the parent has used a thread pool, and W ranks share the
cores anyway.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
#: what a launcher (torchrun, Lightning, SLURM) sets; Lightning leaves several of them in
#: ``os.environ`` after an in-process fit
_LAUNCH_PREFIXES = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE",
                    "LOCAL_WORLD_SIZE", "MASTER_", "TORCHELASTIC", "PL_", "SLURM_")  # fmt: skip


def script_env(**extra: str) -> dict[str, str]:
    """A fresh shell's environment for a script the tests start: this process's, without any
    launcher variable (a script that inherits ``LOCAL_RANK`` takes its ranks for started by
    someone else and starts none, so rank 0 waits for a rank 1 that never comes), with one
    OpenMP thread and the checkout on ``PYTHONPATH``; ``extra`` is added last."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES)}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, q: Any, args: tuple
) -> None:
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
        return
    try:
        result = fn(rank, world_size, *args)
    except BaseException:
        # reported before the group goes: destroying it resets the peers' connections, and
        # their errors must not arrive first and hide the cause
        q.put((rank, "error", traceback.format_exc()))
        dist.destroy_process_group()
        return
    dist.destroy_process_group()
    buf = io.BytesIO()  # plain bytes: tensors must not travel as shared-memory handles
    torch.save(result, buf)
    q.put((rank, "ok", buf.getvalue()))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    start_method: str = "fork",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be defined at module level; its result must be picklable. A failure on any
    rank raises ``RuntimeError`` with every rank's outcome (traceback, or exit code). ``start_method="spawn"`` where
    the parent has initialised CUDA (a forked child cannot use it).
    """
    ctx = mp.get_context(start_method)
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, port, q, args), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            # after a failure, the other ranks get a few seconds to report theirs
            left = (
                deadline - time.monotonic()
                if not errors
                else min(10.0, deadline - time.monotonic())
            )
            try:
                rank, status, payload = q.get(timeout=max(left, 0.0))
            except queue.Empty:
                break
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    if len(results) < world_size:
        raise RuntimeError(_failure(procs, results, errors, timeout))
    return [results[r] for r in range(world_size)]


def _failure(
    procs: list[Any], results: dict[int, Any], errors: dict[int, str], timeout: float
) -> str:
    """What each rank did: finished, raised (its traceback), or neither (its exit code; a
    negative one is the signal that ended it, -9 ours after the timeout)."""
    lines = [f"{len(procs) - len(results)} of {len(procs)} ranks failed (timeout {timeout:.0f} s)"]
    for r, p in enumerate(procs):
        if r in results:
            lines.append(f"rank {r}: ok")
        elif r in errors:
            lines.append(f"rank {r} failed (exit code {p.exitcode}):\n{errors[r]}")
        else:
            lines.append(f"rank {r} reported nothing (exit code {p.exitcode})")
    return "\n".join(lines)
