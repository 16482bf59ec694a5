"""lightning-onebit: error-compensated 1-bit compressed data parallelism for PyTorch Lightning.

Importing the package registers the Trainer strategy names ``onebit_adam``, ``zero_one_adam``,
``onebit_lamb`` and their fork-started notebook variants (``onebit_adam_notebook``, ...) in
``lightning.pytorch``'s registry (not in the separate ``pytorch_lightning`` package).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_onebit.callbacks import CompressionScheduler
from lightning_onebit.comm import CompressedAllreduce
from lightning_onebit.optim import OneBitAdam, OneBitLamb, ZeroOneAdam
from lightning_onebit.strategy import OneBitStrategy

OneBitStrategy.register_strategies(StrategyRegistry)

__version__ = "0.1.0"
__all__ = [
    "CompressedAllreduce",
    "CompressionScheduler",
    "OneBitAdam",
    "OneBitLamb",
    "OneBitStrategy",
    "ZeroOneAdam",
    "__version__",
]
