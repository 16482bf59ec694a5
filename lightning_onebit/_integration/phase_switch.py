"""``PhaseSwitch``: when compression starts, identically on every rank, and the counters to log.

One implementation for both integrations: the Trainer's
[`CompressionScheduler`][lightning_onebit.callbacks.CompressionScheduler] (a callback around it) and
the Fabric strategy ([`OneBitFabricStrategy`][lightning_onebit.fabric.OneBitFabricStrategy], which
calls it after every optimizer step). It needs only torch and Lightning Fabric's rank-zero
utilities.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_onebit._integration.front_end import FrontEnd
from lightning_onebit.comm import fp32_allreduce_bytes
from lightning_onebit.optim import OneBitOptimizer, ZeroOneAdam

__all__ = ["LOCAL_STEP_FRACTION", "PhaseSwitch", "StepTimes"]

#: the switch when the strategy built the optimizer and no ``freeze_step`` was given
_DEFAULT_FRACTION = 0.2

#: 0/1 Adam's ``local_step_scaler`` as a fraction of the run's optimizer steps, when the strategy
#: built the optimizer and none was given. The local-step interval doubles every
#: ``local_step_scaler`` steps after the variance freezes: after a switch at 0.2 of the run (the
#: default) it is 1 step until 0.6 of the run and 2 steps after, so 0.6 of the run's steps
#: synchronise after the switch where 1-bit Adam's 0.8 do (25% fewer rounds); an earlier switch
#: (``adaptive_freeze``) reaches 4. A smaller fraction reaches longer intervals (0.2: 1, 2, 4
#: and 8 steps, 53% fewer rounds), which short runs pay for in loss (docs/algorithms.md).
#: DeepSpeed's fixed 32768 makes every step synchronise on a run with fewer than 32768 steps
#: after the freeze, as 1-bit Adam's do.
LOCAL_STEP_FRACTION = 0.4


class StepTimes:
    """Wall-clock time per optimizer step and phase (what the user gets: data loading, forward,
    backward, communication, update), and the time from the end of backward to the end of the
    step (waiting for the communication still in flight, then the update). The first step of a
    fit and of each phase are not counted (one-off allocations, bucket rebuilds); medians are
    over the last ``window`` steps of each phase."""

    PHASES = ("warmup", "compression")

    def __init__(self, window: int = 512) -> None:
        self.window = window
        self.reset()

    def reset(self) -> None:
        self._last: tuple[float, int] | None = None  # end of the last step, its phase
        self._backward_end: float | None = None
        self.steps = {p: deque(maxlen=self.window) for p in range(2)}
        self.after_backward = {p: deque(maxlen=self.window) for p in range(2)}
        self.count = [0, 0]  # steps per phase, all of them
        self.sent = [0, 0]  # bytes this rank sent per phase (this fit)
        self.fp32_equiv = [0, 0]  # ... and what fp32 DDP's allreduce would have sent

    def backward_done(self) -> None:
        """Call when backward has finished (before the optimizer step)."""
        self._backward_end = time.perf_counter()

    def step_done(self, phase: int, sent: int = 0, fp32_equiv: int = 0) -> None:
        """Call after each optimizer step; ``phase``: 0 warmup, 1 compression; ``sent``: the
        bytes this rank sent in it, ``fp32_equiv``: those fp32 DDP's allreduce would have."""
        now = time.perf_counter()
        last, self._last = self._last, (now, phase)
        self.count[phase] += 1
        self.sent[phase] += sent
        self.fp32_equiv[phase] += fp32_equiv
        tb, self._backward_end = self._backward_end, None
        if last is None or last[1] != phase:
            return
        self.steps[phase].append(now - last[0])
        if tb is not None:
            self.after_backward[phase].append(now - tb)

    def median(self, phase: int) -> float | None:
        return statistics.median(self.steps[phase]) if self.steps[phase] else None

    def median_after_backward(self, phase: int) -> float | None:
        ab = self.after_backward[phase]
        return statistics.median(ab) if ab else None

    def speedup(self) -> float | None:
        """Median warmup step / median compression step (``None`` until both are known)."""
        w, c = self.median(0), self.median(1)
        return w / c if w and c else None

    def stats(self, phase: int) -> dict[str, float]:
        """``onebit/step_ms_warmup`` / ``_compression`` (medians), ``onebit/after_bwd_ms`` (the
        current phase's median), ``onebit/step_speedup`` (warmup / compression), where known."""
        out = {}
        for p, name in enumerate(self.PHASES):
            med = self.median(p)
            if med is not None:
                out[f"onebit/step_ms_{name}"] = 1e3 * med
        ab = self.median_after_backward(phase)
        if ab is not None:
            out["onebit/after_bwd_ms"] = 1e3 * ab
        sp = self.speedup()
        if sp is not None:
            out["onebit/step_speedup"] = sp
        return out

    def summary(self, sent: float, fp32_equiv: float, world_size: int = 2) -> str:
        """One line for the end of a run: bytes saved, step time per phase, the time saved vs
        DDP (the compression steps at the warmup's step time: with a half-precision average
        the warmup is faster than DDP's fp32 steps, so the saving is understated). With one
        process (``world_size`` 1) nothing is sent, and the line says so instead of the bytes
        and the time saved."""
        if world_size == 1:
            parts = ["one process: nothing is sent (the exchange runs between 2 or more ranks)"]
        else:
            parts = [
                f"sent {_gb(sent)} per rank where DDP's fp32 allreduce sends {_gb(fp32_equiv)}"
                + (f" ({fp32_equiv / sent:.1f}x less)" if sent else "")
            ]
        for p, name in enumerate(self.PHASES):
            med = self.median(p)
            if self.count[p]:
                ms = f"{1e3 * med:.0f} ms" if med is not None else "—"
                ab = self.median_after_backward(p)
                wait = f", {1e3 * ab:.0f} ms after backward" if ab is not None else ""
                n = self.count[p]
                sent, fp32 = self.sent[p], self.fp32_equiv[p]
                nbytes = (
                    f", {_gb(sent)} ({fp32 / sent:.1f}x less than DDP)"
                    if sent and world_size > 1
                    else ""
                )
                parts.append(f"{name} {ms}/step over {n} step{'s' * (n != 1)}{wait}{nbytes}")
        sp, w, c = self.speedup(), self.median(0), self.median(1)
        if sp is not None and world_size == 1:
            parts.append(f"step speedup vs warmup {sp:.2f}x")
        elif sp is not None and w is not None and c is not None:
            saved = self.count[1] * (w - c)
            parts.append(
                f"step speedup vs warmup {sp:.2f}x: about {_duration(saved)} "
                f"{'saved' if saved >= 0 else 'lost'} vs DDP over this run (compression steps "
                "at the warmup's step time)"
            )
        return "lightning-onebit: " + "; ".join(parts)


def _gb(nbytes: float) -> str:
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def _duration(seconds: float) -> str:
    s = abs(seconds)
    return f"{s / 3600:.2f} h" if s >= 3600 else f"{s / 60:.1f} min" if s >= 60 else f"{s:.1f} s"


class PhaseSwitch:
    """Decides when compression starts, identically on every rank, and reads the byte counters.

    The switch happens after optimizer step ``freeze_step`` (the optimizer's built-in switch, so it
    is tied to the optimizer's own step counter and survives checkpoints), or earlier with
    ``adaptive=True`` once the second moment has stabilised: every ``window`` optimizer steps
    the relative change ``||v_t - v_{t-window}|| / ||v_t||`` (on a fixed strided sample of at most
    ``sample`` coordinates) is compared with ``threshold``; the decision is combined across ranks
    so that every rank switches on the same step.

    Args:
        freeze_step: an int (optimizer steps of warmup), a float in (0, 1) (fraction of the run's
            optimizer steps), or ``None``: keep the optimizer's own ``freeze_step`` if the user
            built a 1-bit optimizer, else 0.2 of the run.
        adaptive: also switch as soon as the variance is stable (see above).
        threshold: relative variance change below which it counts as stable.
        window: optimizer steps between variance snapshots.
        sample: the most variance coordinates kept per snapshot (memory bound for large models).
    """

    def __init__(
        self,
        freeze_step: int | float | None = None,
        adaptive: bool = False,
        threshold: float = 0.05,
        window: int = 50,
        sample: int = 1_000_000,
    ) -> None:
        freeze_step = _normalize_freeze_step(freeze_step)
        if window < 1:
            raise ValueError(
                f"window (the strategies' freeze_window) must be an int >= 1, got {window!r}"
            )
        if not threshold > 0:
            raise ValueError(
                f"threshold (the strategies' freeze_threshold) must be > 0, got {threshold!r}"
            )
        self.freeze_step = freeze_step
        self.adaptive = adaptive
        self.threshold = threshold
        self.window = window
        self.sample = sample
        # state (in the checkpoint)
        self.switch_step: int | None = None  # the resolved step
        self.local_step_scaler: int | None = None  # 0/1 Adam's, where the strategy chose it
        self.switched_at: int | None = None  # the last optimizer step before compression
        self._snapshot: torch.Tensor | None = None
        self._last_logged_step: tuple[int, int] = (-1, -1)
        self._restored = False  # state loaded from a checkpoint, not yet used by a run
        self._plan: str | None = None  # the switch to announce (see announce)
        self._local_steps = False  # this run sets 0/1 Adam's local_step_scaler
        self.times = StepTimes()  # this fit's step times (not in the checkpoint)

    # ------------------------------------------------------------------ the run's start

    def start(
        self,
        opt: OneBitOptimizer,
        total: float,
        converted: bool,
        front_end: FrontEnd,
        local_steps: bool = False,
    ) -> None:
        """Resolve the switch step at the start of a run of ``total`` optimizer steps
        (``inf``: unknown) and set it on ``opt``; ``converted``: the strategy built ``opt``;
        ``front_end``: the user's (the Trainer or Fabric), named in messages; ``local_steps``:
        also set 0/1 Adam's ``local_step_scaler`` from the run's length
        (``LOCAL_STEP_FRACTION``)."""
        restored, self._restored = self._restored, False
        self.times.reset()
        self._plan = None
        self._local_steps = local_steps and isinstance(opt, ZeroOneAdam)
        if self._local_steps:
            self._start_local_steps(opt, total, restored, front_end)
        if not restored:  # a new run (or a second fit of this Trainer without a checkpoint)
            self.switched_at, self._snapshot = None, None
        if restored and self.switched_at is not None:
            # the optimizer's own state, its phase included, is restored after this hook
            rank_zero_info(
                f"{type(opt).__name__}: resuming in the {opt.PHASES[1]} phase (1-bit exchange "
                f"since optimizer step {self.switched_at + 1})"
            )
            return
        fs = self.freeze_step
        if fs is None and converted:
            fs = _DEFAULT_FRACTION
        if fs is None:
            self.switch_step = opt.switch_step
            self._warn_if_never_switches(
                opt, self.switch_step, total, f"{type(opt).__name__}.{opt.SWITCH_OPTION}"
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
                    f"{front_end.run_length}, or pass an int freeze_step"
                )
            step = max(1, round(fs * total))
        else:
            step = fs
        self._warn_if_never_switches(opt, step, total, "freeze_step")
        opt.switch_step = step
        self.switch_step = step
        if step < total:
            self._plan = how  # said once the run's state is restored: announce

    def _start_local_steps(
        self, opt: ZeroOneAdam, total: float, restored: bool, front_end: FrontEnd
    ) -> None:
        """Set ``opt.local_step_scaler`` to ``LOCAL_STEP_FRACTION`` of the run's ``total``
        optimizer steps, decided once per run as a fractional switch is: a resumed fit keeps the
        checkpoint's (its interval counters count towards it). A run of unknown length keeps the
        optimizer's own (DeepSpeed's 32768), with an info line."""
        if restored and self.local_step_scaler is not None:
            opt.local_step_scaler = self.local_step_scaler
            return
        if math.isfinite(total):
            opt.local_step_scaler = max(1, round(LOCAL_STEP_FRACTION * total))
            rank_zero_info(
                f"ZeroOneAdam: local_step_scaler={opt.local_step_scaler} ({LOCAL_STEP_FRACTION} "
                f"of the run's {int(total)} optimizer steps): after the variance freezes the "
                f"local-step interval doubles every {opt.local_step_scaler} steps, up to "
                f"local_step_clipper={opt.local_step_clipper}"
            )
        else:
            rank_zero_info(
                f"ZeroOneAdam: local_step_scaler={opt.local_step_scaler} (DeepSpeed's default: "
                f"{LOCAL_STEP_FRACTION} of the run cannot be known, the run has no step limit), "
                f"so every step synchronises for the first {opt.local_step_scaler} steps after "
                f"the variance freezes; {front_end.run_length}, or pass local_step_scaler=..."
            )
        self.local_step_scaler = opt.local_step_scaler

    def keep_restored(self, opt: OneBitOptimizer) -> None:
        """After ``start``, once a checkpoint's state has been loaded into this switch and
        into ``opt`` (Fabric loads after setup): what the run decided when it started, the
        switch step of a fractional ``freeze_step`` and a ``local_step_scaler`` from the run's
        length, over what this fit's ``max_steps`` gave."""
        if self.switch_step is not None and opt.phase == opt.PHASES[0]:
            opt.switch_step = self.switch_step
            if isinstance(self.freeze_step, float) and self._plan is not None:
                self._plan = (
                    f" (freeze_step={self.freeze_step} of the run as it started, from the "
                    "checkpoint)"
                )
        if self._local_steps and self.local_step_scaler is not None:
            opt.local_step_scaler = self.local_step_scaler

    def catch_up(self, opt: OneBitOptimizer) -> None:
        """Once a checkpoint's state is in ``opt``, before the first step of a fit: switch now if
        the restored step count is already past the switch (a checkpoint of torch's Adam, e.g.
        from ``strategy="ddp"``, whose moments are the warmup's), so that the next backward
        already gives local gradients. The one line that says so names the first compressed
        step, as the switch's own line does, and stands for it."""
        if not opt.catch_up_switch():
            return
        self._plan = None  # the switch it announced is past
        self.switched_at = opt.step_count  # the last uncompressed step: the checkpoint's
        rank_zero_info(_switch_message(opt, resumed=True))

    def announce(self, opt: OneBitOptimizer) -> None:
        """Say after which optimizer step compression starts, once (Trainer: at the start of
        training; Fabric: before the first step), after a checkpoint's state is restored: a
        resumed run keeps its switch (``keep_restored``) or is past it (``catch_up``,
        whose line replaces this one)."""
        plan, self._plan = self._plan, None
        if plan is None or opt.phase != opt.PHASES[0]:
            return
        rank_zero_info(
            f"1-bit compression starts after optimizer step {opt.switch_step}{plan} "
            f"({type(opt).__name__})"
        )

    def switch_when_stable(self, opt: OneBitOptimizer, algorithm: str, strategy: str) -> None:
        """A run of unknown length whose optimizer the strategy built, with no ``freeze_step``:
        0.2 of the run (the default) cannot be known, so switch once the variance has stabilised
        rather than after the algorithm's own ``freeze_step`` (100000 steps: no compression at
        all in most runs). ``strategy`` names the strategy class in the message."""
        self.adaptive = True
        rank_zero_info(
            f"{algorithm}: with no max_steps (0.2 of the run cannot be known), 1-bit "
            "compression starts once the variance has stabilised (adaptive_freeze: relative "
            f"change below {self.threshold} over {self.window} steps), at the "
            f"latest after {opt.SWITCH_OPTION}={opt.switch_step} steps; pass "
            f"{strategy}(max_steps=...) (0.2 of it) or freeze_step=... to choose"
        )

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

    # ------------------------------------------------------------------ after each step

    def after_step(self, opt: OneBitOptimizer) -> bool:
        """Call after every batch (every rank): the adaptive check and the switch message.
        Returns whether an optimizer step happened since the last call (not on gradient
        accumulation's batches or a skipped step)."""
        key = (opt.step_count, opt.skipped_steps)
        if key == self._last_logged_step:
            return False
        self._last_logged_step = key
        if self.adaptive and opt.phase == opt.PHASES[0] and opt.step_count % self.window == 0:
            self._adaptive_check(opt)
        if opt.phase != opt.PHASES[0] and self.switched_at is None:
            self.switched_at = opt.step_count  # the last uncompressed step
            rank_zero_info(_switch_message(opt))
        layout = opt.flat.layout  # (None before the first step: nothing sent yet)
        fp32 = fp32_allreduce_bytes(layout.numel, opt.world_size) if layout is not None else 0
        self.times.step_done(self._phase(opt), opt.comm_stats["bytes_last_step"], fp32)
        return True

    def _phase(self, opt: OneBitOptimizer) -> int:
        """The last step's phase: 1 if it was compressed (the switch happens at the end of the
        last warmup step)."""
        compressing = opt.phase != opt.PHASES[0]
        return int(
            compressing and self.switched_at is not None and opt.step_count > self.switched_at
        )

    def summary(self, opt: OneBitOptimizer) -> str:
        """One line for the end of a run (see ``StepTimes.summary``)."""
        comm = opt.comm_stats
        return self.times.summary(comm["bytes_total"], comm["fp32_equiv_total"], opt.world_size)

    def stats(self, opt: OneBitOptimizer) -> dict[str, float]:
        """The ``onebit/*`` counters of the last step (equal on every rank): ``phase`` (0 =
        warmup / variance phase, 1 = compression), ``ratio_vs_ddp`` (bytes an fp32 DDP allreduce
        would have sent so far / bytes sent), ``bytes_step``, ``bytes_total`` (bytes this rank
        sent), ``skipped_steps``; on several nodes also ``bytes_step_intra``/``bytes_step_inter``
        (what stayed inside / left this rank's node) and ``ratio_vs_ddp_inter`` (the bytes an
        fp32 ring allreduce sends through a node's link so far / the node's bytes sent)."""
        comm = opt.comm_stats
        total = comm["bytes_total"]
        nodes = {}
        if comm["fp32_equiv_total_inter"]:  # several nodes
            inter, inter_total = comm["bytes_last_step_inter"], comm["bytes_total_inter"]
            nodes = {
                "onebit/bytes_step_intra": float(comm["bytes_last_step"] - inter),
                "onebit/bytes_step_inter": float(inter),
                "onebit/ratio_vs_ddp_inter": float(comm["fp32_equiv_total_inter"] / inter_total)
                if inter_total
                else 1.0,
            }
        return {
            # this step's phase (the switch happens at the end of the last warmup step)
            "onebit/phase": float(self._phase(opt)),
            "onebit/ratio_vs_ddp": float(comm["fp32_equiv_total"] / total) if total else 1.0,
            "onebit/bytes_step": float(comm["bytes_last_step"]),
            "onebit/bytes_total": float(total),
            "onebit/skipped_steps": float(opt.skipped_steps),
            **nodes,
            **self.times.stats(self._phase(opt)),
        }

    def _adaptive_check(self, opt: OneBitOptimizer) -> None:
        v = opt.variance
        if v is None:
            return
        now = opt.variance_as_frozen(max(1, v.numel() // self.sample))
        assert now is not None  # v exists
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

    def state_dict(self) -> dict[str, Any]:
        return {
            "switch_step": self.switch_step,
            "switched_at": self.switched_at,
            "snapshot": self._snapshot,
            "local_step_scaler": self.local_step_scaler,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.switch_step = state_dict.get("switch_step")
        self.local_step_scaler = state_dict.get("local_step_scaler")
        self.switched_at = state_dict.get("switched_at")
        self._snapshot = state_dict.get("snapshot")
        self._restored = True


def _switch_message(opt: OneBitOptimizer, resumed: bool = False, most: int = 8) -> str:
    """One line for the console at the switch: from which optimizer step on (the one number
    that names the switch), why then where a resumed fit starts past it (``resumed``), and which
    coordinates were floored."""
    msg = (
        f"{type(opt).__name__}: {opt.PHASES[1]} phase (1-bit exchange) from optimizer step "
        f"{opt.step_count + 1} on"
    )
    if resumed:
        msg += (
            f", the first step of this fit (its checkpoint's step count has reached "
            f"{opt.SWITCH_OPTION}={opt.switch_step})"
        )
    floored = sorted(opt.floored.items(), key=lambda kv: -kv[1])
    if floored:
        total = sum(n for _, n in floored)
        shown = ", ".join(f"{name}: {n}" for name, n in floored[:most])
        more = f", and {len(floored) - most} more parameters" if len(floored) > most else ""
        f = opt.variance_floor
        msg += (
            f"; variance floor (variance_floor={f}) raised {total} coordinates whose variance "
            f"is too small to precondition (v <= {f**2:.3g} = variance_floor**2 times the larger "
            f"of the mean v of its tensor and of its param group): {shown}{more}"
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
