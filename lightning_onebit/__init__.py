"""lightning-onebit: error-compensated 1-bit compressed data parallelism for PyTorch Lightning.

Importing the package registers the Trainer strategy names ``onebit_adam``, ``zero_one_adam``,
``onebit_lamb``, their fork-started notebook variants (``onebit_adam_notebook``, ...) and
``*_find_unused_parameters_true`` variants in ``lightning.pytorch``'s registry (the Trainer's
[`OneBitStrategy`][lightning_onebit.strategy.OneBitStrategy]) and in ``lightning.fabric``'s
(Fabric's [`OneBitFabricStrategy`][lightning_onebit.fabric.OneBitFabricStrategy]). The separate
``pytorch_lightning`` package (if already imported) gets the same names, each raising an error
that says to use ``lightning``.

The optimizers (``lightning_onebit.optim``) and the compressed allreduce
([`lightning_onebit.comm`][lightning_onebit.comm]) need only torch: without Lightning installed the
package imports them and leaves the strategy and the callback out.
"""

import sys
from functools import partial
from typing import Any

from lightning_onebit.comm import CompressedAllreduce
from lightning_onebit.optim import OneBitAdam, OneBitLamb, ZeroOneAdam

__version__ = "0.1.0"


def _register_in_pytorch_lightning() -> None:
    """The separate ``pytorch_lightning`` package's Trainer cannot run our ``lightning.pytorch``
    strategy: give it our names, each raising an error that says what to import instead."""
    registry = sys.modules["pytorch_lightning"].strategies.StrategyRegistry
    for name in StrategyRegistry.available_strategies():
        if name.startswith(tuple(ALGORITHMS)) and name not in registry:
            registry.register(
                name, partial(_refuse_pytorch_lightning, name), description="lightning"
            )


def _refuse_pytorch_lightning(name: str, **_: Any) -> Any:
    raise ValueError(
        f"strategy={name!r} is a lightning_onebit strategy for the `lightning` package "
        "(`import lightning as L; L.Trainer(...)`), and this Trainer is from the separate "
        "`pytorch_lightning` package: import the Trainer (and LightningModule) from "
        "`lightning.pytorch` instead"
    )


try:
    from lightning.pytorch.strategies import StrategyRegistry
except ModuleNotFoundError as err:  # the optimizers alone
    if not (err.name or "").startswith("lightning"):
        raise
    __all__ = ["CompressedAllreduce", "OneBitAdam", "OneBitLamb", "ZeroOneAdam", "__version__"]
else:
    from lightning_onebit._integration.rank_files import RankFileError

    RankFileError.__module__ = __name__  # tracebacks name the public path
    from lightning_onebit.callbacks import CompressionScheduler
    from lightning_onebit.strategy import ALGORITHMS, OneBitStrategy

    OneBitStrategy.register_strategies(StrategyRegistry)
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    from lightning_onebit.fabric import OneBitFabricStrategy

    OneBitFabricStrategy.register_strategies(STRATEGY_REGISTRY)
    __all__ = [
        "CompressedAllreduce",
        "CompressionScheduler",
        "OneBitAdam",
        "OneBitFabricStrategy",
        "OneBitLamb",
        "OneBitStrategy",
        "RankFileError",
        "ZeroOneAdam",
        "__version__",
    ]
    if "pytorch_lightning" in sys.modules:
        _register_in_pytorch_lightning()
