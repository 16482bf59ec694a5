"""The plain-torch twin of ``restart_fit.py`` (``scripts/restart_check.py --strategies torch``):
no Lightning, no lightning_onebit, only ``torch.distributed`` under ``torchrun --max-restarts 1``::

    python -m torch.distributed.run --nproc-per-node 2 --max-restarts 1 \\
        tests/scripts/restart_plain.py OUT [--kill-at STEP] [--kill-rank R]

Each attempt starts the default gloo group with torch's ``env://`` (what Lightning's DDP does),
then all-reduces ``STEPS`` times; rank ``R`` SIGKILLs itself after ``--kill-at`` all-reduces,
once (a marker in ``OUT`` says it did). A restarted attempt starts over. Each rank writes the
final sum to ``OUT/final-rank{R}.pt``: whether restarts themselves connect, without any of our code.
"""

from __future__ import annotations

import argparse
import os
import signal
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

STEPS = 160


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--kill-rank", type=int, default=1)
    a = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(minutes=30))  # (Lightning's default)
    rank, x = dist.get_rank(), torch.ones(1000)
    marker = a.out / "killed"
    for step in range(1, STEPS + 1):
        dist.all_reduce(x)
        x /= dist.get_world_size()
        if step == a.kill_at and rank == a.kill_rank and not marker.exists():
            marker.write_text(str(step))
            os.kill(os.getpid(), signal.SIGKILL)
    torch.save({"x": x}, a.out / f"final-rank{rank}.pt")
    dist.destroy_process_group()
    print(f"restart-plain: rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
