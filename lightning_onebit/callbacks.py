"""``CompressionScheduler``: switches the 1-bit optimizer's phase and logs what it sends."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_onebit._integration.front_end import TRAINER
from lightning_onebit._integration.optimizer import OptimizerBuilder, onebit_optimizers
from lightning_onebit._integration.phase_switch import PhaseSwitch
from lightning_onebit.optim import OneBitOptimizer

__all__ = ["PROGRESS_BAR", "CompressionScheduler"]

#: The progress bar's fields: short names that do not wrap (the logger gets the long ones).
PROGRESS_BAR = {
    "onebit/phase": "1bit",
    "onebit/ratio_vs_ddp": "bytes_x",
    "onebit/step_speedup": "step_x",
}


class CompressionScheduler(PhaseSwitch, Callback):
    """Decides when compression starts, identically on every rank, and logs the byte counters.

    The switch happens after optimizer step ``freeze_step`` (the optimizer's built-in switch, so it
    is tied to the optimizer's own step counter and survives checkpoints), or earlier with
    ``adaptive=True`` once the second moment has stabilised: every ``window`` optimizer steps
    the relative change ``||v_t - v_{t-window}|| / ||v_t||`` (on a fixed strided sample of at most
    ``sample`` coordinates) is compared with ``threshold``; the decision is combined across ranks
    so that every rank switches on the same step (the logic is
    ``PhaseSwitch``, shared with the Fabric strategy).

    Logged every optimizer step (``self.log``, rank 0's values; they are equal on every rank):
    ``onebit/phase`` (0 = warmup / variance phase, 1 = compression), ``onebit/bytes_step`` and
    ``onebit/bytes_total`` (bytes this rank sent), ``onebit/ratio_vs_ddp`` (bytes an fp32 DDP
    allreduce would have sent so far, divided by ``bytes_total``), ``onebit/skipped_steps`` (steps
    the optimizer dropped because a NaN/Inf reached what it communicates), and what the run gets
    from it: ``onebit/step_ms_warmup`` and ``onebit/step_ms_compression`` (median wall-clock
    time per optimizer step of each phase; the warmup averages in full precision, as DDP does),
    ``onebit/after_bwd_ms`` (median time from the end of backward to the end of the step: the
    wait for the communication still in flight, then the update) and ``onebit/step_speedup``
    (warmup step / compression step). The progress bar shows ``1bit`` (the phase), ``bytes_x``
    (``ratio_vs_ddp``) and ``step_x`` (``step_speedup``). At the end of ``fit`` one line says
    the bytes saved, the step time per phase and the time saved vs DDP.

    [`OneBitStrategy`][lightning_onebit.strategy.OneBitStrategy] adds one automatically when the
    Trainer has none.

    Args:
        freeze_step: an int (optimizer steps of warmup), a float in (0, 1) (fraction of the run's
            optimizer steps), or ``None``: keep the optimizer's own ``freeze_step`` if
            ``configure_optimizers`` built a 1-bit optimizer, else 0.2 of the run.
        adaptive: also switch as soon as the variance is stable (see above).
        threshold: relative variance change below which it counts as stable.
        window: optimizer steps between variance snapshots.
        log_stats: log the ``onebit/*`` metrics and print the summary at the end of ``fit``.
        sample: the most variance coordinates kept per snapshot (memory bound for large models).
        progress_bar: show the phase, the bytes ratio and the step speedup on the progress bar
            (with ``log_stats``, where the Trainer has a progress bar).
    """

    def __init__(
        self,
        freeze_step: int | float | None = None,
        adaptive: bool = False,
        threshold: float = 0.05,
        window: int = 50,
        log_stats: bool = True,
        sample: int = 1_000_000,
        progress_bar: bool = True,
    ) -> None:
        super().__init__(freeze_step, adaptive, threshold, window, sample)
        self.log_stats = log_stats
        self.progress_bar = progress_bar

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _optimizer(trainer: pl.Trainer) -> OneBitOptimizer:
        for opt in onebit_optimizers(trainer.strategy.optimizers):
            return opt
        raise RuntimeError(
            "CompressionScheduler needs a lightning_onebit optimizer: use OneBitStrategy "
            "(strategy='onebit_adam' etc.) or return OneBitAdam/ZeroOneAdam/OneBitLamb from configure_optimizers"
        )

    @staticmethod
    def _total_steps(trainer: pl.Trainer) -> float:
        if trainer.max_steps is not None and trainer.max_steps > 0:
            return float(trainer.max_steps)
        return float(trainer.estimated_stepping_batches)

    # ------------------------------------------------------------------ hooks

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        builder = getattr(trainer.strategy, "builder", None)  # the 1-bit strategies'
        ours = isinstance(builder, OptimizerBuilder)
        converted = ours and builder.converted
        local_steps = ours and builder.derives_local_step_scaler
        opt, total = self._optimizer(trainer), self._total_steps(trainer)
        self.start(opt, total, converted, TRAINER, local_steps)
        if ours:
            builder.settle_average(opt, self.adaptive)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the optimizer's state was restored after on_fit_start, before this
        opt = self._optimizer(trainer)
        self.catch_up(opt)
        self.announce(opt)
        self._check_backbone_finetuning(trainer)

    def _check_backbone_finetuning(self, trainer: pl.Trainer) -> None:
        """Lightning's ``BackboneFinetuning`` adds the backbone to the optimizer at the start of
        epoch ``unfreeze_backbone_at_epoch``. A parameter that becomes trainable after the
        switch has no variance to be preconditioned by, and the optimizer refuses it then: say
        so before training, with the step to switch after instead."""
        from lightning.pytorch.callbacks import BackboneFinetuning

        opt = self._optimizer(trainer)
        batches = trainer.num_training_batches
        if self.adaptive or opt.phase != opt.PHASES[0] or not math.isfinite(batches):
            return
        per_epoch = math.ceil(batches / trainer.accumulate_grad_batches)
        for cb in trainer.callbacks:
            epoch = getattr(cb, "unfreeze_backbone_at_epoch", None)
            if not isinstance(cb, BackboneFinetuning) or epoch <= trainer.current_epoch:
                continue
            joins = epoch * per_epoch  # optimizer steps before the backbone joins
            if joins >= opt.switch_step:
                raise MisconfigurationException(
                    f"BackboneFinetuning(unfreeze_backbone_at_epoch={epoch}) adds the backbone to "
                    f"the optimizer after optimizer step {joins}, but {type(opt).__name__} "
                    f"switches to 1-bit compression after step {opt.switch_step}, and a "
                    "parameter that joins then has no variance to be preconditioned by. Switch "
                    f"after the backbone has joined and warmed up: OneBitStrategy(freeze_step=N) "
                    f"with N well above {joins} (e.g. {joins + opt.switch_step}), or unfreeze "
                    "earlier"
                )

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        opt = self._optimizer(trainer)
        if not self.after_step(opt):
            return  # no optimizer step on this batch (gradient accumulation, scaler skip)
        if self.log_stats:
            stats = self.stats(opt)
            kw: dict[str, Any] = {"on_step": True, "on_epoch": False, "rank_zero_only": True}
            pl_module.log_dict(stats, **kw)
            # short names: the rich bar wraps long ones over lines; nothing where no bar shows
            # them (each logged value costs the step ~0.25 ms of Python)
            if self.progress_bar and trainer.progress_bar_callback is not None:
                shown = {short: stats[k] for k, short in PROGRESS_BAR.items() if k in stats}
                pl_module.log_dict(shown, prog_bar=True, logger=False, **kw)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        self.times.backward_done()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # 0/1 Adam may end between two synchronisations, each rank with its own parameters:
        # the model a user saves, tests or exports must be the same on every rank
        opt = self._optimizer(trainer)
        opt.synchronize()  # a no-op for the others
        if self.log_stats and opt.step_count:
            rank_zero_info(self.summary(opt))

    # ------------------------------------------------------------------ checkpoint

    @override
    def state_dict(self) -> dict[str, Any]:
        return PhaseSwitch.state_dict(self)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        PhaseSwitch.load_state_dict(self, state_dict)
