"""What users see when something goes wrong outside our own code: near-miss strategy names, and
one traceback (not one per rank) when every rank stops on the same error."""

from __future__ import annotations

import re
import sys
from types import TracebackType
from typing import Any

from lightning_onebit.comm import NonFiniteError

__all__ = [
    "misspellings",
    "name_unused_parameters",
    "quiet_errors_on_this_rank",
    "refuse_misspelled",
]

#: How users spell our algorithms' names (Lightning lowercases the name first): separators,
#: digits for words, DeepSpeed's optimizer type names.
_SPELLINGS: dict[str, tuple[str, ...]] = {
    "onebit_adam": ("onebit", "one_bit", "1bit", "1_bit"),
    "zero_one_adam": ("zero_one", "zeroone", "0_1", "01", "0/1"),
    "onebit_lamb": ("onebit", "one_bit", "1bit", "1_bit"),
}


def misspellings(algorithm: str, canonical: set[str]) -> dict[str, str]:
    """Near-miss names of ``algorithm``'s registered names (``"onebit-adam"``, ``"1bit_adam"``,
    ``"onebitadam"``, ``"0/1-adam"``, ...) -> the name the user meant. ``canonical``: every
    registered name, never returned as a misspelling."""
    optimizer = algorithm.rsplit("_", 1)[1]  # adam | lamb
    out: dict[str, str] = {}
    for suffix in ("", "_notebook"):
        meant = algorithm + suffix
        for prefix in _SPELLINGS[algorithm]:
            base = f"{prefix}_{optimizer}{suffix}"
            for sep in ("_", "-", "") if not suffix else ("_", "-"):
                name = base.replace("_", sep)
                if name not in canonical:
                    out[name] = meant
    return out


def refuse_misspelled(name: str, meant: str, **_: Any) -> Any:
    """The registry entry of a near-miss name: an error naming the name the user meant."""
    raise ValueError(
        f"strategy={name!r} is not a strategy name; did you mean strategy={meant!r}? "
        "lightning_onebit registers 'onebit_adam', 'zero_one_adam' and 'onebit_lamb', each also "
        "with '_notebook' (fork-started ranks: notebooks, the Python shell) and "
        "'_find_unused_parameters_true'"
    )


def quiet_errors_on_this_rank(rank: int) -> None:
    """On ranks > 0 of a script-launched run (torchrun, Lightning's popen launcher, SLURM), print
    one line instead of a traceback for an uncaught error that every rank raises in the same
    step (a diverged run's :class:`~lightning_onebit.comm.NonFiniteError`): rank 0 prints the
    traceback, so the log holds one traceback instead of one per rank. The exit code stays 1.
    Fork- and spawn-started ranks hand their error to the parent process, which shows one."""
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


def name_unused_parameters(exception: BaseException, algorithm: str) -> None:
    """Replace DDP's "Expected to have finished reduction" message in ``exception`` by one that
    names our ``*_find_unused_parameters_true`` strategies (DDPStrategy's own names DDP's
    strategies, which would drop 1-bit training)."""
    pattern = ".*Expected to have finished reduction in the prior iteration.*"
    new_message = (
        "Some parameters of your LightningModule were not used in producing the loss "
        "returned by training_step. If this is intentional, enable the detection of "
        f"unused parameters: strategy='{algorithm}_find_unused_parameters_true' or "
        f"OneBitStrategy(algorithm='{algorithm}', find_unused_parameters=True) "
        "(DDPStrategy(find_unused_parameters=True) would train without 1-bit compression)"
    )
    exception.args = tuple(
        new_message if isinstance(a, str) and re.match(pattern, a, re.DOTALL) else a
        for a in exception.args
    )
