"""lightning-onebit: error-compensated 1-bit compressed data parallelism for PyTorch Lightning."""

from lightning_onebit.comm import CompressedAllreduce
from lightning_onebit.optim import OneBitAdam, OneBitLamb, ZeroOneAdam

__version__ = "0.1.0"
__all__ = ["CompressedAllreduce", "OneBitAdam", "OneBitLamb", "ZeroOneAdam", "__version__"]
