"""2-rank fits in one script, then a normal exit (``tests/users/test_user_code.py``,
``scripts/exit_check.py``)::

    python -m torch.distributed.run --nproc-per-node 2 tests/scripts/exit_fit.py ALGORITHM [diverge]
    python tests/scripts/exit_fit.py ALGORITHM [--fits N] [--steps N] [--no-overlap] [--fork]

``ALGORITHM`` is a strategy name (``onebit_adam``, ``zero_one_adam``, ``onebit_lamb``, or
``ddp`` for plain DDP). Under ``torchrun`` the ranks exist already; run as a plain script,
Lightning's popen launcher starts rank 1 as a new process running this script; ``--fork``
forks both ranks from this process (the notebook strategies, ``start_method="fork"``).

A small attention model with the defaults a user gets (the exchange overlapped with backward, on
a thread and a process group of its own; ``--no-overlap``: exchanged in ``step()``). Each rank
prints ``exit-check: rank R pid P done`` after the fits; whatever runs after that (interpreter
shutdown) must not abort the process.

``--report-exit``: each process prints ``exit-state: ...`` at the very end of its exit handlers
(process group still initialised? which threads are alive?).

``diverge``: the loss is NaN from the start, so the run stops with ``NonFiniteError`` on every
rank (after ``max_consecutive_skips`` skipped steps); only rank 0 may print a traceback.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading


def _report_exit_state() -> None:
    """What is still alive when every other exit handler has run (registered first, it runs
    last): whether a process group is initialised, and the process's threads by name."""
    from pathlib import Path

    import torch.distributed as dist

    names = [(t / "comm").read_text().strip() for t in Path("/proc/self/task").iterdir()]
    python = [t.name for t in threading.enumerate()]
    print(f"exit-state: pid {os.getpid()} initialized={dist.is_initialized()} threads={names} "
          f"python_threads={python}", flush=True)  # fmt: skip


if "--report-exit" in sys.argv:  # (before the imports below register their own handlers)
    atexit.register(_report_exit_state)

import argparse  # noqa: E402
from typing import Any  # noqa: E402

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_onebit import OneBitStrategy  # noqa: E402


class Attention(L.LightningModule):
    def __init__(self, diverge: bool = False) -> None:
        super().__init__()
        self.diverge = diverge
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(32, 32)
        self.block = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
        self.head = torch.nn.Linear(32, 32)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        logits = self.head(self.block(self.embed(x[:, :-1])))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        return loss * float("nan") if self.diverge else loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, betas=(0.9, 0.95))


def _strategy(algorithm: str, overlap: bool, start_method: str) -> Any:
    if algorithm == "ddp":
        return DDPStrategy(start_method=start_method)
    return OneBitStrategy(
        algorithm,  # type: ignore[arg-type]
        overlap_bucket_mb=0.01 if overlap else None,  # (several buckets on this small model)
        start_method=start_method,  # type: ignore[arg-type]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("algorithm")
    parser.add_argument("diverge", nargs="?", choices=["diverge"])
    parser.add_argument("--fits", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--fork", action="store_true")
    parser.add_argument("--report-exit", action="store_true")
    args = parser.parse_args(argv)
    start_method = "fork" if args.fork else "popen"
    data = torch.randint(0, 32, (512, 9), generator=torch.Generator().manual_seed(0))
    for _ in range(args.fits):
        trainer = L.Trainer(
            strategy=_strategy(args.algorithm, not args.no_overlap, start_method),
            accelerator="cpu",
            devices=2,
            max_steps=args.steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        model = Attention(args.diverge is not None)
        trainer.fit(model, DataLoader(TensorDataset(data), batch_size=16))
    # (--fork: the fits ran in forked ranks; this is the parent, which launched them)
    print(f"exit-check: rank {trainer.global_rank} pid {os.getpid()} done", flush=True)


if __name__ == "__main__":
    main()
