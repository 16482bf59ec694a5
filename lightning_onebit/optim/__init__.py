"""The 1-bit optimizers: plain ``torch.optim.Optimizer`` subclasses, usable without Lightning.

* [`OneBitAdam`][lightning_onebit.optim.OneBitAdam] — 1-bit Adam: Adam warmup, then frozen variance
and 1-bit momentum.
* [`ZeroOneAdam`][lightning_onebit.optim.ZeroOneAdam] — 0/1 Adam: adaptive variance freezing, 1-bit
gradients, local steps.
* [`OneBitLamb`][lightning_onebit.optim.OneBitLamb] — 1-bit LAMB: frozen trust ratios corrected by a
fresh-variance factor.

All three share [`OneBitOptimizer`][lightning_onebit.optim.OneBitOptimizer] (flat state buffers,
one compressed exchange per step, phases, checkpoints); its docstring states the gradient
averaging contract.
"""

from lightning_onebit.optim._base import OneBitOptimizer
from lightning_onebit.optim._divergence import DIVERGENCE_ACTIONS, DivergenceError, DivergenceWatch
from lightning_onebit.optim._phase import Phase
from lightning_onebit.optim.onebit_adam import OneBitAdam
from lightning_onebit.optim.onebit_lamb import OneBitLamb
from lightning_onebit.optim.zero_one_adam import ZeroOneAdam

# tracebacks and reprs name the public path: ``lightning_onebit.optim.DivergenceError``
DivergenceError.__module__ = __name__

__all__ = [
    "DIVERGENCE_ACTIONS",
    "DivergenceError",
    "DivergenceWatch",
    "OneBitAdam",
    "OneBitLamb",
    "OneBitOptimizer",
    "Phase",
    "ZeroOneAdam",
]
