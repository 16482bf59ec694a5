"""The phases of the three algorithms, and the current phase of one optimizer."""

from enum import Enum

__all__ = ["Phase", "Phases"]


class Phase(str, Enum):
    """The phases of the three algorithms. A ``str``: ``opt.phase == "warmup"`` holds, and logs
    and checkpoints keep the plain string values."""

    WARMUP = "warmup"  # 1-bit Adam / LAMB: full-precision averaged gradients
    COMPRESSION = "compression"  # 1-bit Adam / LAMB: frozen variance, 1-bit momentum exchange
    VARIANCE = "variance"  # 0/1 Adam phase 1: variance updated on some steps, 1-bit gradients
    LOCAL = "local"  # 0/1 Adam phase 2: frozen variance, local steps, 1-bit synchronisations

    def __str__(self) -> str:
        return self.value


class Phases:
    """An algorithm's two phases and the current one: the first at construction, the second
    from the switch on (the switch happens once; a checkpoint may restore either).

    Interface: ``first``, ``second``, ``current``, ``switched``,
    ``switch``, ``restore``.
    """

    def __init__(self, phases: tuple[Phase, Phase]) -> None:
        self.first, self.second = phases
        self.current = self.first

    @property
    def switched(self) -> bool:
        """Whether the second phase is the current one."""
        return self.current == self.second

    def switch(self) -> None:
        """Make the second phase the current one."""
        self.current = self.second

    def restore(self, value: str) -> None:
        """Make the phase ``value`` (a checkpoint's) the current one; ``ValueError`` if it is
        not one of the two."""
        if value not in (self.first, self.second):
            raise ValueError(
                f"checkpoint phase {value!r} is not one of {[self.first.value, self.second.value]}"
            )
        self.current = Phase(value)
