"""``OneBitStrategy``: DDP whose gradient allreduce is replaced by 1-bit compressed momentum exchange.

What it changes relative to :class:`~lightning.pytorch.strategies.DDPStrategy`:

* **The optimizer.** ``configure_optimizers`` may return ``torch.optim.Adam``/``AdamW`` (with or
  without LR schedulers, with any param groups): the strategy replaces it by the chosen 1-bit
  optimizer, carrying over the groups with every key in them (lr, betas, eps, weight_decay and
  what LR schedulers store there), and re-points the schedulers (the ones they hold included). One of our optimizers (:mod:`lightning_onebit.optim`) is used as is.
* **DDP's gradient allreduce.** A DDP communication hook, registered on every device (Lightning
  registers hooks only on CUDA), averages gradients in full precision on the steps whose
  optimizer needs that (warmup; 0/1 Adam's variance steps) and sends nothing otherwise: those
  steps use local gradients, and the optimizer exchanges its 1-bit compressed momentum.
* **The phase switch.** A :class:`~lightning_onebit.callbacks.CompressionScheduler` is added when
  the Trainer has none; it switches every rank on the same step and logs the byte counters.
* **Mixed precision.** With ``16-mixed`` the gradient scaler's overflow check is combined across
  ranks (local gradients can overflow on one rank only), so every rank skips the same step.
* **Checkpoints.** Lightning writes checkpoints on rank 0 only; the error buffers (and, for 0/1
  Adam between synchronisations, the parameters and momenta) differ per rank. Every rank writes
  its own ``<checkpoint>.onebit-rank<R>-of-<W>`` file beside the checkpoint and reads it back on
  resume with the same world size; otherwise the error buffers restart from zero, with a warning.

The pieces live in modules of one job each, shared with the Fabric strategy
(:class:`~lightning_onebit.fabric.OneBitFabricStrategy`): :mod:`~lightning_onebit.options` (the
options and their checks, the registered names, the optimizer from Adam/AdamW, the overlap
settings), :mod:`~lightning_onebit.convert` (Adam/AdamW to a 1-bit optimizer, LR schedulers),
:mod:`~lightning_onebit.hook` (the DDP communication hook), :mod:`~lightning_onebit.amp` (the
rank-synced loss scaler), :mod:`~lightning_onebit.phase_switch` (when compression starts; the
callback wraps it), :mod:`~lightning_onebit.checkpoint_io` (per-rank files) and ``_checks``
(cross-rank model checks); this module wires them into Lightning's ``DDPStrategy``.

Gradient clipping clips what ``optimizer.step()`` receives: the averaged gradient in warmup and
this rank's *local* gradient in the compression phase.

At teardown the optimizer's overlap thread, hooks and process groups stop; a default process
group the strategy created is destroyed at interpreter exit (``options.own_default_group``:
usable after ``fit`` until then; one the user created is left to them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.precision import DoublePrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_onebit._checks import _check_dense_gradients, _check_same_model_on_every_rank
from lightning_onebit._compat import IS_INTERACTIVE, MockOptimizer
from lightning_onebit._errors import name_unused_parameters, quiet_errors_on_this_rank
from lightning_onebit.amp import _synced_scaler
from lightning_onebit.callbacks import CompressionScheduler
from lightning_onebit.checkpoint_io import (
    _PATH,
    _rank_file_name,
    _write_rank_file,
    read_rank_state,
)
from lightning_onebit.convert import (
    repoint_schedulers,
    rescale_restored_lrs,
    warn_if_config_differs,
)
from lightning_onebit.hook import _build_ddp, _HookState, _onebit_comm_hook
from lightning_onebit.optim import OneBitOptimizer
from lightning_onebit.options import (
    ALGORITHMS,
    OneBitOptions,
    check_no_inherited_group,
    check_strategy_args,
    configure_hierarchy,
    configure_overlap,
    destroy_single_process_group,
    notebook_message,
    one_thread_per_forked_rank,
    overlap_paused,
    own_default_group,
    register_names,
    stop_overlaps,
    warn_single_process,
)

__all__ = ["ALGORITHMS", "OneBitStrategy"]

_ONE_OPTIMIZER = (
    "OneBitStrategy trains with one optimizer (the 1-bit exchange compresses that optimizer's "
    "momentum), but configure_optimizers returned several: return one torch.optim.Adam/AdamW "
    "(or lightning_onebit OneBitAdam / ZeroOneAdam / OneBitLamb) with one param group per "
    "former optimizer, each with its own lr, betas and weight_decay"
)


class OneBitStrategy(OneBitOptions, DDPStrategy):
    """Data-parallel training with 1-bit Adam, 0/1 Adam or 1-bit LAMB.

    Use a registered name — ``Trainer(strategy="onebit_adam")``, ``"zero_one_adam"``,
    ``"onebit_lamb"``, or the fork-started ``"onebit_adam_notebook"`` etc. for notebooks (after
    ``import lightning_onebit``) — or an instance for full control. The LightningModule stays
    unmodified: ``configure_optimizers`` may keep returning ``torch.optim.Adam``/``AdamW``.

    Args:
        algorithm: ``"onebit_adam"``, ``"zero_one_adam"`` or ``"onebit_lamb"``.
        freeze_step: when compression starts. An int is the number of warmup (uncompressed)
            optimizer steps; a float in (0, 1) is a fraction of the run's total optimizer steps
            (``Trainer.estimated_stepping_batches``). ``None`` keeps the ``freeze_step`` /
            ``var_freeze_step`` of an optimizer that ``configure_optimizers`` built itself, and
            means 0.2 when the strategy builds the optimizer. The 1-bit Adam paper and DeepSpeed's
            tutorials use 15–25% of the steps; too short a warmup leaves a variance that does not
            precondition well, too long a warmup sends full-precision bytes for longer.
            For 0/1 Adam this is ``var_freeze_step``.
        adaptive_freeze: switch earlier, as soon as the variance has stabilised: its relative
            change over ``freeze_window`` steps falls below ``freeze_threshold`` (evaluated
            identically on every rank). ``freeze_step`` stays the latest switch.
        freeze_threshold: relative change of the variance that counts as stable (adaptive only).
        freeze_window: steps between two variance snapshots (adaptive only).
        var_update_scaler: 0/1 Adam: variance updates between doublings of the variance interval
            (``None``: :class:`~lightning_onebit.optim.ZeroOneAdam`'s default; so for every
            algorithm option below: the optimizer's own declaration is the one source).
        local_step_scaler: 0/1 Adam: steps between doublings of the local-step interval.
        local_step_clipper: 0/1 Adam: the largest local-step interval.
        compressed_variance_phase: 0/1 Adam: whether the steps between phase 1's variance
            steps exchange a 1-bit gradient (the paper's phase 1; ``True`` is the optimizer's
            default). ``None``: ``False`` when the strategy converts a torch Adam/AdamW, unless
            ``var_update_scaler`` is given (as a DeepSpeed config gives it): every
            step up to ``freeze_step`` averages the gradient in full precision, as 1-bit Adam's
            warmup does (early in training a few 1-bit gradient steps can knock a model out of
            its basin for good). Pass
            ``True`` for the paper's byte savings on long runs (phase 1 then sends a gradient in
            fp32 only on its exponentially spaced variance steps).
        max_coeff: 1-bit LAMB: upper clamp of the layer-wise trust ratio
            (:class:`~lightning_onebit.optim.OneBitLamb`).
        min_coeff: 1-bit LAMB: lower clamp of the layer-wise trust ratio.
        coeff_beta: 1-bit LAMB: moving-average factor of the trust ratio in warmup.
        factor_max: 1-bit LAMB: upper clamp of the fresh-variance correction factor.
        factor_min: 1-bit LAMB: lower clamp of the fresh-variance correction factor.
        factor_threshold: 1-bit LAMB: largest relative change of the factor per step.
        bias_correction: when converting a torch Adam/AdamW, keep its bias correction (the
            warmup is then that optimizer, step for step, and the compression phase is
            preconditioned by the bias-corrected variance; see the optimizers' docs). ``False``
            is DeepSpeed's arithmetic: on short runs (a warmup of fewer than ~700 steps at
            ``beta2=0.999``) its uncorrected variance makes every 1-bit step several times
            larger than Adam's. An optimizer from ``configure_optimizers`` keeps its own setting.
        variance_floor: when converting, the optimizer's ``variance_floor``: no coordinate's
            ``sqrt(v)`` counts as less than this fraction of its tensor's or group's RMS, so
            coordinates whose gradient was ~0 through the warmup (conv biases before BatchNorm,
            attention key biases, dead units, unseen embedding rows) cannot take
            ``lr * scale / eps`` steps. ``0`` is DeepSpeed's arithmetic; ``None``: the
            optimizer's default.
        preconditioned_exchange: when converting, exchange what the optimizer sends divided by
            ``sqrt(v) + eps`` (in the units of the update), so the 1-bit error is the same size
            relative to every coordinate's Adam step. ``False`` exchanges the momentum as
            DeepSpeed does. ``None``: the algorithm's default (on for 1-bit Adam and 0/1 Adam,
            off for 1-bit LAMB, where it costs loss on the demo GPT).
        rescale_variance: when converting, precondition the 1-bit steps by the frozen
            variance times ``max(1, G / G_ref)`` per tensor (``G``: the running mean square of
            the tensor's gradients, ``G_ref``: at the switch; one float per tensor all-reduced
            every 10th exchange): where gradients grow after the switch (transformers,
            short runs), the 1-bit steps stay Adam-sized instead of growing with them.
            ``None``: on for 1-bit Adam and for 0/1 Adam with its full-precision phase 1
            (``compressed_variance_phase``); ``False``: the variance stays as frozen
            (DeepSpeed's). 1-bit LAMB's
            trust ratio rescales each layer's step already: not an option there.
        lamb_lr: 1-bit LAMB's learning rate when converting a torch Adam/AdamW to
            ``onebit_lamb``. LAMB scales each layer's step by a trust ratio ``||p|| / ||u||``,
            so Adam's lr is rarely right for it: every learning rate in the groups and in torch's
            LR schedulers (``base_lrs``, ``max_lr``, ``eta_min``, ...) is multiplied by
            ``lamb_lr / lr`` (a scheduler of your own gets a warning: its own learning rates
            cannot be found). ``None`` keeps Adam's lr, with a warning.
        log_comm_stats: log phase and byte counters every step (``onebit/*`` metrics).
        comm_stats_on_progress_bar: show the phase, the bytes ratio vs DDP and the step
            speedup vs the warmup on the progress bar (``1bit``, ``bytes_x``, ``step_x``).
        overlap_bucket_mb: overlap the 1-bit exchange with backward, in buckets of this many MiB
            (``optimizer.overlap_with_backward``); ``None`` exchanges in ``optimizer.step()``
            after backward. Turned off (with an info message) where something edits the
            gradients between backward and the step: gradient clipping, the ``16-mixed`` loss
            scaler. Gradient accumulation pauses it on the backward passes without a step.
        average_dtype: the dtype of the warmup's gradient average (0/1 Adam: of its variance
            steps): ``"float32"``, or ``"bf16"``/``"fp16"`` for half the bytes on those steps,
            as DDP's bf16/fp16 compress hooks (the frozen variance loses some precision).
            ``None``: float32, or what an optimizer from ``configure_optimizers`` was given.
        hierarchical: the exchange in two levels on several nodes: full precision inside a
            node (reduce-scatter, all_gather), the 1-bit exchange only between nodes, one shard
            per local rank (``lightning_onebit/comm/hierarchical.py``): ``devices`` times fewer bytes
            through each node's network link, and the node's average compressed instead of
            each rank's values. ``"auto"`` (default): on when there are several nodes
            (``num_nodes > 1``) of several processes (``devices > 1``); ``True``: the same, with
            a warning where it cannot apply; ``False``: every rank compresses its own values (a
            flat exchange, DeepSpeed's). The warmup's average takes the same two levels. It
            applies to an optimizer from ``configure_optimizers`` too. Changing it between a
            checkpoint and its resume restarts the 1-bit error buffers (with a warning).
        timeout: collective timeout: a dead or stuck rank makes the others fail after this long.
        start_method: how processes start: ``"popen"`` (scripts), ``"fork"`` (notebooks),
            ``"spawn"``, ``"forkserver"``.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy` and on to
            ``DistributedDataParallel`` (e.g. ``find_unused_parameters``, ``bucket_cap_mb``).
    """

    strategy_name = "onebit"

    def __init__(
        self,
        algorithm: Literal["onebit_adam", "zero_one_adam", "onebit_lamb"] = "onebit_adam",
        freeze_step: int | float | None = None,
        adaptive_freeze: bool = False,
        freeze_threshold: float = 0.05,
        freeze_window: int = 50,
        var_update_scaler: int | None = None,
        local_step_scaler: int | None = None,
        local_step_clipper: int | None = None,
        compressed_variance_phase: bool | None = None,
        max_coeff: float | None = None,
        min_coeff: float | None = None,
        coeff_beta: float | None = None,
        factor_max: float | None = None,
        factor_min: float | None = None,
        factor_threshold: float | None = None,
        bias_correction: bool = True,
        variance_floor: float | None = None,
        preconditioned_exchange: bool | None = None,
        rescale_variance: bool | None = None,
        lamb_lr: float | None = None,
        log_comm_stats: bool = True,
        comm_stats_on_progress_bar: bool = True,
        overlap_bucket_mb: float | None = 25.0,
        average_dtype: str | torch.dtype | None = None,
        hierarchical: bool | Literal["auto"] = "auto",
        timeout: timedelta | None = timedelta(minutes=30),
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        deepspeed_config: str | Path | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if deepspeed_config is not None:  # the config's options merged in, then this
            self._init_from_deepspeed_config(OneBitStrategy, locals())
            return
        check_strategy_args(algorithm, timeout, kwargs)
        super().__init__(
            timeout=timeout,
            start_method=start_method,
            # (given here, so that LightningCLI does not offer them as options)
            ddp_comm_state=None,
            ddp_comm_hook=None,
            ddp_comm_wrapper=None,
            model_averaging_period=None,
            **kwargs,
        )
        # the callback this strategy adds when the Trainer has none (validated here, now)
        self.scheduler_args: dict[str, Any] = {
            "freeze_step": freeze_step,
            "adaptive": adaptive_freeze,
            "threshold": freeze_threshold,
            "window": freeze_window,
            "log_stats": log_comm_stats,
            "progress_bar": comm_stats_on_progress_bar,
        }
        self._set_options(locals())
        self._hook_state: _HookState | None = None
        self._rank_state: dict[str, Any] | None = None
        self.deepspeed_optimizer: dict[str, Any] | None = None  # lr, betas, ... of a config

    @classmethod
    def from_deepspeed_config(
        cls, config: str | Path | dict[str, Any], **overrides: Any
    ) -> OneBitStrategy:
        """The strategy a DeepSpeed JSON config of ``OneBitAdam``/``ZeroOneAdam``/``OneBitLamb``
        describes (a path or a dict): the ``"optimizer"`` section's type picks the algorithm,
        its params map to the options of the same name (``var_freeze_step`` to ``freeze_step``),
        and its ``lr``/``betas``/``eps``/``weight_decay`` build the optimizer when
        ``configure_optimizers`` returns none (a torch Adam/AdamW it returns is converted as
        usual, its own hyperparameters win). ``cuda_aware``, ``comm_backend_name`` and the other
        keys with no effect here are named in one warning; unknown optimizer parameters raise.
        ``overrides`` are further ``OneBitStrategy`` arguments (``start_method="fork"``, ...);
        one the config also sets wins over the config (and is named in the warning).
        The same as ``OneBitStrategy(deepspeed_config=config, ...)`` (LightningCLI:
        ``init_args: {deepspeed_config: ds_config.json}``).
        """
        return cls(deepspeed_config=config, **overrides)

    @property  # type: ignore[override]
    def precision_plugin(self) -> Precision:
        return super().precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # The Trainer sets the plugin at construction: refuse what cannot work before any fit.
        if isinstance(plugin, DoublePrecision):
            self._refuse_float64("OneBitStrategy")
        DDPStrategy.precision_plugin.fset(self, plugin)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ registry

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(cls, strategy_registry)

    # ------------------------------------------------------------------ setup

    @override
    def setup_distributed(self) -> None:
        check_no_inherited_group(self.num_nodes * self.num_processes)
        with own_default_group():
            super().setup_distributed()

    @override
    def teardown(self) -> None:
        stop_overlaps(self.optimizers, self._hook_state)
        super().teardown()
        destroy_single_process_group()

    @override
    def setup_environment(self) -> None:
        one_thread_per_forked_rank(self.start_method, self.num_processes)
        super().setup_environment()
        quiet_errors_on_this_rank(self.global_rank)
        # Add the phase-switch callback before Lightning restores callback states from a
        # checkpoint (that happens before ``setup``), so its state is restored too.
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and not any(
            isinstance(c, CompressionScheduler) for c in trainer.callbacks
        ):
            trainer.callbacks.append(self._new_scheduler())

    def _new_scheduler(self) -> Any:
        return CompressionScheduler(**self.scheduler_args)

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if (
            IS_INTERACTIVE
            and self.launcher is not None
            and not self.launcher.is_interactive_compatible
        ):
            # before Lightning's own check, which suggests 'ddp_notebook' (plain DDP)
            raise MisconfigurationException(notebook_message(self.algorithm, "OneBitStrategy"))

    @override
    def on_exception(self, exception: BaseException) -> None:
        name_unused_parameters(exception, self.algorithm)  # (not DDP's strategies)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if (
            trainer.lightning_module is not None
            and not trainer.lightning_module.automatic_optimization
        ):
            raise MisconfigurationException(
                "OneBitStrategy supports automatic optimization only (the strategy decides which "
                "gradients each step uses); remove `self.automatic_optimization = False`"
            )
        if trainer.lightning_module is not None:
            _check_dense_gradients(trainer.lightning_module)
        super().setup(trainer)
        if self._rank_state is not None and self._rank_state.get("model") is not None:
            # Lightning restored the model before this setup, and wrapping it in DDP just now
            # broadcast rank 0's parameters to every rank: put this rank's own back (0/1 Adam
            # checkpointed between two synchronisations, when they differ across ranks).
            self.lightning_module.load_state_dict(
                self._rank_state["model"], strict=self._rank_state.get("strict", True)
            )
        if (
            isinstance(self.precision_plugin, MixedPrecision)
            and self.precision_plugin.scaler is not None
        ):
            self.precision_plugin.scaler = _synced_scaler(
                self.precision_plugin.scaler, self.root_device.type
            )
        if self.optimizers:  # names for the optimizer's messages (e.g. the variance floor's)
            self.onebit_optimizer.param_names = {
                p: name for name, p in self.lightning_module.named_parameters()
            }
        if self._hook_state is not None:
            self._hook_state.attach(self.onebit_optimizer)
        if trainer.state.fn == "fit" and self.optimizers:
            configure_hierarchy(self.onebit_optimizer, self.hierarchical, self.num_processes)
        self._configure_overlap(trainer)
        if self.world_size == 1 and trainer.state.fn == "fit":
            warn_single_process(self.algorithm)

    def _configure_overlap(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn != "fit":
            return
        plugin = self.precision_plugin
        scaler = isinstance(plugin, MixedPrecision) and plugin.scaler is not None
        clipping = bool(trainer.gradient_clip_val)
        configure_overlap(
            self.onebit_optimizer, self.overlap_bucket_mb, self.timeout, clipping, scaler
        )

    @override
    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        opts = [o for o in self.optimizers if isinstance(o, OneBitOptimizer)]
        with overlap_paused(opts), super().block_backward_sync():
            yield

    @override
    def configure_ddp(self) -> None:
        # before DDP's own check, whose message names neither the parameter nor what to do
        assert self.model is not None
        _check_same_model_on_every_rank(
            [(name, tuple(p.shape)) for name, p in self.model.named_parameters()]
        )
        super().configure_ddp()

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        # on the current stream, not on a side stream as DDPStrategy does: see _build_ddp
        return _build_ddp(model, self.determine_ddp_device_ids(), self._ddp_kwargs)

    @override
    def _register_ddp_hooks(self) -> None:
        # DDPStrategy registers hooks on CUDA only; ours must run on every device.
        assert isinstance(self.model, DistributedDataParallel)
        self._hook_state = _HookState(process_group=None, ddp=self.model)
        self.model.register_comm_hook(self._hook_state, _onebit_comm_hook)

    @property
    def onebit_optimizer(self) -> OneBitOptimizer:
        """The 1-bit optimizer being trained with (after setup)."""
        if len(self.optimizers) != 1:
            raise RuntimeError(
                "OneBitStrategy has no optimizer yet (it exists after Trainer setup)"
            )
        opt = self.optimizers[0]
        opt = getattr(opt, "_optimizer", opt)  # LightningOptimizer
        assert isinstance(opt, OneBitOptimizer)
        return opt

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        try:
            super().setup_optimizers(trainer)
        except (MisconfigurationException, RuntimeError) as err:
            if "multiple optimizers" not in str(err):
                raise
            # Lightning's advice (manual optimization) is what this strategy cannot run
            raise MisconfigurationException(_ONE_OPTIMIZER) from err
        if len(self.optimizers) != 1:
            raise MisconfigurationException(_ONE_OPTIMIZER)
        original = self.optimizers[0]
        if isinstance(original, MockOptimizer) and self.deepspeed_optimizer is not None:
            params = [p for p in trainer.lightning_module.parameters() if p.requires_grad]
            new = self._optimizer_from_hparams(params, self.deepspeed_optimizer, "DeepSpeed config")
            self._converted_optimizer = True
            self.optimizers = [new]
        elif isinstance(original, MockOptimizer):
            raise MisconfigurationException(
                "OneBitStrategy needs an optimizer, but configure_optimizers returned none; return "
                "torch.optim.Adam, torch.optim.AdamW, or one of lightning_onebit.optim.OneBitAdam / "
                "ZeroOneAdam / OneBitLamb"
            )
        else:
            if self.deepspeed_optimizer and type(original) in (torch.optim.Adam, torch.optim.AdamW):
                warn_if_config_differs(original, self.deepspeed_optimizer)
            new = self._onebit_optimizer_from(
                original, "configure_optimizers returned", "configure_optimizers must return"
            )
            if new is not original:
                schedulers = [config.scheduler for config in self.lr_scheduler_configs]
                repoint_schedulers(schedulers, original, new, self._lr_scale)
            self.optimizers = [new]

    # ------------------------------------------------------------------ checkpoints

    def _rank_file(self, filepath: _PATH) -> str:
        return _rank_file_name(filepath, self.global_rank, self.world_size)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        if self.optimizers and isinstance(
            getattr(self.optimizers[0], "_optimizer", self.optimizers[0]), OneBitOptimizer
        ):
            _write_rank_file(
                self.onebit_optimizer, self.lightning_module, checkpoint, filepath,
                self._rank_file(filepath), self.global_rank, self.world_size,
            )  # fmt: skip
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        super().remove_checkpoint(filepath)
        fs = get_filesystem(filepath)
        rank_file = self._rank_file(filepath)
        if fs.exists(rank_file):
            fs.rm(rank_file)

    @override
    def load_checkpoint(
        self, checkpoint_path: _PATH, weights_only: bool | None = None
    ) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._rank_state = None
        if "optimizer_states" not in checkpoint:  # weights only: nothing per rank to restore
            return checkpoint
        self._rank_state = read_rank_state(
            checkpoint_path, checkpoint, self.global_rank, self.world_size
        )
        return checkpoint

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # (after Lightning restored the optimizer and then the schedulers)
        schedulers = [c.scheduler for c in self.lr_scheduler_configs]
        rescale_restored_lrs(self.onebit_optimizer, schedulers, self._lr_scale)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        if self._rank_state is not None and self._rank_state.get("model") is not None:
            # (again after DDP's broadcast in setup, when the restore comes before it)
            self._rank_state["strict"] = strict
            self.lightning_module.load_state_dict(self._rank_state["model"], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self._rank_state is not None:
            self.onebit_optimizer.load_rank_state_dict(self._rank_state["optimizer"])
        self._rank_state = None


# ---------------------------------------------------------------------- helpers
