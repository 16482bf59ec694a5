"""What users' training code expects from the strategy: LR schedulers, checkpoint options, resume.

Each case runs the same LightningModule under ``strategy="ddp"`` and under a 1-bit strategy and
compares what the user observes (the learning rate and betas of every step, parameters after a
resume, files on disk).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.optim import lr_scheduler as sched
from torch.utils.data import DataLoader, TensorDataset

from lightning_onebit import OneBitStrategy

STEPS = 12


class Regression(L.LightningModule):
    """A linear regression whose ``configure_optimizers`` builds Adam and ``make_scheduler``'s."""

    def __init__(self, make_scheduler: Callable[[torch.optim.Optimizer], dict], lr: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
        self.make_scheduler = make_scheduler
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        # a monitored value that does not depend on the numerics (ReduceLROnPlateau's decisions
        # must not differ because 1-bit steps change the loss)
        self.log("plateau", float([3, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0][batch_idx % 12]))
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.lr, betas=(0.9, 0.99))
        return {"optimizer": opt, "lr_scheduler": self.make_scheduler(opt)}


class TraceHyperparameters(Callback):
    """The lr and beta1 of every group that each optimizer step used."""

    def __init__(self) -> None:
        self.trace: list[list[tuple[float, float]]] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.trace.append([(g["lr"], g["betas"][0]) for g in optimizer.param_groups])


class WarmupToTarget(sched.LRScheduler):
    """A user's scheduler that keeps its own key in the param groups (like OneCycleLR does)."""

    def __init__(self, optimizer: torch.optim.Optimizer, steps: int) -> None:
        for g in optimizer.param_groups:
            g["warmup_target"] = g["lr"]
        self.steps = steps
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        f = min(1.0, (self.last_epoch + 1) / self.steps)
        return [g["warmup_target"] * f for g in self.optimizer.param_groups]


def _step(s: Any) -> dict:
    return {"scheduler": s, "interval": "step"}


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], dict]] = {
    "OneCycleLR": lambda o: _step(
        sched.OneCycleLR(o, max_lr=1e-2, total_steps=STEPS, cycle_momentum=True)
    ),
    "SequentialLR": lambda o: _step(
        sched.SequentialLR(
            o,
            [
                sched.LinearLR(o, start_factor=0.01, total_iters=4),
                sched.CosineAnnealingLR(o, T_max=8, eta_min=1e-4),
            ],
            milestones=[4],
        )
    ),
    "ChainedScheduler": lambda o: _step(
        sched.ChainedScheduler(
            [sched.ConstantLR(o, factor=0.5, total_iters=3), sched.ExponentialLR(o, gamma=0.8)]
        )
    ),
    "LambdaLR": lambda o: _step(sched.LambdaLR(o, lambda s: 1.0 / (1 + s))),
    "CyclicLR": lambda o: _step(
        sched.CyclicLR(o, base_lr=1e-4, max_lr=1e-2, step_size_up=3, cycle_momentum=True)
    ),
    "ReduceLROnPlateau": lambda o: {
        **_step(sched.ReduceLROnPlateau(o, factor=0.5, patience=1, min_lr=2e-4)),
        "monitor": "plateau",
    },
    "custom": lambda o: _step(WarmupToTarget(o, steps=5)),
}


def _trace(strategy: Any, name: str, lr: float = 3e-3) -> list[list[tuple[float, float]]]:
    x = torch.randn(STEPS * 16, 8, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=16)
    tracer = TraceHyperparameters()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,  # the schedule does not depend on the ranks; one in-process rank is enough
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[tracer],
    )
    trainer.fit(Regression(SCHEDULERS[name], lr), loader)
    return tracer.trace


@pytest.mark.filterwarnings("ignore:.*(lr_scheduler|decoupled|devices=1).*")
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_every_lr_scheduler_drives_the_converted_optimizer_as_under_ddp(name: str) -> None:
    ddp = _trace("ddp", name)
    assert len(ddp) == STEPS and len({tuple(t) for t in ddp}) > 1  # the schedule moves
    assert _trace(OneBitStrategy(freeze_step=4), name) == ddp
    # 1-bit LAMB with its own lr: the whole schedule scaled (absolute lrs such as OneCycleLR's
    # max_lr, CyclicLR's bounds, eta_min, min_lr included)
    lamb = OneBitStrategy(algorithm="onebit_lamb", lamb_lr=3e-2, freeze_step=4)
    if name == "custom":  # only torch's schedulers are known to hold nothing else
        with pytest.warns(UserWarning, match=r"WarmupToTarget .*\['warmup_target'\]"):
            _trace(lamb, name)
        return
    assert _trace(lamb, name) == [
        [(pytest.approx(lr * 10, rel=1e-9), b1) for lr, b1 in step] for step in ddp
    ]
