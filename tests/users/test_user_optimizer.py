"""The user's torch Adam/AdamW kept exactly under the 1-bit strategies: per-group flags
(``maximize``), parameters without gradients, ``lr = 0`` groups, torch Adam's L2 weight decay,
per-group hyperparameters. Each case is a 2-rank fit (fork-started) next to ``ddp_notebook``
on the same seed and data."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, TensorDataset

from lightning_onebit import OneBitAdam, OneBitStrategy
from lightning_onebit._integration.convert import convert_adam
from tests.helpers.fit import OneThread

STEPS = 12

#: how the Trainer strategy calls the conversion (the class named in messages, the error type)
_FROM_TRAINER = {"strategy": "OneBitStrategy", "error": MisconfigurationException}


class Heads(L.LightningModule):
    """A small regression with three extra heads: ``unused`` never takes part in the loss,
    ``alt`` does on odd steps, ``one_rank`` on rank 0 only (with ``heads=True``)."""

    def __init__(self, make_optimizer: Callable[[L.LightningModule], Any], heads: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 1)
        if heads:
            self.unused = torch.nn.Linear(16, 1)
            self.alt = torch.nn.Linear(16, 1)
            self.one_rank = torch.nn.Linear(16, 1)
        self.make_optimizer, self.heads = make_optimizer, heads

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = torch.tanh(self.body(x))
        pred = self.out(h)
        if self.heads:
            if self.global_step % 2:
                pred = pred + self.alt(h)
            if self.global_rank == 0:
                pred = pred + self.one_rank(h)
        return torch.nn.functional.mse_loss(pred, y)

    def configure_optimizers(self) -> Any:
        return self.make_optimizer(self)


class SaveParams(Callback):
    """Each rank's parameters after every step, saved at the end of the fit."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.trace = tmp, []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        self.trace.append({k: v.detach().clone() for k, v in pl_module.named_parameters()})

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        torch.save(self.trace, self.tmp / f"params{trainer.global_rank}.pt")


def _fit(
    tmp: Path, strategy: Any, make_optimizer: Callable, heads: bool = False
) -> list[list[dict[str, torch.Tensor]]]:
    tmp.mkdir(parents=True, exist_ok=True)
    x = torch.randn(STEPS * 16 * 2, 8, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=16)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SaveParams(tmp), OneThread()],
        default_root_dir=tmp,
    )
    trainer.fit(Heads(make_optimizer, heads), loader)
    return [torch.load(tmp / f"params{r}.pt") for r in range(2)]


def _onebit(algorithm: str = "onebit_adam", freeze_step: int = STEPS + 1, **kw: Any) -> Any:
    """The strategy with DDP's exact (fp32) warmup average: its warmup is torch's optimizer on
    DDP's gradients, step for step, which these tests compare with DDP."""
    kw.setdefault("average_dtype", "float32")
    return OneBitStrategy(algorithm=algorithm, freeze_step=freeze_step, start_method="fork", **kw)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names=None) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in names or a)


def _two_groups(first: dict[str, Any], cls: type = torch.optim.Adam, **kw: Any) -> Callable:
    """``cls`` over two groups: the body with ``first``'s overrides, the rest."""

    def make(m: L.LightningModule) -> torch.optim.Optimizer:
        rest = [p for n, p in m.named_parameters() if not n.startswith("body.")]
        return cls([{"params": m.body.parameters(), **first}, {"params": rest}], lr=1e-2, **kw)

    return make


def test_a_maximized_group_is_maximized_as_under_ddp(tmp_path: Path) -> None:
    make = _two_groups({"maximize": True})
    ddp = _fit(tmp_path / "ddp", "ddp_notebook", make)
    warm = _fit(tmp_path / "warm", _onebit(), make)
    diff = _max_diff(warm[0][-1], ddp[0][-1])
    assert diff < 1e-6, diff
    # compressed from step 5 on: the maximized group still climbs as DDP's does
    onebit = _fit(tmp_path / "onebit", _onebit(freeze_step=4), make)
    p0 = Heads(make, False).body.weight.detach()
    moved_ddp = ddp[0][-1]["body.weight"] - p0
    moved = onebit[0][-1]["body.weight"] - p0
    cos = float(torch.nn.functional.cosine_similarity(moved.flatten(), moved_ddp.flatten(), 0))
    assert cos > 0.9, cos
    assert torch.equal(onebit[0][-1]["body.weight"], onebit[1][-1]["body.weight"])


@pytest.mark.parametrize("algorithm", ["onebit_adam", "zero_one_adam"])
def test_parameters_without_gradients_stay_as_under_ddp(tmp_path: Path, algorithm: str) -> None:
    """An unused head never moves, in warmup and after the switch; a head used on alternate
    steps and one used by rank 0 only train as under DDP (warmup: to 1e-6, torch's per-parameter
    step counts in the bias correction included)."""
    make = lambda m: torch.optim.Adam(m.parameters(), lr=1e-2)  # noqa: E731
    unused = "ddp_notebook_find_unused_parameters_true"
    ddp = _fit(tmp_path / "ddp", unused, make, heads=True)
    kw: dict[str, Any] = {"find_unused_parameters": True}
    if algorithm == "zero_one_adam":  # (its robust default floors the variance in phase 1 too)
        kw["variance_floor"] = 0.0
    warm = _fit(tmp_path / "warm", _onebit(algorithm, **kw), make, heads=True)
    onebit = _fit(tmp_path / "onebit", _onebit(algorithm, freeze_step=4, **kw), make, heads=True)
    p0 = dict(Heads(make, True).named_parameters())
    for run in (ddp, warm, onebit):
        for rank in run:
            for step in rank:
                for k in ("unused.weight", "unused.bias"):
                    assert torch.equal(step[k], p0[k].detach()), k
    diff = _max_diff(warm[0][-1], ddp[0][-1])
    assert diff < 1e-6, diff
    # after the switch: the heads used on alternate steps / by one rank train as DDP's do
    for head in ("alt.weight", "one_rank.weight"):
        moved_ddp = (ddp[0][-1][head] - p0[head]).flatten()
        moved = (onebit[0][-1][head] - p0[head]).flatten()
        cos = float(torch.nn.functional.cosine_similarity(moved, moved_ddp, 0))
        assert cos > 0.8, (head, cos)
    if algorithm == "onebit_adam":  # (0/1 Adam's local steps differ between syncs)
        assert _max_diff(onebit[0][-1], onebit[1][-1]) == 0.0


def test_a_group_with_lr_zero_stays_fixed_as_under_ddp(tmp_path: Path) -> None:
    make = _two_groups({"lr": 0.0})
    ddp = _fit(tmp_path / "ddp", "ddp_notebook", make)
    onebit = _fit(tmp_path / "onebit", _onebit(freeze_step=4), make)
    p0 = dict(Heads(make, False).named_parameters())
    for run in (ddp, onebit):
        for k in ("body.weight", "body.bias"):
            assert torch.equal(run[0][-1][k], p0[k].detach())
    warm = _fit(tmp_path / "warm", _onebit(), make)
    diff = _max_diff(warm[0][-1], ddp[0][-1])
    assert diff < 1e-6, diff


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW], ids=lambda c: c.__name__)
def test_weight_decay_is_computed_as_the_torch_optimizer_does(tmp_path: Path, cls: type) -> None:
    """torch Adam's L2 term (added to the gradient) and AdamW's decoupled decay, each equal to
    DDP + the same optimizer over a warmup-only run (the converted one would be the other)."""
    make = lambda m: cls(m.parameters(), lr=1e-2, weight_decay=0.1)  # noqa: E731
    ddp = _fit(tmp_path / "ddp", "ddp_notebook", make)
    warm = _fit(tmp_path / "warm", _onebit(), make)
    diffs = [_max_diff(a, b) for a, b in zip(warm[0], ddp[0], strict=True)]
    assert max(diffs) < 1e-6, diffs
    other = torch.optim.AdamW if cls is torch.optim.Adam else torch.optim.Adam
    ref = _fit(
        tmp_path / "other",
        "ddp_notebook",
        lambda m: other(m.parameters(), lr=1e-2, weight_decay=0.1),
    )
    assert _max_diff(ref[0][-1], ddp[0][-1]) > 100 * max(max(diffs), 1e-7)


def test_per_group_betas_and_eps_are_kept_and_listed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make = _two_groups({"betas": (0.8, 0.99), "eps": 1e-6}, torch.optim.AdamW, weight_decay=0.01)
    ddp = _fit(tmp_path / "ddp", "ddp_notebook", make)
    warm = _fit(tmp_path / "warm", _onebit(), make)
    diff = _max_diff(warm[0][-1], ddp[0][-1])
    assert diff < 1e-6, diff
    original = make(Heads(make, False))
    with caplog.at_level(logging.INFO):
        convert_adam(original, OneBitAdam, "onebit_adam", lambda d: d, None, **_FROM_TRAINER)
    text = caplog.text
    assert "lr=0.01, betas=(0.8, 0.99), eps=1e-06, weight_decay=0.01" in text, text
    assert "group 1: betas=(0.9, 0.999), eps=1e-08" in text, text


def test_the_conversion_says_what_it_drops_and_refuses_per_group(
    caplog: pytest.LogCaptureFixture,
) -> None:
    make = _two_groups({}, foreach=True)
    with caplog.at_level(logging.INFO):
        new, _ = convert_adam(
            make(Heads(make, False)), OneBitAdam, "onebit_adam", lambda d: d, None, **_FROM_TRAINER
        )
    assert "dropped foreach=True" in caplog.text
    assert all(new.param_groups[i]["decoupled_weight_decay"] is False for i in range(2))
    make = _two_groups({"amsgrad": True})
    with pytest.raises(MisconfigurationException, match="Adam's param group 0 has amsgrad=True"):
        convert_adam(
            make(Heads(make, False)), OneBitAdam, "onebit_adam", lambda d: d, None, **_FROM_TRAINER
        )
