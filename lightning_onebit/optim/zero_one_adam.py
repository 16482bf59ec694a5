"""0/1 Adam (Lu et al., 2022, https://arxiv.org/abs/2202.06009), as DeepSpeed runs it.

1-bit Adam still needs a full-precision warmup, and it communicates every step. 0/1 Adam removes
both costs with two policies:

* **Adaptive variance freezing.** From the first step, the variance is updated only on a sparse,
  exponentially thinning set of steps (every step at first; the interval doubles after every
  ``var_update_scaler`` updates), and only those steps need a full-precision gradient
  allreduce. On all other steps the *gradient* is exchanged with 1-bit compression and only the
  momentum is updated. After ``var_freeze_step`` the variance is frozen for good.
* **Local steps.** Once the variance is frozen, ranks take local Adam steps with their own
  gradients and synchronise every ``local_step_interval`` steps by exchanging (1-bit) the
  accumulated update, preconditioned back into momentum units. The interval grows from 1 up to
  ``local_step_clipper``, doubling every ``local_step_scaler`` steps (a learning-rate-aware
  policy: tie ``local_step_scaler`` to your LR schedule).

Between synchronisations the ranks' parameters differ (they are local steps); after each
synchronisation they are identical again.

Communication contract: variance-update steps of phase 1 need averaged gradients
(``optimizer.expects_averaged_grads`` says whether the next step is one). With
``average_warmup_grads=True`` (default) this optimizer averages them itself (one fp32
``all_reduce``); a DDP strategy that already averaged them passes ``False`` and must let DDP
allreduce exactly on those steps. All other steps expect *local* gradients.

Differences from DeepSpeed: phase 1 covers steps ``1..var_freeze_step``, as DeepSpeed documents
it (as DeepSpeed runs it, one zero-gradient ``step()`` at construction is counted, so its
variance and synchronisation steps fall on the other parity: variance steps 1, 2, 3, 5, 7, 11,
15 vs 1, 2, 4, 6, 8, 12 here); ``local_step_scaler`` defaults to 32768 (DeepSpeed's
32678 is a typo); at ``W = 1`` the exchanges still compress (DeepSpeed skips them, and at
``W = 1`` never updates the momentum on compressed steps); after a checkpoint load the
intervals and counters continue from the saved values (DeepSpeed resets them to 1 after having
decided the next step's allreduce from the saved interval, so ranks can drift).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from lightning_onebit.comm import NonFiniteError
from lightning_onebit.kernels import LocalSource, local_step, sync_update
from lightning_onebit.optim._base import VARIANCE_FLOOR, OneBitOptimizer
from lightning_onebit.optim._counters import restore, snapshot
from lightning_onebit.optim._ops import (
    adam_step_,
    any_weight_decay,
    decoupled_decay,
    denominator,
    denominator_into,
    finite_on_device,
)
from lightning_onebit.optim._phase import Phase
from lightning_onebit.optim._validation import check_int, deepspeed_arithmetic
from lightning_onebit.optim._variance import (
    bias_correction,
    divergence_hint,
    floor_variance_,
    warn_if_variance_is_young,
)

__all__ = ["ZeroOneAdam"]


class ZeroOneAdam(OneBitOptimizer):
    """0/1 Adam: adaptive variance freezing, 1-bit gradient exchange, then 1-bit local steps.

    Each step ``t`` (counted from 1), with ``g`` the gradient, ``m``/``v`` the moments,
    ``acc`` the momentum accumulator and ``lrs`` the sum of learning rates since the last sync:

    1. Phase 1 (``phase == "variance"``, ``t <= var_freeze_step``):

       a. If ``t % var_interval == 0`` (a variance step, T_v in the paper; every step with
          ``compressed_variance_phase=False``):
          ``g = mean over ranks of g`` in fp32; ``v = beta2 v + (1 - beta2) g**2``;
          ``m = beta1 m + (1 - beta1) g``.
       b. Otherwise: ``g = compressed_allreduce(g_local) * exp_avg_mask``;
          ``m = beta1 m + (1 - beta1) g`` (``v`` unchanged).
       c. ``p -= lr * (m / (sqrt(v) + eps) + weight_decay * p)``.
       d. After each variance step ``var_counter += 1``; every ``var_update_scaler`` of them
          ``var_interval *= 2``.

    2. At the end of step ``var_freeze_step`` (or ``freeze()``): ``v`` freezes; both error
       buffers are zeroed, because from now on they track the accumulator, not gradients.
       ``var_freeze_step=0`` freezes after the first step (DeepSpeed does the same).

    3. Phase 2 (``phase == "local"``):

       a. ``m = beta1 m + (1 - beta1) g_local``;  ``lrs += lr``.
       b. ``u = m / (sqrt(v) + eps) + weight_decay * p``;  ``p -= lr u``;  ``acc -= lr u``.
       c. If ``t % local_step_interval == 0`` (a sync step, T_u in the paper):
          ``p -= acc`` (back to the last synced point);
          ``acc = compressed_allreduce(acc * (sqrt(v) + eps)) * exp_avg_mask``;
          ``m = -acc / lrs``;  ``p += acc / (sqrt(v) + eps)``;  ``acc = 0``;  ``lrs = 0``.
          Where ``variance_floor`` raised ``v`` at the freeze, ``m = 0`` instead (see
          ``_rebuild_momentum_``).

       On a sync step a-c run as one: the exchange's input ``(acc - lr u) * (sqrt(v) + eps)``
       needs only this step's gradient, so it is computed bucket by bucket (and, with
       ``overlap_with_backward()``, during backward); ``p -= lr u`` is skipped (``p`` is
       rebuilt). The synced point is kept in fp32 (``synced_params``) and ``p`` is copied from
       ``synced_params += acc / (sqrt(v) + eps)``, so that every rank gets bitwise the same
       parameters (DeepSpeed subtracts, which is equal only up to rounding and lets the ranks
       drift apart by a few ulps per sync). A NaN/Inf on any rank drops a sync step on every
       rank; on a local step, only the rank that has it sits the step out.
       d. ``local_step_counter += 1``; every ``local_step_scaler`` steps
          ``local_step_interval = min(local_step_clipper, 2 * local_step_interval)``.

    Args:
        params: parameters or param groups. Groups may override ``lr``, ``betas``, ``eps``,
            ``weight_decay`` and may carry an ``exp_avg_mask`` (see
            [`OneBitAdam`][lightning_onebit.optim.OneBitAdam]).
        lr: learning rate.
        var_freeze_step: the last step that may update the variance (max of T_v in the paper);
            usually the end of the learning-rate warmup.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to ``sqrt(v)`` in the denominator.
        weight_decay: decoupled weight decay.
        var_update_scaler: variance updates between doublings of the variance interval
            (kappa in the paper).
        local_step_scaler: steps between doublings of the local step interval in phase 2.
        local_step_clipper: the largest local step interval (H in the paper).
        compressed_variance_phase: the paper's phase 1 (``True``, DeepSpeed's): the steps
            between variance steps exchange a 1-bit gradient (1b). ``False``: every phase-1 step
            is a variance step (1a, full precision), so phase 1 is 1-bit Adam's warmup and only
            phase 2 is compressed (what ``OneBitStrategy`` builds from a torch Adam/AdamW: early
            1-bit gradient steps can knock a model at the edge of stability, such as a small
            BERT at a large lr, out of its basin for good). ``True`` saves those bytes: with
            100k steps and ``var_freeze_step`` 20k phase 1 sends ~160 fp32 gradients, not 20k.
        amsgrad: not supported; ``True`` raises ``ValueError``.
        process_group, average_warmup_grads, average_dtype, variance_window, bias_correction, variance_floor, rescale_variance, hierarchical, ranks_per_node, decoupled_weight_decay, deepspeed_compatible: see
            [`OneBitOptimizer`][lightning_onebit.optim.OneBitOptimizer] (the averaged steps are
            the variance steps, 1a; ``rescale_variance`` applies in phase 2 and all-reduces on
            sync steps).
        preconditioned_exchange: see
            [`OneBitOptimizer`][lightning_onebit.optim.OneBitOptimizer]. With
            ``preconditioned_exchange`` (default) 1b exchanges ``g / (sqrt(v) + eps)`` and 3c the
            accumulator in parameter units (``acc - lr u``); the variance is floored after every
            variance step. ``variance_floor=0, preconditioned_exchange=False`` is DeepSpeed's
            arithmetic.
    """

    PHASES = (Phase.VARIANCE, Phase.LOCAL)
    _flat_states = ("exp_avg", "exp_avg_sq", "momentum_accumulator", "synced_params")
    _switch_states = ("momentum_accumulator", "synced_params")
    #: each tensor's variance floor at its last flooring (the freeze's, in phase 2)
    _scalar_states: ClassVar[dict[str, float]] = {"variance_floor": 0.0}
    _checkpoint_attrs = (
        "var_interval", "var_counter", "local_step_interval", "local_step_counter", "lrs",
    )  # fmt: skip
    _host_counters = (*OneBitOptimizer._host_counters, *_checkpoint_attrs)
    DEVICE_VERDICT = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        var_freeze_step: int = 100000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32768,
        local_step_clipper: int = 16,
        compressed_variance_phase: bool = True,
        amsgrad: bool = False,
        process_group: dist.ProcessGroup | None = None,
        average_warmup_grads: bool = True,
        average_dtype: torch.dtype | str = torch.float32,
        variance_window: float | int | None = None,
        bias_correction: bool = False,
        variance_floor: float = VARIANCE_FLOOR,
        preconditioned_exchange: bool = True,
        rescale_variance: bool = False,
        hierarchical: bool | str = False,
        ranks_per_node: int | None = None,
        decoupled_weight_decay: bool = True,
        deepspeed_compatible: bool = False,
    ) -> None:
        check_int("var_freeze_step", var_freeze_step, 0)
        (compressed_variance_phase,) = deepspeed_arithmetic(
            type(self), deepspeed_compatible, compressed_variance_phase=compressed_variance_phase
        ).values()
        scalers = {"var_update_scaler": var_update_scaler, "local_step_scaler": local_step_scaler}
        self._check_options({**scalers, "local_step_clipper": local_step_clipper})
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(
            params,
            defaults,
            process_group=process_group,
            average_warmup_grads=average_warmup_grads,
            average_dtype=average_dtype,
            variance_window=variance_window,
            amsgrad=amsgrad,
            bias_correction=bias_correction,
            variance_floor=variance_floor,
            preconditioned_exchange=preconditioned_exchange,
            rescale_variance=rescale_variance,
            hierarchical=hierarchical,
            ranks_per_node=ranks_per_node,
            decoupled_weight_decay=decoupled_weight_decay,
            deepspeed_compatible=deepspeed_compatible,
        )
        # hyperparameters
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.compressed_variance_phase = bool(compressed_variance_phase)
        # internal state (checkpointed)
        self.var_interval = 1  # phase 1: variance steps are the multiples of this
        self.var_counter = 0  # variance steps since the last doubling
        self.local_step_interval = 1  # phase 2: sync steps are the multiples of this
        self.local_step_counter = 0  # phase 2 steps since the last doubling
        self._synced = False  # whether the last step synchronised the ranks
        self.lrs: list[float] = [0.0] * len(self.param_groups)  # per group, since the last sync
        self._floored_mask: torch.Tensor | None = None  # see _rebuild_momentum_

    DEEPSPEED_ARITHMETIC: ClassVar[dict[str, Any]] = {
        **OneBitOptimizer.DEEPSPEED_ARITHMETIC,
        "compressed_variance_phase": True,
    }
    OPTIONS = (
        *OneBitOptimizer.OPTIONS, "rescale_variance", "var_update_scaler", "local_step_scaler",
        "local_step_clipper", "compressed_variance_phase",
    )  # fmt: skip

    @classmethod
    def _check_options(cls, o: dict[str, Any]) -> None:
        super()._check_options(o)
        for key in ("var_update_scaler", "local_step_scaler", "local_step_clipper"):
            if key in o:
                check_int(key, o[key], 1)

    def _variance_step(self, t: int) -> bool:
        """Whether phase-1 step ``t`` is a variance step (1a) rather than a 1-bit one (1b)."""
        return not self.compressed_variance_phase or t % self.var_interval == 0

    @property
    def expects_averaged_grads(self) -> bool:
        return self.phase == Phase.VARIANCE and self._variance_step(self.step_count + 1)

    SWITCH_OPTION = "var_freeze_step"

    def _joins_allowed(self) -> bool:
        # a new parameter's variance is 0 until a variance step, and a 1-bit step divides by it
        return self.phase == Phase.VARIANCE and not self.compressed_variance_phase

    @property
    def params_differ_across_ranks(self) -> bool:
        return self.phase == Phase.LOCAL

    @property
    def next_step_syncs(self) -> bool:
        """Whether the next step synchronises the ranks (always in phase 1; sync steps in phase
        2). A local step sends nothing else than, under plain ``torch.distributed``, the ranks'
        agreement on the parameters without a gradient (one byte per parameter tensor)."""
        return self.phase == Phase.VARIANCE or (self.step_count + 1) % self.local_step_interval == 0

    def _params_agree(self) -> bool:
        return self.phase != Phase.LOCAL or self._synced

    def _syncs_local_steps(self) -> bool:
        sync = self.step_count % self.local_step_interval == 0
        return self.phase == Phase.LOCAL and sync and self._local_steps_taken

    def _unsynced(self, idx: list[int]) -> torch.Tensor:
        # the accumulator holds what each parameter moved since the last sync
        views = self.flat.views["momentum_accumulator"]
        return torch.stack(torch._foreach_norm([views[j] for j in idx], math.inf)) > 0

    def _skipped_locally(self) -> None:
        if self.verdict.count_drop(self.max_consecutive_skips):
            raise NonFiniteError(
                f"0/1 Adam: {self.verdict.consecutive} local steps in a row had a non-finite "
                f"gradient on rank {self.flat.exchange.rank}: {divergence_hint(self)}, and resume "
                "from the last checkpoint"
            )
        warnings.warn(
            f"0/1 Adam: non-finite local gradient at step {self.step_count} on rank "
            f"{self.flat.exchange.rank}: this rank skips its local update ({self.skipped_steps} so far)",
            RuntimeWarning,
            stacklevel=4,
        )

    def _overlappable(self) -> bool:
        t = self.step_count + 1
        if self.phase == Phase.VARIANCE:
            return not self._variance_step(t)  # 1b
        return t % self.local_step_interval == 0  # 3c

    def _exchange_source(self, s: slice) -> torch.Tensor | LocalSource:
        """What the next step exchanges, for the flat slice ``s``: 1b the gradient itself
        (gathered into the flat gradient buffer); 3c ``(acc - lr u) * (sqrt(v) + eps) =
        acc * d - lr * (m_new + weight_decay * p * d)`` with ``m_new = beta1 m + (1 - beta1) g``
        (m and acc change after the exchange), a
        [`LocalSource`][lightning_onebit.kernels.sources.LocalSource] that reads each gradient where
        autograd left it (``FlatState.grads``) and each parameter where it lies
        (``FlatState.params``), and that the exchange computes as it compresses it where it can.
        With ``preconditioned_exchange`` both are divided by ``d = sqrt(v) + eps``: 1b ``g / d``, 3c
        ``acc - lr u`` (parameter units)."""
        flat, groups = self.flat, self.param_groups
        pre = self.preconditioned_exchange
        idx = flat.params_in(s)
        if self.phase == Phase.VARIANCE:
            flat.gather_grads(groups, idx)
            if not pre:
                return flat.grad[s]
            # sqrt(v) + eps of the current v, into the buffer the quotient goes to
            u = denominator_into(flat, groups, self.rescale.scales(flat), flat.work["update"], idx)
            u = u[s]
            return torch.div(flat.grad[s], u, out=u)
        return LocalSource(
            exp_avg=flat.states["exp_avg"],
            grad=flat.grads(groups, idx),
            denom=denominator(flat, groups, self.rescale.scales(flat), idx),
            param=flat.params(idx) if any_weight_decay(flat, groups) else None,
            acc=self._acc if self._local_steps_taken else None,
            out=functools.partial(flat.scratch, "update"),  # made only if materialized
            starts=[flat.layout.offsets[j] for j in idx],
            sizes=[flat.layout.params[j].numel() for j in idx],
            preconditioned=pre,
            **self._local_coefficients(idx),
        )

    def _local_coefficients(self, idx: list[int]) -> dict[str, list[float]]:
        """Per parameter of ``idx`` (layout indices) its group's ``beta1``, ``1 - beta1``,
        ``lr`` and decoupled weight decay: the coefficients of ``local_source``/``local_step``,
        by their argument names."""
        of = [self.param_groups[self.flat.layout.group_of[j]] for j in idx]
        betas = [group["betas"][0] for group in of]
        alphas = [1 - b for b in betas]
        lrs, decays = [group["lr"] for group in of], [decoupled_decay(group) for group in of]
        return {"beta": betas, "alpha": alphas, "lr": lrs, "weight_decay": decays}

    @property
    def _acc(self) -> torch.Tensor:
        return self.flat.states["momentum_accumulator"]

    @property
    def _local_steps_taken(self) -> bool:
        """Whether acc != 0: a local step was taken since the last sync (with
        ``local_step_interval`` 1, never: then acc is neither read nor cleared)."""
        return any(lr != 0 for lr in self.lrs)

    def _on_layout(self) -> None:
        self.lrs = list(self.lrs) + [0.0] * (len(self.param_groups) - len(self.lrs))
        self._floored_mask = None

    def _on_freeze(self) -> None:
        self._floored_mask = None
        # 2. the error buffers held gradient residuals; from now on they hold accumulator ones
        self.flat.exchange.reset_error()
        self.flat.states["synced_params"].copy_(self.flat.gather_params())

    def _synchronize_(self, source: Any, this_step: bool) -> None:
        """3c: exchange ``source`` (the accumulated local steps, and this step's when
        ``this_step``), rebuild the momentum from it and move every rank to the same point."""
        m, acc = self.flat.states["exp_avg"], self._acc
        # u: the averaged acc, masked (on the CPU where it lies, read by sync_update as it is)
        ok, u = self._compressed_average(source, "update")
        if ok is not None:  # CUDA: the verdict on the device; state changes only where it is true
            self._synchronize_on_verdict_(ok, u, this_step)
            return
        taken = self._local_steps_taken  # acc is consumed by the exchange: zeroed below
        self._add_this_step_lr(this_step)
        # m = -acc / lrs (acc in momentum units: u * (sqrt(v) + eps) when it was exchanged in
        # parameter units), 0 where v was floored (see _rebuild_momentum_); p = last synced point
        # + acc / (sqrt(v) + eps), computed on the synced copy (bitwise the same on every rank,
        # unlike p - acc + ...) and copied into p; acc = 0. One sweep (the torch ops' floats bit
        # for bit on the CPU and on CUDA).
        flat, layout = self.flat, self.flat.layout
        sync_update(
            exchanged=u,
            denom=denominator(flat, self.param_groups, self.rescale.scales(flat)),
            exp_avg=m,
            synced=self.flat.states["synced_params"],
            floored=self._floored(),
            acc=acc if taken else None,
            params=layout.params,
            starts=layout.offsets,
            lrs=[self.lrs[gi] for gi in layout.group_of],
            preconditioned=self.preconditioned_exchange,
        )
        self.lrs = [0.0] * len(self.lrs)

    def _synchronize_on_verdict_(self, ok: torch.Tensor, u: torch.Tensor, this_step: bool) -> None:
        """``_synchronize_`` after an exchange whose verdict ``ok`` stayed on the device
        (``u``: its result, masked): the same values computed aside and kept with
        ``torch.where`` (a dropped step leaves acc, m, the synced copy and the parameters as
        they were), no host synchronisation."""
        flat, groups = self.flat, self.param_groups
        m, acc, synced = flat.states["exp_avg"], self._acc, flat.states["synced_params"]
        if self._local_steps_taken:
            acc.masked_fill_(ok, 0.0)
        # d = sqrt(v) + eps computed into one of the step's temporaries (no buffer of it is held)
        d = denominator_into(flat, groups, self.rescale.scales(flat), torch.empty_like(u))
        if self.preconditioned_exchange:  # u = the synced step (parameter units)
            moment = d.mul_(u)
            new_synced = torch.add(synced, u)
        else:
            moment, new_synced = u.clone(), d
            torch.addcdiv(synced, u, new_synced, out=new_synced)
        self._rebuild_momentum_(moment, this_step, out=moment)
        torch.where(ok, moment, m, out=m)
        torch.where(ok, new_synced, synced, out=synced)
        for p, view in zip(self.flat.layout.params, self.flat.views["synced_params"], strict=True):
            if p.dtype == view.dtype and p.is_contiguous():
                torch.where(ok, view, p, out=p)
            else:
                p.copy_(torch.where(ok, view, p))
        self.lrs = [0.0] * len(self.lrs)

    def _rebuild_momentum_(
        self, u: torch.Tensor, this_step: bool, out: torch.Tensor | None = None
    ) -> None:
        """``m = -u / lrs`` (``u`` the averaged accumulator in momentum units), except on the
        coordinates whose variance was floored at the freeze, where ``m = 0``.

        Why: a floored coordinate has (next to) no gradient, but 1 bit cannot send a zero, so
        its averaged accumulator is ``+-scale``. Error feedback takes that back at a later sync,
        but a momentum rebuilt from it would keep pushing the same way for ~``1/(1 - beta1)``
        local steps, and those steps are real updates that no error buffer remembers. With
        ``m = 0`` they only move by the exchange's own, error-compensated noise. A floored
        coordinate that gets gradients later (a rare embedding row) still trains: its local
        steps build momentum afresh from its own gradients after every sync.
        ``variance_floor=0`` keeps DeepSpeed's rebuild. ``out``: where to write it (default: m)."""
        m = self.flat.states["exp_avg"] if out is None else out
        self._add_this_step_lr(this_step)
        for gi, _, s in self.flat.segments(self.param_groups):
            if self.lrs[gi] > 0:
                torch.div(u[s], -self.lrs[gi], out=m[s])
            else:  # lr == 0 since the last sync: no step was taken
                m[s].zero_()
        floored = self._floored()
        if floored is not None:
            m.masked_fill_(floored, 0.0)

    def _add_this_step_lr(self, this_step: bool) -> None:
        """``lrs += lr`` per group when the sync step takes this step's local step too."""
        if this_step:
            for gi, group, _ in self.flat.segments(self.param_groups):
                self.lrs[gi] += group["lr"]

    def _floored(self) -> torch.Tensor | None:
        """Where the variance was floored at the freeze (``v <= its tensor's floor``; cached:
        ``v`` is frozen, recomputed once per freeze or layout), or ``None`` with
        ``variance_floor=0``."""
        if self.variance_floor <= 0:
            return None
        if self._floored_mask is None:
            floors = torch.repeat_interleave(
                self.flat.scalars["variance_floor"],
                self.flat.layout.sizes,
                output_size=self.flat.layout.numel,
            )
            self._floored_mask = self.flat.states["exp_avg_sq"] <= floors
        return self._floored_mask

    @torch.no_grad()
    def synchronize(self) -> None:
        """Bring every rank to the same parameters now, between two synchronisation steps of
        the local phase: the local steps taken since the last one are exchanged and applied as
        a synchronisation step would (3c, without a new gradient). Not a step: the counters and
        intervals go on unchanged. Collective; nothing happens outside the local phase or right
        after a synchronisation. ``OneBitStrategy`` calls it at the end of ``fit``."""
        if self.phase != Phase.LOCAL or not self._local_steps_taken:
            return
        flat, acc, source = self.flat, self._acc, self._acc
        if not self.preconditioned_exchange:  # acc * (sqrt(v) + eps), d computed into x first
            x, r = flat.work["update"], self.rescale.scales(flat)
            source = denominator_into(flat, self.param_groups, r, x).mul_(acc)
        self.counters.start_step()
        counters = snapshot(self, self._host_counters)
        self.verdict.start_step()
        try:
            self._synchronize_(source, this_step=False)
            self.verdict.read_on_host(self.step_count)  # not a step: said now, a host read
        except NonFiniteError:
            restore(self, counters)
            raise
        finally:
            self.verdict.start_step()
        self.counters.end_between_steps()

    def _local_step_on_verdict_(self, g: torch.Tensor) -> None:
        """3a-b of a local step whose gradient's verdict stays on the device (CUDA): the same
        values computed aside and kept where it is true (else this rank sits the step out, as
        on the host: its lr still counts)."""
        finite = finite_on_device(g)
        ok = self.verdict.hold_on_device(finite, finite, "local")
        flat, groups = self.flat, self.param_groups
        m, acc, u = flat.states["exp_avg"], self._acc, flat.work["update"]
        self._add_this_step_lr(True)
        # d = sqrt(v) + eps, into u: each value is divided in place
        denominator_into(flat, groups, self.rescale.scales(flat), u)
        p = flat.gather_params() if any_weight_decay(flat, groups) else None
        for _, group, s in self.flat.segments(self.param_groups):
            beta1 = group["betas"][0]
            m_new = torch.mul(m[s], beta1).add_(g[s], alpha=1 - beta1)
            torch.div(m_new, u[s], out=u[s])
            if decoupled_decay(group) > 0:
                u[s].add_(p[s], alpha=decoupled_decay(group))
            torch.where(ok, m_new, m[s], out=m[s])
            torch.where(ok, torch.add(acc[s], u[s], alpha=-group["lr"]), acc[s], out=acc[s])
        u.masked_fill_(ok.logical_not(), 0.0)  # p - lr * 0 = p
        self.flat.add_to_params_(self.param_groups, u, alpha=[-g["lr"] for g in self.param_groups])
        self.rescale.accumulate_(self.flat, self.param_groups, self.flat.views["grad"], False, ok)

    def _step(self) -> None:
        m, t = self.flat.states["exp_avg"], self.step_count

        if self.phase == Phase.VARIANCE:
            variance_step = self._variance_step(t)
            # ok: on CUDA the step's verdict, on the device: its writes take it
            if variance_step:
                # 1a. variance step: full-precision gradient (averaged before the step, or
                #     W = 1: each read where autograd left it, no flat copy), both moments
                g, ok = self._averaged_grads()
                self.rescale.warmup_(self.flat, g, ok)  # rescale_variance: the gradients' scale
            else:
                # 1b. 1-bit averaged gradient (in the flat gradient buffer), momentum only
                g = self.flat.gather_grads(self.param_groups)
                ok = self._compressed_average_into(self._exchange_source, out=g)
                if self.preconditioned_exchange:  # it was exchanged as g / (sqrt(v) + eps)
                    # (d into the exchange's source buffer, free again now)
                    r, x = self.rescale.scales(self.flat), self.flat.work["update"]
                    g.mul_(denominator_into(self.flat, self.param_groups, r, x))
                self.flat.apply_mask_(self.param_groups, g)
                warn_if_variance_is_young(self)
            # 1a/b moments + 1c. Adam update, one fused sweep
            if variance_step:
                self.variance_updates += 1
            bias = bias_correction(self) if self.bias_correction else None
            adam_step_(self.flat, self.param_groups, bias, g, update_variance=variance_step, ok=ok)
            if variance_step:
                # the next 1-bit gradient steps are preconditioned by this variance
                f, to_mean = self.variance_floor, self.FLOOR_TO_MEAN
                self.floored = floor_variance_(
                    self.flat, self.param_groups, f, to_mean=to_mean, ok=ok
                )
                # 1d. the variance interval doubles every var_update_scaler variance steps
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter = 0
                    self.var_interval *= 2
            if t >= self.var_freeze_step:
                # the switch needs the verdict: read on the host, once
                self.verdict.read_on_host(self.step_count)
                self.freeze()  # 2.
            return

        self._synced = t % self.local_step_interval == 0
        if self._synced:
            # 3a-c. a sync step: its local step goes straight into the exchange
            #       (_exchange_source; started during backward with overlap_with_backward()).
            #       A NaN/Inf on any rank drops the step on every rank, as in the other phases.
            self._synchronize_(self._exchange_source, this_step=True)
            # the local steps' sums with this one
            if self.rescale_variance:
                idx = list(range(len(self.flat.layout.params)))
                grads = self.flat.grads(self.param_groups, idx)
                self.rescale.accumulate_(self.flat, self.param_groups, grads, True, self.verdict.ok)
        else:
            # 3a. local momentum. A local step sends nothing, so a non-finite gradient is known to
            #     its rank alone: that rank sits the step out (its lr still counts, so that every
            #     rank derives the same m at the next synchronisation).
            if self.verdict.uses_device(self.flat.layout.device):  # learnt at the next step
                self._local_step_on_verdict_(self.flat.gather_grads(self.param_groups))
                self._next_local_interval()
                return
            # 3a-b. m = beta1 m + (1 - beta1) g; u = m / (sqrt(v) + eps) + weight_decay * p;
            #       p -= lr u; acc -= lr u: one sweep, taken only if g is finite (each gradient
            #       read where autograd left it)
            layout, groups = self.flat.layout, self.param_groups
            idx = list(range(len(layout.params)))
            grads = self.flat.grads(groups, idx)
            d = denominator(self.flat, groups, self.rescale.scales(self.flat))
            local_ok = local_step(exp_avg=m, grad=grads, denom=d, acc=self._acc, params=layout.params,
                                  starts=layout.offsets, **self._local_coefficients(idx))  # fmt: skip
            if not local_ok:
                self._skipped_locally()
            self._add_this_step_lr(True)
            self.rescale.accumulate_(self.flat, groups, grads if local_ok else None, reduce=False)
        self._next_local_interval()

    def _next_local_interval(self) -> None:
        # 3d. the local step interval doubles every local_step_scaler steps
        self.local_step_counter += 1
        if self.local_step_counter >= self.local_step_scaler:  # >=: a scaler lowered mid-run
            self.local_step_counter = 0
            self.local_step_interval = min(self.local_step_clipper, 2 * self.local_step_interval)
