"""The phases of the three algorithms."""

from enum import Enum

__all__ = ["Phase"]


class Phase(str, Enum):
    """The phases of the three algorithms. A ``str``: ``opt.phase == "warmup"`` holds, and logs
    and checkpoints keep the plain string values."""

    WARMUP = "warmup"  # 1-bit Adam / LAMB: full-precision averaged gradients
    COMPRESSION = "compression"  # 1-bit Adam / LAMB: frozen variance, 1-bit momentum exchange
    VARIANCE = "variance"  # 0/1 Adam phase 1: variance updated on some steps, 1-bit gradients
    LOCAL = "local"  # 0/1 Adam phase 2: frozen variance, local steps, 1-bit synchronisations

    def __str__(self) -> str:
        return self.value
