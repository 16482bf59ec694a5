"""``OneBitStrategy``: Lightning's ``DDPStrategy`` with the 1-bit exchange of 1-bit Adam, 0/1 Adam
or 1-bit LAMB instead of its gradient allreduce (see the class): the pieces it shares with the
Fabric strategy (``lightning_onebit._integration``) wired into the Trainer's hooks."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Generator, Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import DoublePrecision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_onebit._compat import MockOptimizer, TrainerDDPHooks
from lightning_onebit._integration import lifecycle
from lightning_onebit._integration.checks import check_dense_gradients
from lightning_onebit._integration.errors import name_unused_parameters
from lightning_onebit._integration.front_end import TRAINER
from lightning_onebit._integration.optimizer import onebit_optimizers, overlap_paused
from lightning_onebit._integration.options import ALGORITHMS
from lightning_onebit._integration.rank_files import PATH
from lightning_onebit._integration.scaler import sync_scaler_of
from lightning_onebit._integration.strategy_base import OneBitStrategyBase, takes_options
from lightning_onebit.callbacks import CompressionScheduler
from lightning_onebit.optim import OneBitOptimizer

__all__ = ["ALGORITHMS", "OneBitStrategy"]


def _one_optimizer_message(strategy: str, found: str) -> str:
    """Why ``strategy`` refuses what ``found`` describes (several optimizers, manual
    optimization), and what to do instead: the message Lightning's own checks (which advise
    manual optimization) must not come before."""
    return (
        f"{strategy} trains with one optimizer, with automatic optimization (the strategy "
        "decides which gradients each step uses, and its 1-bit exchange compresses that "
        f"optimizer's momentum), but {found}. Return one torch.optim.Adam/AdamW (or "
        "lightning_onebit OneBitAdam / ZeroOneAdam / OneBitLamb) from configure_optimizers, "
        "with one param group per former optimizer, each with its own lr, betas and "
        "weight_decay, and let training_step return the loss (no "
        "`self.automatic_optimization = False`)"
    )


def _check_automatic_optimization(module: pl.LightningModule, strategy: str) -> None:
    """Refuse manual optimization and Lightning 1.x's ``training_step(..., optimizer_idx)``
    with our message (Lightning's own, for either, advises manual optimization)."""
    if not module.automatic_optimization:
        found = "this LightningModule sets `self.automatic_optimization = False`"
    elif "optimizer_idx" in inspect.signature(module.training_step).parameters:
        found = "training_step takes `optimizer_idx` (several optimizers)"
    else:
        return
    raise MisconfigurationException(_one_optimizer_message(strategy, found))


@takes_options
class OneBitStrategy(OneBitStrategyBase, TrainerDDPHooks, DDPStrategy):
    """Data-parallel training with 1-bit Adam, 0/1 Adam or 1-bit LAMB.

    Use a registered name — ``Trainer(strategy="onebit_adam")``, ``"zero_one_adam"``,
    ``"onebit_lamb"``, or the fork-started ``"onebit_adam_notebook"`` etc. for notebooks (after
    ``import lightning_onebit``) — or an instance for full control. The LightningModule stays
    unmodified: ``configure_optimizers`` may keep returning ``torch.optim.Adam``/``AdamW`` (with
    LR schedulers, any param groups), which the strategy replaces by the 1-bit optimizer; one of
    ours (`lightning_onebit.optim`) is used as built. DDP's gradient allreduce becomes a
    hook (on every device) that sends nothing where the optimizer averages itself: the warmup's
    steps in integer codes (``average_dtype``, int4 by default where it applies) and the
    compression phase's, where it exchanges its 1-bit momentum; on a warmup in bf16 or fp32 it
    averages as DDP does. A [CompressionScheduler][lightning_onebit.CompressionScheduler] is added when the
    Trainer has none.
    With ``16-mixed`` the scaler's overflow check is combined across ranks. Every rank writes its
    error buffers to ``<checkpoint>.onebit-rank<R>-of-<W>`` beside a checkpoint and reads them
    back on resume. Gradient clipping clips what ``optimizer.step()`` receives: this rank's local
    gradients, but averaged ones in a bf16 or fp32 warmup.

    Args:
        log_comm_stats: log phase and byte counters every step (``onebit/*`` metrics).
        comm_stats_on_progress_bar: show the phase, the bytes ratio vs DDP and the step
            speedup vs the warmup on the progress bar (``1bit``, ``bytes_x``, ``step_x``;
            not logged where the Trainer has no progress bar).
    """

    strategy_name = "onebit"

    front_end = TRAINER
    user_error = MisconfigurationException
    launcher_error = MisconfigurationException

    def __init__(
        self,
        *args: Any,
        log_comm_stats: bool = True,
        comm_stats_on_progress_bar: bool = True,
        **kwargs: Any,
    ) -> None:
        lifecycle.check_ddp_kwargs(kwargs)  # before they are given below
        super().__init__(
            *args,
            # given here, so that LightningCLI does not offer them as options
            ddp_comm_state=None, ddp_comm_hook=None, ddp_comm_wrapper=None,
            model_averaging_period=None, **kwargs,
        )  # fmt: skip
        self.log_comm_stats = log_comm_stats
        self.comm_stats_on_progress_bar = comm_stats_on_progress_bar

    # precision='64-true' refused when the Trainer is built
    precision_plugin = lifecycle.refusing_float64(DDPStrategy.precision_plugin, DoublePrecision)

    # ------------------------------------------------------------------ setup

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        o = self.options
        # Add the phase-switch callback before Lightning restores callback states from a
        # checkpoint (that happens before ``setup``), so its state is restored too.
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and not any(
            isinstance(c, CompressionScheduler) for c in trainer.callbacks
        ):
            scheduler = CompressionScheduler(
                o.freeze_step, o.adaptive_freeze, o.freeze_threshold, o.freeze_window,
                log_stats=self.log_comm_stats, progress_bar=self.comm_stats_on_progress_bar,
            )  # fmt: skip
            trainer.callbacks.append(scheduler)

    @override
    def connect(self, model: pl.LightningModule) -> None:
        # before the Trainer's configuration checks, whose messages about manual optimization
        # (gradient clipping, accumulation) would come first
        _check_automatic_optimization(model, type(self).__name__)
        super().connect(model)

    @override
    def on_exception(self, exception: BaseException) -> None:
        name_unused_parameters(exception, self.algorithm, type(self).__name__)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        module = trainer.lightning_module
        if module is not None:
            _check_automatic_optimization(module, type(self).__name__)  # again after its setup
            check_dense_gradients(module)
        super().setup(trainer)
        # Lightning restored the model before this setup, and wrapping it in DDP just now
        # broadcast rank 0's parameters to every rank: this rank's own back, where they differ
        self._rank_checkpoint.restore_model(self.lightning_module)
        scaler = sync_scaler_of(self.precision_plugin, self.root_device.type)
        if not self.optimizers:
            return
        opt = self.onebit_optimizer
        self.builder.attach(opt, self.lightning_module, self._hook_state)
        if trainer.state.fn == "fit":
            clipping = bool(trainer.gradient_clip_val)
            self.builder.set_up(opt, self.num_processes, self.world_size, clipping, scaler)

    @override
    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        with overlap_paused(self._onebit_optimizers()), super().block_backward_sync():
            yield

    @override
    def _onebit_optimizers(self) -> list[OneBitOptimizer]:
        return onebit_optimizers(self.optimizers)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        try:
            super().setup_optimizers(trainer)
        except (MisconfigurationException, RuntimeError) as err:
            if "multiple optimizers" not in str(err):
                raise
            # ours alone (from None): Lightning's advice, manual optimization, is what this
            # strategy cannot run
            raise MisconfigurationException(
                _one_optimizer_message(
                    type(self).__name__, "configure_optimizers returned several optimizers"
                )
            ) from None
        if len(self.optimizers) != 1:
            raise MisconfigurationException(
                _one_optimizer_message(
                    type(self).__name__, f"there are {len(self.optimizers)} optimizers"
                )
            )
        original = self.optimizers[0]
        if isinstance(original, MockOptimizer):  # configure_optimizers returned none
            params = [p for p in trainer.lightning_module.parameters() if p.requires_grad]
            given = "configure_optimizers returned"
            self.optimizers = [self.builder.from_config(params, given, "return")]
            return
        new = self.builder.from_user(
            original,
            "configure_optimizers returned",
            "configure_optimizers must return",
            ". Return nothing from configure_optimizers to build the optimizer from the config",
        )
        self.builder.repoint([c.scheduler for c in self.lr_scheduler_configs], original, new)
        self.optimizers = [new]

    # ------------------------------------------------------------------ checkpoints

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PATH, storage_options: Any | None = None
    ) -> None:
        for opt in self._onebit_optimizers():
            self._rank_checkpoint.save(opt, self.lightning_module, checkpoint, filepath)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def remove_checkpoint(self, filepath: PATH) -> None:
        super().remove_checkpoint(filepath)
        self._rank_checkpoint.remove(filepath)

    @override
    def load_checkpoint(
        self, checkpoint_path: PATH, weights_only: bool | None = None
    ) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._rank_checkpoint.forget()
        if "optimizer_states" in checkpoint:  # weights only: nothing per rank to restore
            self._rank_checkpoint.read(checkpoint_path, checkpoint, weights_only)
        return checkpoint

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # after Lightning restored the optimizer and then the schedulers
        schedulers = [c.scheduler for c in self.lr_scheduler_configs]
        self.builder.rescale_restored(self.onebit_optimizer, schedulers)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        # again after DDP's broadcast in setup, when the restore comes before it
        self._rank_checkpoint.restore_model(self.lightning_module, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self._rank_checkpoint.pending is not None:
            self._rank_checkpoint.restore_optimizer(self.onebit_optimizer)
