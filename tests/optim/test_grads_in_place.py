"""The compression steps of 1-bit Adam and 1-bit LAMB, and the warmup steps that need no
average by the optimizer (here ``W = 1``), read each gradient where autograd left it
(``FlatState.grads``) instead of copying every one into the flat gradient buffer first: the
same parameters and states, bit for bit, as with every gradient gathered, with and without the
overlap with backward, for parameters whose gradients must still be gathered (``maximize``,
torch Adam's L2 term, a non-contiguous or bf16 gradient), missing gradients, and
``rescale_variance`` (its norms read the same gradients).

Likewise, the decay terms of 1-bit LAMB's compression steps and of 0/1 Adam's sync steps read
each parameter where it lies (``FlatState.params``): bit for bit the steps with every parameter
copied into the flat parameter buffer, which only the non-contiguous and bf16 ones still are."""

from __future__ import annotations

import pytest
import torch

from lightning_onebit.optim import OneBitAdam, OneBitLamb, ZeroOneAdam
from lightning_onebit.optim._flat import FlatState

STEPS = 24  # 2 warmup steps, then compression (rescale_variance reduces every 10)
FACTORIES = {
    "onebit_adam": lambda groups: OneBitAdam(
        groups,
        lr=1e-2,
        freeze_step=2,
        rescale_variance=True,
        weight_decay=0.01,
        bias_correction=True,
    ),
    "onebit_lamb": lambda groups: OneBitLamb(
        groups, lr=1e-2, freeze_step=2, weight_decay=0.01, bias_correction=True
    ),
}


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(12, 24)
        self.b = torch.nn.Linear(24, 24)
        self.c = torch.nn.Linear(24, 5)
        # a non-contiguous parameter (its gradient too), a bf16 one, one used every other step
        self.t = torch.nn.Parameter(torch.randn(5, 24).t())
        self.h = torch.nn.Parameter(torch.randn(24, dtype=torch.bfloat16))
        self.sometimes = torch.nn.Parameter(torch.randn(24) * 0.1)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        y = torch.tanh(self.a(x)) + self.h.float()
        if step % 2:
            y = y + self.sometimes
        y = torch.tanh(self.b(y))
        return self.c(y) + y @ self.t


def _groups(model: _Model) -> list[dict]:
    return [
        {"params": [model.a.weight, model.a.bias, model.t, model.h, model.sometimes]},
        {"params": [model.b.weight, model.b.bias], "maximize": True},
        {
            "params": [model.c.weight, model.c.bias],
            "decoupled_weight_decay": False,
            "weight_decay": 0.1,
        },
    ]


def _fit(factory, overlap: bool, buffer: str) -> dict:
    """Train ``STEPS`` steps with ``factory``'s optimizer, the flat buffer ``buffer`` ("grad"
    or "param") NaN-filled after step 2 (the last that gathers everything). Returns the
    parameters and states, and which parameters' views of that buffer later steps wrote."""
    model = _Model()
    opt = factory(_groups(model))
    if overlap:
        opt.overlap_with_backward(0.001)  # several buckets
    gen = torch.Generator().manual_seed(1)
    for t in range(1, STEPS + 1):
        x, y = torch.randn(8, 12, generator=gen), torch.randint(0, 5, (8,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x, t), y).backward()
        opt.step()
        if t == 2:
            getattr(opt.flat, buffer).fill_(float("nan"))
    written = [not torch.isnan(v).all().item() for v in opt.flat.views[buffer]]
    params = [p.detach().clone() for p in model.parameters()]
    states = {k: v.clone() for k, v in {**opt.flat.states, **opt.flat.scalars}.items()}
    errors = opt.flat.exchange.state_dict()
    opt.close()
    return {"params": params, "states": states, "errors": errors, "written": written}


def _train(algo: str, overlap: bool, in_place: bool, monkeypatch: pytest.MonkeyPatch) -> dict:
    """:func:`_fit`; with ``in_place=False`` every gradient is gathered, as before the kernels
    read them in place."""
    with monkeypatch.context() as patch:
        if not in_place:
            patch.setattr(FlatState, "_read_in_place", lambda self, group, g, on_gpu: False)
        return _fit(FACTORIES[algo], overlap, "grad")


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        bits = (a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*bits)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("algo", list(FACTORIES))
def test_gradients_read_in_place_give_the_gathered_steps_bitwise(
    algo: str, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    got = _train(algo, overlap, True, monkeypatch)
    want = _train(algo, overlap, False, monkeypatch)
    assert _same(got["params"], want["params"])
    assert _same(got["states"], want["states"])
    assert _same(got["errors"], want["errors"])
    assert all(want["written"])  # (the gather path wrote every view)
    # read in place: the fp32 contiguous gradients of plain groups (a.weight, a.bias,
    # sometimes); gathered: the non-contiguous and bf16 ones and the adjusting groups'
    assert got["written"] == [False, False, True, True, False, True, True, True, True]


#: the optimizers whose compression steps read the parameters for their decay terms: 1-bit
#: LAMB's, and 0/1 Adam's sync steps (its local phase from step 3: syncs every step, then every
#: 2nd, then every 4th, so that local steps come between them)
DECAYING = {
    "onebit_lamb": FACTORIES["onebit_lamb"],
    "zero_one_adam": lambda groups: ZeroOneAdam(
        groups,
        lr=1e-2,
        var_freeze_step=2,
        var_update_scaler=1,
        local_step_scaler=4,
        local_step_clipper=4,
        weight_decay=0.01,
        bias_correction=True,
    ),
}


def _train_decaying(
    algo: str, overlap: bool, in_place: bool, monkeypatch: pytest.MonkeyPatch
) -> dict:
    """:func:`_fit`; with ``in_place=False`` every parameter is copied into the flat parameter
    buffer for the decay terms, as before the kernels read them where they lie."""
    with monkeypatch.context() as patch:
        if not in_place:
            patch.setattr(
                FlatState,
                "params",
                lambda self, only: [
                    self.views["param"][j].copy_(self.layout.params[j]) for j in only
                ],
            )
        return _fit(DECAYING[algo], overlap, "param")


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("algo", list(DECAYING))
def test_parameters_read_where_they_lie_give_the_gathered_steps_bitwise(
    algo: str, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    got = _train_decaying(algo, overlap, True, monkeypatch)
    want = _train_decaying(algo, overlap, False, monkeypatch)
    assert _same(got["params"], want["params"])
    assert _same(got["states"], want["states"])
    assert _same(got["errors"], want["errors"])
    assert all(want["written"])  # (the copying path wrote every view)
    # read where they lie: the fp32 contiguous parameters; copied: the non-contiguous t and
    # the bf16 h (layout order: a.weight, a.bias, t, h, sometimes, b.*, c.*)
    assert got["written"] == [False, False, True, True, False, False, False, False, False]
