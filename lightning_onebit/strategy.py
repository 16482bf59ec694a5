"""``OneBitStrategy``: Lightning's ``DDPStrategy`` with the 1-bit exchange of 1-bit Adam, 0/1 Adam
or 1-bit LAMB instead of its gradient allreduce (see the class): the pieces it shares with the
Fabric strategy (``lightning_onebit._integration``) wired into the Trainer's hooks."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Generator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.plugins.precision import DoublePrecision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_onebit._compat import IS_INTERACTIVE, MockOptimizer
from lightning_onebit._integration import lifecycle
from lightning_onebit._integration.checks import check_dense_gradients
from lightning_onebit._integration.errors import name_unused_parameters, quiet_errors_on_this_rank
from lightning_onebit._integration.front_end import TRAINER
from lightning_onebit._integration.hook import HookState, wrap_in_ddp
from lightning_onebit._integration.optimizer import (
    OptimizerBuilder,
    onebit_optimizers,
    overlap_paused,
)
from lightning_onebit._integration.options import (
    ALGORITHMS,
    AboveZeroToOne,
    AtLeastOne,
    NonNegativeFloat,
    NonNegativeInt,
    OpenUnitInterval,
    PositiveFloat,
    PositiveInt,
    StrategyOptions,
    ZeroToBelowOne,
)
from lightning_onebit._integration.rank_files import PATH, RankCheckpoint
from lightning_onebit._integration.registry import register_names
from lightning_onebit._integration.scaler import sync_scaler_of
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


class OneBitStrategy(DDPStrategy):
    """Data-parallel training with 1-bit Adam, 0/1 Adam or 1-bit LAMB.

    Use a registered name — ``Trainer(strategy="onebit_adam")``, ``"zero_one_adam"``,
    ``"onebit_lamb"``, or the fork-started ``"onebit_adam_notebook"`` etc. for notebooks (after
    ``import lightning_onebit``) — or an instance for full control. The LightningModule stays
    unmodified: ``configure_optimizers`` may keep returning ``torch.optim.Adam``/``AdamW`` (with
    LR schedulers, any param groups), which the strategy replaces by the 1-bit optimizer; one of
    ours (:mod:`lightning_onebit.optim`) is used as built. DDP's gradient allreduce becomes a
    hook (on every device) that averages uncompressed on warmup steps (in bf16 by default:
    ``average_dtype``) and sends nothing on compression steps, where the optimizer exchanges its
    1-bit momentum. A :class:`~lightning_onebit.callbacks.CompressionScheduler` is added when the
    Trainer has none.
    With ``16-mixed`` the scaler's overflow check is combined across ranks. Every rank writes its
    error buffers to ``<checkpoint>.onebit-rank<R>-of-<W>`` beside a checkpoint and reads them
    back on resume. Gradient clipping clips what ``optimizer.step()`` receives: averaged
    gradients in warmup, this rank's local ones in the compression phase.

    Args:
        algorithm: ``"onebit_adam"``, ``"zero_one_adam"`` or ``"onebit_lamb"``.
        freeze_step: when compression starts: an int is the number of warmup optimizer steps, a
            float in (0, 1) a fraction of the run (``Trainer.estimated_stepping_batches``).
            ``None`` keeps the ``freeze_step`` / ``var_freeze_step`` of an optimizer from
            ``configure_optimizers``, and means 0.2 when the strategy builds the optimizer (the
            1-bit Adam paper and DeepSpeed's tutorials use 15–25%). 0/1 Adam: ``var_freeze_step``.
        adaptive_freeze: switch earlier, once the variance's relative change over
            ``freeze_window`` steps falls below ``freeze_threshold`` (identically on every
            rank); ``freeze_step`` stays the latest switch.
        freeze_threshold: relative change of the variance that counts as stable (adaptive only).
        freeze_window: steps between two variance snapshots (adaptive only).
        var_update_scaler: 0/1 Adam: variance updates between doublings of the variance interval.
            ``None`` here and for every algorithm option below (they apply to the optimizer the
            strategy builds; one from ``configure_optimizers`` keeps its own): the optimizer's
            default (:class:`~lightning_onebit.optim.ZeroOneAdam`, ...).
        local_step_scaler: 0/1 Adam: steps between doublings of the local-step interval.
            ``None``, when the strategy builds the optimizer: 0.4 of the run (decided once per
            run, like a fractional ``freeze_step``): after a switch at 0.2 the interval is 1 step
            until 0.6 of the run and 2 steps after, 25% fewer synchronisations than 1-bit
            Adam's after the switch. DeepSpeed's 32768 (the optimizer's default) with
            ``deepspeed_compatible`` or a DeepSpeed config, for an optimizer from
            ``configure_optimizers``, and where the run's length is unknown (an info line says
            so).
        local_step_clipper: 0/1 Adam: the largest local-step interval.
        compressed_variance_phase: 0/1 Adam: whether the steps between phase 1's variance steps
            exchange a 1-bit gradient (the paper's phase 1). ``None``: ``False`` when the
            strategy builds the optimizer (unless ``var_update_scaler`` is given): every step up
            to ``freeze_step`` averages uncompressed, as 1-bit Adam's warmup does.
        max_coeff: 1-bit LAMB: upper clamp of the layer-wise trust ratio
            (:class:`~lightning_onebit.optim.OneBitLamb`).
        min_coeff: 1-bit LAMB: lower clamp of the layer-wise trust ratio.
        coeff_beta: 1-bit LAMB: moving-average factor of the trust ratio in warmup.
        factor_max: 1-bit LAMB: upper clamp of the fresh-variance correction factor.
        factor_min: 1-bit LAMB: lower clamp of the fresh-variance correction factor.
        factor_threshold: 1-bit LAMB: largest relative change of the factor per step.
        bias_correction: torch Adam's bias correction in the optimizer the strategy builds (the
            warmup is then that optimizer, step for step). ``False`` is DeepSpeed's arithmetic,
            whose uncorrected variance makes 1-bit steps several times larger than Adam's after
            a short warmup. ``None``: ``True``, or ``False`` with ``deepspeed_compatible``.
        variance_floor: no coordinate's ``sqrt(v)`` counts as less than this fraction of its
            tensor's or group's RMS (the larger), so coordinates whose variance is too small to
            precondition (no gradient at all, as a conv bias before BatchNorm, or small ones,
            as some attention query/key weights) cannot take ``lr * scale / eps`` steps; the
            switch's message counts them per parameter. ``0`` is DeepSpeed's arithmetic.
        preconditioned_exchange: exchange what the optimizer sends divided by ``sqrt(v) + eps``,
            so the 1-bit error is the same size relative to every coordinate's step. ``False``
            exchanges the momentum, as DeepSpeed does.
        rescale_variance: precondition the 1-bit steps by the frozen variance times
            ``A / A_switch`` per tensor (``A``: its mean of Adam's variance, kept up to date
            from its gradients' mean square), so they stay Adam-sized as the gradients grow or
            shrink after the switch. ``None``: on for 1-bit Adam and for 0/1 Adam with
            its full-precision phase 1; ``False``: the variance stays as frozen (DeepSpeed's).
            Not an option of 1-bit LAMB.
        deepspeed_compatible: ``True``: the optimizer the strategy builds computes what
            DeepSpeed's of the same name computes with the same arguments (``bias_correction``,
            ``variance_floor``, ``preconditioned_exchange``, ``rescale_variance``,
            ``compressed_variance_phase`` take DeepSpeed's values; giving one of them another
            value raises ``ValueError``). ``None``: ``True`` with a ``deepspeed_config``, else
            ``False``.
        lamb_lr: 1-bit LAMB's learning rate when converting a torch Adam/AdamW: every learning
            rate in the groups and in torch's LR schedulers is multiplied by ``lamb_lr / lr``
            (LAMB's trust ratio rarely suits Adam's lr). ``None`` keeps Adam's lr, with a warning.
        log_comm_stats: log phase and byte counters every step (``onebit/*`` metrics).
        comm_stats_on_progress_bar: show the phase, the bytes ratio vs DDP and the step
            speedup vs the warmup on the progress bar (``1bit``, ``bytes_x``, ``step_x``;
            not logged where the Trainer has no progress bar).
        overlap_bucket_mb: overlap the 1-bit exchange with backward, in buckets of this many MiB;
            ``None``: exchange in ``optimizer.step()``. Turned off (with an info message) under
            gradient clipping or the ``16-mixed`` loss scaler (they edit the gradients after
            backward); paused on the backward passes of gradient accumulation.
        average_dtype: the dtype of the warmup's gradient average: ``"bf16"``/``"fp16"`` send
            half the bytes of ``"float32"`` on the warmup's steps, which are DDP's and as slow
            on a slow network; their rounding (a relative 2**-9 per value for bf16) is far
            below the gradients' batch noise. ``"float32"``: the warmup is torch's Adam on
            DDP's average, step for step. ``None``: ``"bf16"`` for an optimizer the strategy
            builds (``"float32"`` with ``deepspeed_compatible``), else what the optimizer from
            ``configure_optimizers`` was given.
        hierarchical: on several nodes, full precision inside a node and the 1-bit exchange
            only between nodes (``devices`` times fewer bytes through each node's link).
            ``"auto"``: on with several nodes of several processes; ``True``: the same, with a
            warning where it cannot apply; ``False``: every rank compresses its own values.
        on_divergence: what a compression phase whose parameters blow up does (each tensor's
            RMS against its RMS at the switch, checked every 16 steps on the device: more than
            10 times, or not finite): ``"warn"`` once, naming the parameter, the step and what
            to try; ``"raise"``: stop with ``lightning_onebit.optim.DivergenceError`` on every
            rank.
        timeout: collective timeout: a dead or stuck rank makes the others fail after this long;
            also bounds the creation of every process group at setup.
        start_method: how processes start: ``"popen"`` (scripts), ``"fork"`` (notebooks),
            ``"spawn"``, ``"forkserver"``.
        deepspeed_config: a DeepSpeed JSON config (path or dict): see :meth:`from_deepspeed_config`.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy` and on to
            ``DistributedDataParallel`` (e.g. ``find_unused_parameters``, ``bucket_cap_mb``).
    """

    strategy_name = "onebit"

    def __init__(
        self,
        algorithm: Literal["onebit_adam", "zero_one_adam", "onebit_lamb"] = "onebit_adam",
        freeze_step: NonNegativeInt | OpenUnitInterval | None = None,
        adaptive_freeze: bool = False,
        freeze_threshold: PositiveFloat = 0.05,
        freeze_window: PositiveInt = 50,
        var_update_scaler: PositiveInt | None = None,
        local_step_scaler: PositiveInt | None = None,
        local_step_clipper: PositiveInt | None = None,
        compressed_variance_phase: bool | None = None,
        max_coeff: PositiveFloat | None = None,
        min_coeff: PositiveFloat | None = None,
        coeff_beta: ZeroToBelowOne | None = None,
        factor_max: AtLeastOne | None = None,
        factor_min: AboveZeroToOne | None = None,
        factor_threshold: NonNegativeFloat | None = None,
        bias_correction: bool | None = None,
        variance_floor: ZeroToBelowOne | None = None,
        preconditioned_exchange: bool | None = None,
        rescale_variance: bool | None = None,
        deepspeed_compatible: bool | None = None,
        lamb_lr: PositiveFloat | None = None,
        log_comm_stats: bool = True,
        comm_stats_on_progress_bar: bool = True,
        overlap_bucket_mb: PositiveFloat | None = 25.0,
        average_dtype: str | torch.dtype | None = None,
        hierarchical: bool | Literal["auto"] = "auto",
        on_divergence: Literal["warn", "raise"] = "warn",
        timeout: timedelta | None = timedelta(minutes=30),
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        deepspeed_config: str | Path | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        lifecycle.check_ddp_kwargs(kwargs)
        options, hparams, note = StrategyOptions(
            algorithm=algorithm, freeze_step=freeze_step, adaptive_freeze=adaptive_freeze,
            freeze_threshold=freeze_threshold, freeze_window=freeze_window,
            var_update_scaler=var_update_scaler, local_step_scaler=local_step_scaler,
            local_step_clipper=local_step_clipper,
            compressed_variance_phase=compressed_variance_phase, max_coeff=max_coeff,
            min_coeff=min_coeff, coeff_beta=coeff_beta, factor_max=factor_max,
            factor_min=factor_min, factor_threshold=factor_threshold,
            bias_correction=bias_correction, variance_floor=variance_floor,
            preconditioned_exchange=preconditioned_exchange, rescale_variance=rescale_variance,
            deepspeed_compatible=deepspeed_compatible, lamb_lr=lamb_lr,
            overlap_bucket_mb=overlap_bucket_mb, average_dtype=average_dtype,
            hierarchical=hierarchical, on_divergence=on_divergence, timeout=timeout,
            start_method=start_method,
        ).with_deepspeed_config(deepspeed_config, TRAINER)  # fmt: skip
        super().__init__(
            timeout=timeout, start_method=start_method,
            # (given here, so that LightningCLI does not offer them as options)
            ddp_comm_state=None, ddp_comm_hook=None, ddp_comm_wrapper=None,
            model_averaging_period=None, **kwargs,
        )  # fmt: skip
        self.options = options
        self.builder = OptimizerBuilder(
            options, type(self).__name__, MisconfigurationException, hparams
        )
        self.log_comm_stats = log_comm_stats
        self.comm_stats_on_progress_bar = comm_stats_on_progress_bar
        self._hook_state: HookState | None = None
        self._rank_checkpoint = RankCheckpoint(self)
        if note:
            rank_zero_warn(note, category=UserWarning)

    @classmethod
    def from_deepspeed_config(
        cls, config: str | Path | dict[str, Any], **overrides: Any
    ) -> OneBitStrategy:
        """The strategy a DeepSpeed JSON config of ``OneBitAdam``/``ZeroOneAdam``/``OneBitLamb``
        describes (a path or a dict): the ``"optimizer"`` section's type picks the algorithm,
        its params map to the options of the same name (``var_freeze_step`` to ``freeze_step``),
        and its ``lr``/``betas``/``eps``/``weight_decay`` build the optimizer when
        ``configure_optimizers`` returns none (a torch Adam/AdamW it returns is converted as
        usual, its own hyperparameters win). The optimizer computes with DeepSpeed's arithmetic
        (``deepspeed_compatible=True``, unless given as ``False``). ``cuda_aware``,
        ``comm_backend_name`` and the other keys with no effect here are named in one warning;
        unknown optimizer parameters raise. ``overrides`` are further ``OneBitStrategy``
        arguments (``start_method="fork"``, ...); one the config also sets wins over the config
        (and is named in the warning). The same as ``OneBitStrategy(deepspeed_config=config,
        ...)`` (LightningCLI: ``init_args: {deepspeed_config: ds_config.json}``).
        """
        return cls(deepspeed_config=config, **overrides)

    @property
    def algorithm(self) -> str:
        """``"onebit_adam"``, ``"zero_one_adam"`` or ``"onebit_lamb"``."""
        return self.options.algorithm

    # (precision='64-true' refused when the Trainer is built)
    precision_plugin = lifecycle.refusing_float64(DDPStrategy.precision_plugin, DoublePrecision)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(cls, strategy_registry)

    # ------------------------------------------------------------------ setup

    @override
    def teardown(self) -> None:
        with lifecycle.teardown_steps(self.optimizers, self._hook_state):
            super().teardown()

    @override
    def setup_environment(self) -> None:
        o, n = self.options, self.num_processes
        with lifecycle.process_setup(o.start_method, n, self.num_nodes, TRAINER):
            lifecycle.init_default_group_per_attempt(
                self._get_process_group_backend(), self.global_rank,
                self.num_nodes * n, o.timeout, self.root_device,
            )  # fmt: skip
            super().setup_environment()  # (starts the process group unless started above)
        quiet_errors_on_this_rank(self.global_rank)
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
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if IS_INTERACTIVE and self.launcher and not self.launcher.is_interactive_compatible:
            # before Lightning's own check, which suggests 'ddp_notebook' (plain DDP)
            raise MisconfigurationException(
                lifecycle.notebook_message(self.algorithm, type(self).__name__)
            )

    @override
    def on_exception(self, exception: BaseException) -> None:
        name_unused_parameters(exception, self.algorithm, type(self).__name__)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        module = trainer.lightning_module
        if module is not None:
            _check_automatic_optimization(module, type(self).__name__)  # (again after its setup)
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
            self.builder.prepare(opt, self.num_processes, self.world_size, clipping, scaler)

    @override
    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        with overlap_paused(onebit_optimizers(self.optimizers)), super().block_backward_sync():
            yield

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        # on the current stream, not on a side stream as DDPStrategy does (see build_ddp), with
        # our hook on every device
        ddp, self._hook_state = wrap_in_ddp(
            model, self.determine_ddp_device_ids(), self._ddp_kwargs
        )
        return ddp

    @override
    def _register_ddp_hooks(self) -> None:
        pass  # DDPStrategy's registers on CUDA only; ours is registered in _setup_model

    @property
    def onebit_optimizer(self) -> OneBitOptimizer:
        """The 1-bit optimizer being trained with (after setup)."""
        if len(self.optimizers) != 1:
            raise RuntimeError(
                f"{type(self).__name__} has no optimizer yet (it exists after Trainer setup)"
            )
        (opt,) = onebit_optimizers(self.optimizers)
        return opt

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
        if isinstance(original, MockOptimizer):  # (configure_optimizers returned none)
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
        for opt in onebit_optimizers(self.optimizers):
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
        if "optimizer_states" in checkpoint:  # (weights only: nothing per rank to restore)
            self._rank_checkpoint.read(checkpoint_path, checkpoint, weights_only)
        return checkpoint

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # (after Lightning restored the optimizer and then the schedulers)
        schedulers = [c.scheduler for c in self.lr_scheduler_configs]
        self.builder.rescale_restored(self.onebit_optimizer, schedulers)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        # (again after DDP's broadcast in setup, when the restore comes before it)
        self._rank_checkpoint.restore_model(self.lightning_module, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self._rank_checkpoint.pending is not None:
            self._rank_checkpoint.restore_optimizer(self.onebit_optimizer)
