"""The steps that use averaged gradients (the warmup, 0/1 Adam's variance steps) read each
gradient where autograd left it wherever this optimizer does not average them itself: at
``W = 1``, and with ``average_warmup_grads=False`` (the strategies: DDP averaged them before the
step). There they make no flat copy of the gradients (nor 1-bit LAMB one of the parameters or of
its update), and the numbers are those of the optimizer's own average, bit for bit (at ``W = 2``
an average sums two values, in either order the same float, so averaging each ``.grad`` on its
own as DDP does gives the flat buffer's floats).
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_onebit.optim import OneBitAdam, OneBitLamb, ZeroOneAdam
from tests.helpers.dist import run_distributed

STEPS = 8
MAKERS: dict[str, Any] = {
    "onebit_adam": lambda groups, **kw: OneBitAdam(groups, lr=1e-2, freeze_step=4, **kw),
    "zero_one_adam": lambda groups, **kw: ZeroOneAdam(
        groups, lr=1e-2, var_freeze_step=4, local_step_scaler=2, local_step_clipper=2, **kw
    ),
    "onebit_lamb": lambda groups, **kw: OneBitLamb(
        groups, lr=1e-2, freeze_step=4, weight_decay=0.01, **kw
    ),
}
#: the warmup's scratch buffers none of these steps may make
FLAT_COPIES = ("grad", "param", "update")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 40), torch.nn.Linear(40, 6)
    )


def _groups(model: torch.nn.Module, options: str) -> list[dict[str, Any]]:
    if options == "default":
        return [{"params": list(model.parameters())}]
    return [  # bias correction, two groups: weights with decay, biases at another lr
        {"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.05},
        {"params": [p for p in model.parameters() if p.dim() == 1], "lr": 5e-3},
    ]


def _digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    tensors = list(model.parameters())
    for p in model.parameters():
        tensors += [t for _, t in sorted(opt.state[p].items()) if isinstance(t, torch.Tensor)]
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _train(
    rank: int, world: int, algo: str, options: str, caller: str, last_unused: bool = False
) -> dict[str, Any]:
    """Train ``STEPS`` steps; ``caller``: ``"optimizer"`` (it averages the warmup's gradients),
    ``"all"`` (the loop averages every ``.grad`` before the step, as DDP, and passes
    ``average_warmup_grads=False``) or ``"some"`` (the loop averages all but the last
    parameter's, named in ``caller_averaged``, and the optimizer the rest). ``last_unused``:
    the last parameter gets no gradient on any rank."""
    model = _model()
    kw = {"bias_correction": True} if options == "groups" else {}
    opt = MAKERS[algo](_groups(model, options), average_warmup_grads=caller == "optimizer", **kw)
    params = list(model.parameters())
    averaged = params if caller == "all" else params[:-1]
    if caller == "some":
        opt.caller_averaged = frozenset(id(p) for p in averaged)
    made = set()
    gen = torch.Generator().manual_seed(rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(STEPS):
            x, y = torch.randn(16, 12, generator=gen), torch.randint(0, 6, (16,), generator=gen)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if last_unused:
                params[-1].grad = None
            warmup = opt.expects_averaged_grads
            if warmup and caller != "optimizer" and world > 1:
                for p in averaged:  # one .grad at a time, as DDP's buckets (fp32: sum, divide)
                    if p.grad is None:
                        continue
                    dist.all_reduce(p.grad)
                    p.grad.div_(world)
            opt.step()
            if warmup:
                made |= {name for name in FLAT_COPIES if name in opt.flat.views}
    return {"digest": _digest(model, opt), "made": sorted(made)}


@pytest.mark.parametrize("options", ["default", "groups"])
@pytest.mark.parametrize("algo", list(MAKERS))
def test_caller_averaged_gradients_are_read_in_place_with_the_same_numbers(
    algo: str, options: str
) -> None:
    own = run_distributed(_train, 2, algo, options, "optimizer")
    ddp = run_distributed(_train, 2, algo, options, "all")
    some = run_distributed(_train, 2, algo, options, "some")
    assert ddp[0]["digest"] == own[0]["digest"] == some[0]["digest"]
    assert ddp[0]["digest"] == ddp[1]["digest"]
    assert own[0]["made"] == ["grad"]  # averaged here: the collective's flat buffer
    assert ddp[0]["made"] == some[0]["made"] == []


@pytest.mark.parametrize("algo", list(MAKERS))
def test_one_rank_warmup_makes_no_flat_copy(algo: str) -> None:
    out = _train(0, 1, algo, "groups", "optimizer")
    assert out["made"] == []


@pytest.mark.parametrize("algo", list(MAKERS))
def test_a_parameter_the_caller_left_without_a_gradient_is_kept_out(algo: str) -> None:
    """The one parameter the caller does not average has no gradient on any rank: kept out of
    the step as when the optimizer averages everything."""
    own = run_distributed(_train, 2, algo, "default", "optimizer", True)
    some = run_distributed(_train, 2, algo, "default", "some", True)
    assert own[0]["digest"] == some[0]["digest"] == some[1]["digest"]
