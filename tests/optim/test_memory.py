"""What the optimizers hold between steps: each phase only the buffers it uses (the warmup
no flat copy of the gradients or the parameters).

Counted as ``benchmarks/memory.py`` counts (every storage the optimizer object reaches, the
parameters and their gradients left out), in fp32 values per parameter value, on one CPU rank
with the compiled kernels (the exchange's result read where it lies).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_onebit.kernels import native
from lightning_onebit.optim import OneBitAdam, OneBitLamb, ZeroOneAdam
from tests.helpers import memory

pytestmark = pytest.mark.skipif(not native.HAS_CPP, reason="needs the compiled kernels")

#: the 1-bit records at W = 1: the bits and scale sent and the server's, one set each: n/4 bytes
RECORDS = 0.0625

#: per optimizer: (its factory, the values held in the warmup, in the compression phase)
CASES = {
    # warmup: exp_avg, exp_avg_sq, as torch's Adam (the gradients read where they lie: no flat
    # copy; the exchange's buffers are made at its first call); compression: the gradients read
    # where they lie, and the exchange's worker and server error buffers, one each (the source
    # computed as the compression reads it, and again for the error update: no buffer for it;
    # sqrt(v) + eps computed by the kernels as they read v: no buffer either)
    "onebit_adam": (
        lambda p: OneBitAdam(p, lr=1e-3, freeze_step=2),
        2,
        2 + 2 + RECORDS,
    ),
    # and in the local phase (made at the switch) the momentum accumulator, the synced
    # parameters, the variance floor's mask (bool)
    "zero_one_adam": (
        lambda p: ZeroOneAdam(p, lr=1e-3, var_freeze_step=2, local_step_scaler=1_000_000),
        2,
        4 + 2 + RECORDS + 0.25,
    ),
    # and the fresh variance (made at the switch); its warmup reads the parameters where they
    # lie (trust ratios, decay) and computes the update layer by layer (no flat copy of either),
    # the compression phase never decodes the exchange's result into a buffer
    "onebit_lamb": (
        lambda p: OneBitLamb(p, lr=1e-3, freeze_step=2),
        2,
        3 + 1 + 2 + RECORDS,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_phase_holds_only_the_buffers_it_uses(name: str) -> None:
    make, warmup, compression = CASES[name]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 96), torch.nn.Tanh(), torch.nn.Linear(96, 96))
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    opt = make(params)
    held = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in range(1, 5):
            opt.zero_grad()
            model(torch.randn(8, 96)).square().mean().backward()
            opt.step()
            skip = {p.untyped_storage().data_ptr() for p in params}
            skip |= {p.grad.untyped_storage().data_ptr() for p in params}
            held[t] = sum(memory.held(opt, skip).values()) / (4 * n)
    assert opt.phase != "warmup"
    # (the scalars per parameter and the verdict's flags: a few bytes)
    assert held[1] == pytest.approx(warmup, abs=0.01), held
    assert held[4] == pytest.approx(compression, abs=0.01), held
    assert held[3] == held[4]  # (nothing made again at every step)
