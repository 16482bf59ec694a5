"""A 2-rank ``OneBitStrategy`` fit in which rank 1 dies or stops in the compression phase.

Used by ``tests/integration/test_strategy_timeout.py``: the :class:`Stall` callback in fork-started fits
inside pytest, and the whole file as a script for the default ``popen`` launcher, which starts
rank 1 by running this file again::

    python tests/scripts/stall_fit.py {dies|stuck} TIMEOUT_SECONDS OUT_DIR {OVERLAP_MB|none}

Rank 1 writes the time at which it stopped to ``OUT_DIR/stopped``. A stopped rank 1 sleeps
three timeouts, then goes on: a rank 0 that does not honour the timeout finishes the fit.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

STOP_AT = 6  # optimizer step at which rank 1 stops; compression starts after step FREEZE
FREEZE = 3
STEPS = 20


class Stall(Callback):
    """On rank 1, at the start of step ``STOP_AT``: exit without a goodbye, or sleep."""

    def __init__(self, mode: str, out: Path, sleep: float) -> None:
        self.mode, self.out, self.sleep = mode, Path(out), sleep

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank != 1 or trainer.global_step != STOP_AT:
            return
        assert trainer.strategy.onebit_optimizer.phase == "compression"
        (self.out / "stopped").write_text(repr(time.time()))
        if self.mode == "dies":
            os._exit(1)  # the socket closes under rank 0
        time.sleep(self.sleep)  # stopped: never reaches the next exchange


def strategy(timeout_s: float, start_method: str, overlap_mb: float | None) -> Any:
    from lightning_onebit import OneBitStrategy

    return OneBitStrategy(
        freeze_step=FREEZE,
        timeout=timedelta(seconds=timeout_s),
        start_method=start_method,
        overlap_bucket_mb=overlap_mb,
    )


def main(mode: str, timeout_s: float, out: Path, overlap_mb: float | None) -> None:
    from torch.utils.data import DataLoader

    from tests.helpers.char_model import CharModel, CharWindows, _corpus

    trainer = L.Trainer(
        strategy=strategy(timeout_s, "popen", overlap_mb),
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Stall(mode, out, sleep=3 * timeout_s)],
    )
    loader = DataLoader(CharWindows(_corpus(), STEPS * 32 * 2), batch_size=32)
    trainer.fit(CharModel(), loader)
    print("fit returned", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests` and the package
    overlap = None if sys.argv[4] == "none" else float(sys.argv[4])
    main(sys.argv[1], float(sys.argv[2]), Path(sys.argv[3]), overlap)
