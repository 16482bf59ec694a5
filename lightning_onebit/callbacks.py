"""``CompressionScheduler``: switches the 1-bit optimizer's phase and logs what it sends."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_onebit.optim import OneBitOptimizer

__all__ = ["CompressionScheduler"]

_DEFAULT_FRACTION = 0.2


class CompressionScheduler(Callback):
    """Decides when compression starts, identically on every rank, and logs the byte counters.

    The switch happens after optimizer step ``freeze_step`` (the optimizer's built-in switch, so it
    is tied to the optimizer's own step counter and survives checkpoints), or earlier with
    ``adaptive=True`` once the second moment has stabilised: every ``window`` optimizer steps
    the relative change ``||v_t - v_{t-window}|| / ||v_t||`` (on a fixed strided sample of at most
    ``sample`` coordinates) is compared with ``threshold``; the decision is combined across ranks
    so that every rank switches on the same step.

    Logged every optimizer step (``self.log``, rank 0's values; they are equal on every rank):
    ``onebit/phase`` (0 = warmup / variance phase, 1 = compression), ``onebit/bytes_step`` and
    ``onebit/bytes_total`` (bytes this rank sent), ``onebit/ratio_vs_ddp`` (bytes an fp32 DDP
    allreduce would have sent so far, divided by ``bytes_total``), ``onebit/skipped_steps`` (steps
    the optimizer dropped because a NaN/Inf reached what it communicates).

    :class:`~lightning_onebit.OneBitStrategy` adds one automatically when the Trainer has none.

    Args:
        freeze_step: an int (optimizer steps of warmup), a float in (0, 1) (fraction of the run's
            optimizer steps), or ``None``: keep the optimizer's own ``freeze_step`` if
            ``configure_optimizers`` built a 1-bit optimizer, else 0.2 of the run.
        adaptive: also switch as soon as the variance is stable (see above).
        threshold: relative variance change below which it counts as stable.
        window: optimizer steps between variance snapshots.
        log_stats: log the ``onebit/*`` metrics.
        sample: the most variance coordinates kept per snapshot (memory bound for large models).
        progress_bar: show ``onebit/phase`` and ``onebit/ratio_vs_ddp`` on the progress bar
            (with ``log_stats``).
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
        freeze_step = _normalize_freeze_step(freeze_step)
        if window < 1:
            raise ValueError(
                f"window (OneBitStrategy: freeze_window) must be an int >= 1, got {window!r}"
            )
        if not threshold > 0:
            raise ValueError(
                f"threshold (OneBitStrategy: freeze_threshold) must be > 0, got {threshold!r}"
            )
        self.freeze_step = freeze_step
        self.adaptive = adaptive
        self.threshold = threshold
        self.window = window
        self.log_stats = log_stats
        self.progress_bar = progress_bar
        self.sample = sample
        # state (in the checkpoint)
        self.switch_step: int | None = None  # the resolved step
        self.switched_at: int | None = None  # the last optimizer step before compression
        self._snapshot: torch.Tensor | None = None
        self._last_logged_step: tuple[int, int] = (-1, -1)
        self._restored = False  # state loaded from a checkpoint, not yet used by a fit

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _optimizer(trainer: pl.Trainer) -> OneBitOptimizer:
        for opt in trainer.strategy.optimizers:
            opt = getattr(opt, "_optimizer", opt)
            if isinstance(opt, OneBitOptimizer):
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

    @staticmethod
    def _warn_if_never_switches(opt: OneBitOptimizer, step: int, total: float, name: str) -> None:
        """Warn (before the first step) when the switch comes at or after the run's last step."""
        if not (math.isfinite(total) and step >= total) or opt.phase != opt.PHASES[0]:
            return
        rank_zero_warn(
            f"{name}={step} is not below the run's {int(total)} optimizer steps (max_steps): the "
            f"phase switch would come after the last step, so {type(opt).__name__} stays in its "
            f"{opt.PHASES[0].value!r} phase for the whole run and its {opt.PHASES[1].value!r} phase never "
            f"starts; pass a freeze_step below {int(total)} (or a fraction of the run, e.g. 0.2)"
        )

    # ------------------------------------------------------------------ hooks

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        opt = self._optimizer(trainer)
        restored, self._restored = self._restored, False
        if not restored:  # a new run (or a second fit of this Trainer without a checkpoint)
            self.switched_at, self._snapshot = None, None
        if restored and self.switched_at is not None:
            # (the optimizer's own state, its phase included, is restored after this hook)
            rank_zero_info(
                f"{type(opt).__name__}: resuming in the {opt.PHASES[1]} phase (1-bit exchange "
                f"since optimizer step {self.switched_at + 1})"
            )
            return
        fs = self.freeze_step
        if fs is None and getattr(trainer.strategy, "_converted_optimizer", False):
            fs = _DEFAULT_FRACTION
        total = self._total_steps(trainer)
        if fs is None:
            self.switch_step = opt.switch_step
            self._warn_if_never_switches(
                opt, self.switch_step, total, f"{type(opt).__name__}.{opt._switch_attr}"
            )
            return
        how = ""
        if isinstance(fs, float) and restored and self.switch_step is not None:
            # the run decided its switch when it started (a fraction of that fit's steps): a
            # resumed fit with another max_steps must not move it
            step = self.switch_step
            how = f" (freeze_step={fs} of the run as it started, from the checkpoint)"
        elif isinstance(fs, float):
            if not math.isfinite(total):
                raise ValueError(
                    f"freeze_step={fs} is a fraction of the run's steps, but the run has no step limit; "
                    "set Trainer(max_steps=...) or max_epochs, or pass an int freeze_step"
                )
            step = max(1, round(fs * total))
        else:
            step = fs
        self._warn_if_never_switches(opt, step, total, "freeze_step")
        opt.switch_step = step
        self.switch_step = step
        if step < total:
            rank_zero_info(
                f"1-bit compression starts after optimizer step {step}{how} ({type(opt).__name__})"
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
        key = (opt.step_count, opt.skipped_steps)
        if key == self._last_logged_step:
            return  # no optimizer step on this batch (gradient accumulation, scaler skip)
        self._last_logged_step = key
        if self.adaptive and opt.phase == opt.PHASES[0] and opt.step_count % self.window == 0:
            self._adaptive_check(opt)
        compressing = opt.phase != opt.PHASES[0]
        if compressing and self.switched_at is None:
            self.switched_at = opt.step_count  # the last uncompressed step
            rank_zero_info(_switch_message(opt))
        if self.log_stats:
            stats = opt.comm_stats
            total = stats["bytes_total"]
            shown = {  # on the progress bar too
                # this step's phase (the switch happens at the end of the last warmup step)
                "onebit/phase": float(compressing and opt.step_count > self.switched_at),
                "onebit/ratio_vs_ddp": float(stats["fp32_equiv_total"] / total) if total else 1.0,
            }
            logged = {
                "onebit/bytes_step": float(stats["bytes_last_step"]),
                "onebit/bytes_total": float(total),
                "onebit/skipped_steps": float(opt.skipped_steps),
            }
            kw: dict[str, Any] = {"on_step": True, "on_epoch": False, "rank_zero_only": True}
            pl_module.log_dict(shown, prog_bar=self.progress_bar, **kw)
            pl_module.log_dict(logged, **kw)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # 0/1 Adam may end between two synchronisations, each rank with its own parameters:
        # the model a user saves, tests or exports must be the same on every rank
        self._optimizer(trainer).synchronize()  # (a no-op for the others)

    def _adaptive_check(self, opt: OneBitOptimizer) -> None:
        v = opt.variance
        if v is None:
            return
        stride = max(1, v.numel() // self.sample)
        now = v[::stride].detach().clone()
        if self._snapshot is not None and self._snapshot.shape == now.shape:
            change = float((now - self._snapshot).norm() / now.norm().clamp_min(1e-30))
            stable = torch.tensor([1.0 if change < self.threshold else 0.0], device=now.device)
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(stable, op=dist.ReduceOp.MIN)  # every rank decides the same
            if stable.item() == 1.0:
                rank_zero_info(
                    f"variance stable (relative change {change:.3g} < {self.threshold} over {self.window} steps): "
                    f"1-bit compression starts after step {opt.step_count}"
                )
                opt.freeze()
                self._snapshot = None
                return
        self._snapshot = now

    # ------------------------------------------------------------------ checkpoint

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "switch_step": self.switch_step,
            "switched_at": self.switched_at,
            "snapshot": self._snapshot,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.switch_step = state_dict.get("switch_step")
        self.switched_at = state_dict.get("switched_at")
        self._snapshot = state_dict.get("snapshot")
        self._restored = True


def _switch_message(opt: OneBitOptimizer, most: int = 8) -> str:
    """One line for the console at the switch: when, and which coordinates were floored."""
    msg = (
        f"{type(opt).__name__}: {opt.PHASES[1]} phase (1-bit exchange) from optimizer step "
        f"{opt.step_count + 1} on"
    )
    floored = sorted(opt.floored.items(), key=lambda kv: -kv[1])
    if floored:
        total = sum(n for _, n in floored)
        shown = ", ".join(f"{name}: {n}" for name, n in floored[:most])
        more = f", and {len(floored) - most} more parameters" if len(floored) > most else ""
        msg += (
            f"; variance floor (variance_floor={opt.variance_floor}) raised {total} coordinates "
            f"whose gradient was ~0 through the warmup (they cannot be preconditioned by their "
            f"own variance): {shown}{more}"
        )
    return msg


def _normalize_freeze_step(freeze_step: Any) -> int | float | None:
    """Validate ``freeze_step``: an int step count, a fraction in (0, 1), or None.

    A whole float >= 1 (``12.0``, as a CLI or YAML may deliver ``12``) means that many steps.
    """
    if freeze_step is None:
        return None
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, (int, float)):
        raise ValueError(
            f"freeze_step must be an int >= 0, a float in (0, 1), or None; got {freeze_step!r}"
        )
    if isinstance(freeze_step, float) and freeze_step >= 1.0 and freeze_step.is_integer():
        freeze_step = int(freeze_step)
    if isinstance(freeze_step, int) and freeze_step < 0:
        raise ValueError(f"freeze_step must be >= 0 steps, got {freeze_step}")
    if isinstance(freeze_step, float) and not 0.0 < freeze_step < 1.0:
        raise ValueError(
            f"freeze_step={freeze_step}: a float is a fraction of the total steps and must be in "
            "(0, 1); pass a whole number for a step count"
        )
    return freeze_step
