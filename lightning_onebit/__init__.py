"""lightning-onebit: error-compensated 1-bit compressed data parallelism for PyTorch Lightning."""

from lightning_onebit.comm import CompressedAllreduce

__version__ = "0.1.0"
__all__ = ["CompressedAllreduce", "__version__"]
