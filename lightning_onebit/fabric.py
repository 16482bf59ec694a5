"""``OneBitFabricStrategy``: the 1-bit strategies for Lightning Fabric (custom training loops).

What it does is the Trainer strategy's ([OneBitStrategy][lightning_onebit.OneBitStrategy]),
from the same shared pieces (``lightning_onebit._integration``, ``OneBitStrategyBase`` first in
its bases); this module wires them into Fabric's ``DDPStrategy``. Where a Fabric loop differs from the Trainer (clipping, gradient accumulation,
the phase switch after each ``optimizer.step()``): see the class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.plugins.precision import DoublePrecision, MixedPrecision
from lightning.fabric.strategies import DDPStrategy
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_onebit._compat import set_backward_sync_control, stateful_state
from lightning_onebit._integration import lifecycle
from lightning_onebit._integration.checks import check_dense_gradients
from lightning_onebit._integration.convert import schedulers_of
from lightning_onebit._integration.front_end import FABRIC
from lightning_onebit._integration.optimizer import (
    PausingBackwardSyncControl,
    stop_overlap_for_clipping,
)
from lightning_onebit._integration.phase_switch import PhaseSwitch
from lightning_onebit._integration.rank_files import PATH
from lightning_onebit._integration.scaler import sync_scaler_of
from lightning_onebit._integration.strategy_base import OneBitStrategyBase, takes_options
from lightning_onebit.optim import OneBitOptimizer

__all__ = ["OneBitFabricStrategy"]

_ONE_OPTIMIZER = (
    "OneBitFabricStrategy trains with one optimizer (the 1-bit exchange compresses that "
    "optimizer's momentum): set up one torch.optim.Adam/AdamW (or lightning_onebit OneBitAdam / "
    "ZeroOneAdam / OneBitLamb) with one param group per former optimizer"
)


@takes_options
class OneBitFabricStrategy(OneBitStrategyBase, DDPStrategy):
    """Data-parallel training with 1-bit Adam, 0/1 Adam or 1-bit LAMB in a Fabric loop.

    Use a registered name (``L.Fabric(strategy="onebit_adam")``, after ``import lightning_onebit``;
    also the ``*_notebook`` and ``*_find_unused_parameters_true`` names) or an instance. ``setup``
    (or ``setup_module`` then ``setup_optimizers``) takes a ``torch.optim.Adam``/``AdamW``, which
    the strategy replaces by the 1-bit optimizer (LR schedulers built on it before are
    re-pointed), or one of ours, used as built. The loop stays Fabric's::

        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
        for batch in loader:
            fabric.backward(model(batch))
            optimizer.step()             # the 1-bit optimizer the strategy built from AdamW
            optimizer.zero_grad()
            fabric.log_dict(fabric.strategy.comm_stats())   # phase and bytes

    Where Fabric differs from the Trainer: the first ``fabric.clip_gradients`` turns the overlap
    with backward off for the rest of the run (an exchange started during backward cannot see a
    later clipping; first called in the compression phase, the step's exchange is redone and
    the 1-bit error buffers restart from zero, with a ``RuntimeWarning``: pass
    ``overlap_bucket_mb=None`` to avoid that). ``fabric.no_backward_sync(model)`` pauses the
    overlap as well as DDP's allreduce. The phase switch runs after every ``optimizer.step()``;
    read the counters with `comm_stats`. ``fabric.save``/``fabric.load`` write and read the
    per-rank files beside the checkpoint. The options are
    [OneBitStrategy][lightning_onebit.OneBitStrategy]'s, with the same types, defaults, checks and
    meaning, less the Trainer's logging options (read `comm_stats` instead), plus ``max_steps``.

    Args:
        max_steps: the run's optimizer steps: what a fractional ``freeze_step`` (and its default,
            0.2 of the run, when the strategy converts a torch Adam/AdamW) and a converted 0/1
            Adam's ``local_step_scaler`` (0.4 of the run unless given) are fractions of.
            Without it (and without ``freeze_step``), a converted optimizer switches once its
            variance has stabilised (``adaptive_freeze``, turned on for you: the run's length is
            unknown), at the latest after the algorithm's own ``freeze_step``; a fractional
            ``freeze_step`` raises; 0/1 Adam keeps DeepSpeed's ``local_step_scaler`` of 32768.
    """

    front_end = FABRIC
    user_error = ValueError
    launcher_error = RuntimeError

    def __init__(self, *args: Any, max_steps: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if max_steps is not None and not (
            isinstance(max_steps, int) and not isinstance(max_steps, bool) and max_steps > 0
        ):
            raise ValueError(f"max_steps must be an int > 0 or None, got {max_steps!r}")
        self.max_steps = max_steps
        o = self.options
        self._switch = PhaseSwitch(
            o.freeze_step, o.adaptive_freeze, o.freeze_threshold, o.freeze_window
        )
        set_backward_sync_control(self, PausingBackwardSyncControl(self._onebit_optimizers))
        self._module: Module | None = None  # the user's module (inside DDP)
        self._optimizer: OneBitOptimizer | None = None

    # precision='64-true' refused when Fabric is built
    precision = lifecycle.refusing_float64(DDPStrategy.precision, DoublePrecision)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        sync_scaler_of(self.precision, self.root_device.type)

    # ------------------------------------------------------------------ setup

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[torch.optim.Optimizer], scheduler: Any = None
    ) -> tuple[Module, list[torch.optim.Optimizer], Any]:
        if len(optimizers) != 1:
            raise ValueError(_ONE_OPTIMIZER)
        module = self.setup_module(module)
        return module, [self._setup_optimizer(optimizers[0], scheduler)], scheduler

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        check_dense_gradients(module)
        ddp = self.wrap_module(module)
        self._module = module
        self.builder.attach(self._optimizer, module, self._hook_state)
        return ddp

    @override
    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> OneBitOptimizer:
        return self._setup_optimizer(optimizer, None)

    def _setup_optimizer(self, original: torch.optim.Optimizer, scheduler: Any) -> OneBitOptimizer:
        if self._optimizer is not None and original is not self._optimizer:
            raise ValueError(_ONE_OPTIMIZER)
        new = self.builder.from_user(original, "fabric.setup got", "fabric.setup takes")
        if new is not original:
            # schedulers built on `original` before setup: the one given to setup, and any other
            found = schedulers_of(original)
            if scheduler is not None and not any(s is scheduler for s in found):
                found.append(scheduler)
            self.builder.repoint(found, original, new)
        self._optimizer = new
        self.builder.attach(new, self._module, self._hook_state)
        total = float(self.max_steps) if self.max_steps is not None else float("inf")
        converted = self.builder.converted and self.max_steps is not None
        if self.builder.converted and self.max_steps is None and self.options.freeze_step is None:
            self._switch.switch_when_stable(new, self.algorithm, type(self).__name__)
        local_steps = self.builder.derives_local_step_scaler
        self._switch.start(new, total, converted, FABRIC, local_steps)
        scaler = isinstance(self.precision, MixedPrecision) and self.precision.scaler is not None
        # clipping, unknown yet, turns it off later: see clip_gradients_norm
        self.builder.set_up(new, self.num_processes, self.world_size, False, scaler)
        self.builder.settle_average(new, self._switch.adaptive)
        return new

    @override
    def _onebit_optimizers(self) -> list[OneBitOptimizer]:
        return [self._optimizer] if self._optimizer is not None else []

    # ------------------------------------------------------------------ the loop

    @override
    def backward(
        self, tensor: torch.Tensor, module: Module | None, *args: Any, **kwargs: Any
    ) -> None:
        super().backward(tensor, module, *args, **kwargs)
        self._switch.times.backward_done()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self._optimizer is not None:  # the first step: once a checkpoint may be loaded
            self._switch.announce(self._optimizer)
        out = super().optimizer_step(optimizer, **kwargs)
        if self._optimizer is not None:
            self._switch.after_step(self._optimizer)  # adaptive switch, the switch message
        return out

    def comm_stats(self) -> dict[str, float]:
        """Phase and bytes after the last ``optimizer.step()``, for your own logging
        (``fabric.log_dict(fabric.strategy.comm_stats())``): the Trainer strategy's
        ``onebit/*`` metrics (see [CompressionScheduler][lightning_onebit.CompressionScheduler]), equal on
        every rank: ``onebit/phase`` (0 = warmup / variance phase, 1 = compression),
        ``onebit/ratio_vs_ddp``, ``onebit/bytes_step``, ``onebit/bytes_total``,
        ``onebit/skipped_steps``, and once measured ``onebit/step_ms_warmup``,
        ``onebit/step_ms_compression`` (median time per ``optimizer.step()`` to the next, per
        phase), ``onebit/after_bwd_ms`` (from ``fabric.backward`` returning to the end of the
        step) and ``onebit/step_speedup`` (warmup / compression)."""
        return self._switch.stats(self.onebit_optimizer)

    def comm_summary(self) -> str:
        """One line for the end of training: the bytes saved, the step time per phase and the
        time saved vs DDP (the Trainer strategy prints it at the end of ``fit``)."""
        return self._switch.summary(self.onebit_optimizer)

    def synchronize(self) -> None:
        """Make the parameters equal on every rank (0/1 Adam ends its local steps with a
        synchronisation; a no-op otherwise). Call it on every rank at the end of training, before
        evaluating or saving a model for inference (the Trainer strategy does it at the end of
        ``fit``)."""
        self.onebit_optimizer.synchronize()

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        stop_overlap_for_clipping(self._optimizer, optimizer)
        return super().clip_gradients_norm(
            module, optimizer, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )

    @override
    def clip_gradients_value(
        self, module: Module, optimizer: torch.optim.Optimizer, clip_val: float | int
    ) -> None:
        stop_overlap_for_clipping(self._optimizer, optimizer)
        return super().clip_gradients_value(module, optimizer, clip_val)

    # ------------------------------------------------------------------ checkpoints

    @override
    def save_checkpoint(
        self,
        path: PATH,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        opt = self._optimizer
        if opt is None or not any(v is opt for v in state.values()):
            return super().save_checkpoint(path, state, storage_options, filter)
        converted = stateful_state(self, state, filter)
        states = [converted[k] for k, v in state.items() if v is opt and k in converted]
        extra = {"phase_switch": self._switch.state_dict()}
        self._rank_checkpoint.save_step_keyed(opt, self._module, converted, states, path, extra)
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(
                checkpoint=converted, path=path, storage_options=storage_options
            )

    @override
    def load_checkpoint(
        self, path: PATH, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        opt = self._optimizer
        restores_opt = isinstance(state, dict) and any(v is opt for v in state.values())
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if not restores_opt or opt is None:
            return remainder
        meta = self._rank_checkpoint.read_step_keyed(path, remainder, weights_only)
        self._switch.load_state_dict(meta.get("phase_switch") or {})
        # a fraction of max_steps is decided once per run: a resumed run keeps its switch (and
        # 0/1 Adam's local_step_scaler)
        self._switch.keep_restored(opt)
        self._switch.catch_up(opt)  # a checkpoint of torch's Adam past the switch
        self.builder.rescale_restored(opt, schedulers_of(opt))
        if self._module is not None:  # 0/1 Adam between two synchronisations: its own
            self._rank_checkpoint.restore_model(self._module, strict)
        self._rank_checkpoint.restore_optimizer(opt)
        return remainder
