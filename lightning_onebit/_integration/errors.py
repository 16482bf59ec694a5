"""What users see when something goes wrong outside our own code: one traceback (not one per
rank) when every rank stops on the same error, and DDP's unused-parameters error pointing to our
strategy names."""

from __future__ import annotations

import re
import sys
from types import TracebackType

from lightning_onebit.comm import NonFiniteError

__all__ = ["name_unused_parameters", "quiet_errors_on_this_rank"]


def quiet_errors_on_this_rank(rank: int) -> None:
    """On ranks > 0 of a script-launched run (torchrun, Lightning's popen launcher, SLURM), print
    one line instead of a traceback for an uncaught error that every rank raises in the same
    step (a diverged run's [`NonFiniteError`][lightning_onebit.comm.base.NonFiniteError]): rank 0
    prints the traceback, so the log holds one traceback instead of one per rank. The exit code
    stays 1. Fork- and spawn-started ranks hand their error to the parent process, which shows
    one."""
    if rank == 0 or getattr(sys.excepthook, "_onebit_rank", None) is not None:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], err: BaseException, tb: TracebackType | None) -> None:
        if isinstance(err, NonFiniteError):
            print(
                f"[rank {rank}] stopped: {kind.__name__} (raised on every rank; rank 0 prints "
                "the traceback)",
                file=sys.stderr,
                flush=True,
            )
            return
        previous(kind, err, tb)

    hook._onebit_rank = rank  # type: ignore[attr-defined]
    sys.excepthook = hook


def name_unused_parameters(exception: BaseException, algorithm: str, strategy: str) -> None:
    """Replace DDP's "Expected to have finished reduction" message in ``exception`` by one that
    names our ``*_find_unused_parameters_true`` strategies and ``strategy``, the class the user built
    (DDPStrategy's own names DDP's strategies, which would drop 1-bit training)."""
    pattern = ".*Expected to have finished reduction in the prior iteration.*"
    new_message = (
        "Some parameters of your LightningModule were not used in producing the loss "
        "returned by training_step. If this is intentional, enable the detection of "
        f"unused parameters: strategy='{algorithm}_find_unused_parameters_true' or "
        f"{strategy}(algorithm='{algorithm}', find_unused_parameters=True) "
        "(DDPStrategy(find_unused_parameters=True) would train without 1-bit compression)"
    )
    exception.args = tuple(
        new_message if isinstance(a, str) and re.match(pattern, a, re.DOTALL) else a
        for a in exception.args
    )
