"""The names the 1-bit strategies are registered under, in the Trainer's and in Fabric's registry,
and the near-miss names that raise an error naming the right one."""

from __future__ import annotations

from functools import partial
from typing import Any

from lightning_onebit._integration.options import ALGORITHMS

__all__ = ["misspellings", "refuse_misspelled", "register_names"]

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


def register_names(cls: type, strategy_registry: Any) -> None:
    """Register ``cls`` under every algorithm's names (the same in the Trainer's and in Fabric's
    registry): ``<algorithm>``, the fork-started ``<algorithm>_notebook`` and their
    ``_find_unused_parameters_true`` variants; near-miss names raise an error naming the right one."""
    for algorithm in ALGORITHMS:
        for name, start_method in ((algorithm, "popen"), (f"{algorithm}_notebook", "fork")):
            for suffix, unused in (("", False), ("_find_unused_parameters_true", True)):
                if name + suffix in strategy_registry:
                    continue  # a second import (or registration) must not fail
                strategy_registry.register(
                    name + suffix,
                    cls,
                    description=f"1-bit compressed DDP ({algorithm}), "
                    f"start_method={start_method!r}, find_unused_parameters={unused}",
                    algorithm=algorithm,
                    start_method=start_method,
                    find_unused_parameters=unused,
                )
    # near-miss names ("onebit-adam", "1bit_adam", "OneBitAdam"): an error naming the right one
    canonical = set(strategy_registry)
    for algorithm in ALGORITHMS:
        for name, meant in misspellings(algorithm, canonical).items():
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    partial(refuse_misspelled, name, meant),
                    description=f"not a name: did you mean {meant!r}?",
                )
