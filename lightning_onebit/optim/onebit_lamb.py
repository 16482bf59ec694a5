"""1-bit LAMB (Li et al., 2021, https://arxiv.org/abs/2104.06069), as DeepSpeed runs it.

LAMB scales each layer's Adam update by a trust ratio ``||p|| / ||u||``. Under 1-bit
compression that ratio cannot be computed from the compressed momentum (its norm is
distorted), so 1-bit LAMB:

* runs plain LAMB for ``freeze_step`` steps and keeps an exponential moving average of each
  layer's (clamped) trust ratio, ``lamb_coeff_freeze``;
* then freezes the variance ``v`` and the ratio, and exchanges the momentum with 1-bit
  compression, like 1-bit Adam;
* corrects the frozen ratio by how LAMB's own ratio ``||p|| / ||u||`` of each 1-bit update
  moved since the first one (``trust_ratio="update_norm"``), or, as DeepSpeed does, with a
  *fresh variance* ``v_fresh``, tracked from gradients reconstructed from successive compressed
  momenta: ``factor = max((sqrt(v) + eps) / (sqrt(v_fresh) + eps))`` per layer; either factor
  clipped in how fast it may change;
* multiplies each layer's momentum by a ``scaling_coeff`` before compression so that all layers
  have similar magnitudes: the whole model shares one 1-bit scale, and without this the large
  layers would drown the small ones.

All momenta live in one flat buffer and are exchanged in one compressed allreduce per step.

Communication contract: warmup steps need averaged gradients. With ``average_warmup_grads=True``
(default) this optimizer averages them itself (one fp32 ``all_reduce``); a DDP strategy that
already averaged them passes ``False``. Compression steps expect *local* gradients.

Differences from DeepSpeed (besides the options ``deepspeed_compatible=True`` sets, among them
``trust_ratio="fresh_variance"``): at ``W = 1`` the exchange still compresses (DeepSpeed skips it);
a layer whose momentum is exactly zero when the scaling coefficients are computed gets
``scaling_coeff = 1`` (DeepSpeed divides by zero); ``lamb_coeff_freeze`` is updated only when
both norms are non-zero (DeepSpeed: when the clamped ratio differs from 1.0, meant as the same);
checkpoints keep the frozen coefficients and the error buffers (DeepSpeed drops the errors, and
resets the coefficients when reloading inside warmup).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from lightning_onebit.kernels import MomentumSource, lamb_frozen_update, layer_step, on_device
from lightning_onebit.optim._base import VARIANCE_FLOOR, OneBitOptimizer
from lightning_onebit.optim._ops import (
    adam_direction,
    any_weight_decay,
    decoupled_decay,
    denominator,
    fp32_param,
    update_norm_cap,
)
from lightning_onebit.optim._phase import Phase
from lightning_onebit.optim._validation import check_int, check_real, deepspeed_arithmetic
from lightning_onebit.optim._variance import bias_correction

__all__ = ["OneBitLamb"]


class OneBitLamb(OneBitOptimizer):
    """1-bit LAMB: LAMB warmup, then frozen trust ratios corrected by a factor per layer.

    Per layer (parameter) ``k``, with ``g`` the gradient, ``m``/``v`` the moments:

    1. Warmup (``phase == "warmup"``, the first ``freeze_step`` steps):

       a. ``g = mean over ranks of g`` (fp32 allreduce; see ``average_warmup_grads``).
       b. ``m = beta1 m + (1 - beta1) g``;  ``v = beta2 v + (1 - beta2) g**2``.
       c. ``u = m / (sqrt(v) + eps) + weight_decay * p``.
       d. ``coeff_k = clamp(||p_k|| / ||u_k||, min_coeff, max_coeff)`` (1 if a norm is 0);
          ``lamb_coeff_freeze_k = coeff_beta * lamb_coeff_freeze_k + (1 - coeff_beta) * coeff_k``.
       e. ``p_k -= lr * coeff_k * u_k``.

    2. At the end of step ``freeze_step`` (or ``freeze()``): ``v_fresh = v``; ``v`` freezes.

    3. Compression (``phase == "compression"``):

       a. First compression step only: ``scaling_coeff_k = mean_j(rms(m_j)) / rms(m_k)``.
       b. ``m_last = m``;  ``m_k = (beta1 m_k + (1 - beta1) g_local,k) * scaling_coeff_k``.
       c. ``m = compressed_allreduce(m)`` (one flat exchange for all layers);
          ``m_k /= scaling_coeff_k``;  ``m *= exp_avg_mask``.
       d. ``g_rec = (m - beta1 m_last) / (1 - beta1)``;
          ``v_fresh = beta2 v_fresh + (1 - beta2) g_rec**2``.
       e. ``u_prelim = m / (sqrt(v) + eps)``;  ``u = u_prelim + weight_decay * p``.
       f. ``factor_k = max((sqrt(v_k) + eps) / (sqrt(v_fresh,k) + eps))``; with weight decay,
          ``r = min(1, ||u_prelim_k|| / ||u_k||)`` and ``factor_k = r factor_k + 1 - r``;
          clip to ``[factor_min, factor_max]`` and to
          ``last_factor_k * [1 - factor_threshold, 1 + factor_threshold]``;
          ``last_factor_k = factor_k``.
          With ``trust_ratio="update_norm"`` then (not limited in speed): ``r_k = ||p_k|| /
          ||u_k||`` (LAMB's ratio of this step's update), ``ratio_ref_k = r_k`` at the first
          compression step, ``factor_k = min(factor_k, factor_max * r_k / ratio_ref_k)``.
       g. ``p_k -= lr * lamb_coeff_freeze_k * factor_k * u_k``.

    Args:
        params: parameters or param groups. Groups may override ``lr``, ``betas``, ``eps``,
            ``weight_decay``, ``max_coeff``, ``min_coeff`` and may carry an ``exp_avg_mask``
            (see [`OneBitAdam`][lightning_onebit.optim.OneBitAdam]).
        lr: learning rate.
        freeze_step: number of warmup (uncompressed LAMB) steps (at least one runs). Keep
            ``1 / (1 - coeff_beta) <= freeze_step`` so that the frozen ratios have warmed up.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to ``sqrt(v)`` in the denominator.
        weight_decay: decoupled weight decay.
        max_coeff: upper bound of the trust ratio in warmup.
        min_coeff: lower bound of the trust ratio in warmup.
        coeff_beta: coefficient of the moving average of the trust ratio in warmup.
        factor_max: upper bound of the fresh-variance factor.
        factor_min: lower bound of the fresh-variance factor.
        factor_threshold: how much the factor may change from one step to the next (relative).
        trust_ratio: what bounds the frozen trust ratios' correction in the compression phase
            (3f). ``"fresh_variance"`` (DeepSpeed's): the largest ``(sqrt(v) + eps) /
            (sqrt(v_fresh) + eps)`` of the layer, which stays near 1 while any coordinate's fresh
            variance is below its frozen one, so a layer whose updates grow (whose ratio LAMB
            would lower) takes ever larger steps. ``"update_norm"`` (default): the same factor,
            but never more than ``factor_max`` times LAMB's ratio ``||p|| / ||u||`` of the step
            relative to that of the first compression step, so that no layer's step grows past
            ``factor_max`` times the size relative to ``||p||`` it had at the switch (LAMB keeps
            it).
        amsgrad: not supported; ``True`` raises ``ValueError``.
        process_group: the group to average over; ``None`` is the default group, and without an
            initialised process group the optimizer runs with ``W = 1``.
        average_warmup_grads: average the gradients of warmup steps here (one fp32
            ``all_reduce``); pass ``False`` when DDP already averaged them.
        average_dtype: ``torch.float32`` (default), or ``torch.bfloat16``/``torch.float16``
            (``"bf16"``/``"fp16"``) to average the warmup steps' gradients in half the bytes,
            as DDP's bf16/fp16 compress hooks (the frozen variance loses some precision), or
            ``torch.int4``/``torch.int8``: integer codes with error feedback (see
            [`OneBitOptimizer`][lightning_onebit.optim.OneBitOptimizer]).
        variance_window: see [`OneBitOptimizer`][lightning_onebit.optim.OneBitOptimizer].
        bias_correction, variance_floor, preconditioned_exchange: see
            [`OneBitOptimizer`][lightning_onebit.optim.OneBitOptimizer] (with bias correction, 1c
            uses the bias-corrected moments; the trust ratio is invariant to their scale except
            through its clamps and ``eps``). With ``preconditioned_exchange`` 3a and 3b work on ``m
            / (sqrt(v) + eps)``, and 3c multiplies the result back by ``sqrt(v) + eps``: off by
            default (it keeps attention weights closer to DDP's, but costs loss on the demo GPT).
            ``variance_floor=0`` is DeepSpeed's arithmetic. A coordinate the floor catches is raised
            to the mean variance of its tensor (or group), not to ``variance_floor**2`` of it as in
            the Adam variants: this exchange carries ``m`` itself, so a caught coordinate's 1-bit
            noise (``+-scale``, no signal) is divided by its own ``sqrt(v)``, and at 1% of the
            typical ``sqrt(v)`` it would move 100x a typical coordinate's noise (unused embedding
            rows, dead ReLU biases). At the mean, its noise is a typical coordinate's, and a
            coordinate that gets gradients later steps like one.
        hierarchical, ranks_per_node: the two-level exchange on several nodes (full precision
            inside a node, 1 bit between nodes); see
            [`node_groups`][lightning_onebit.optim.OneBitOptimizer.node_groups].
        decoupled_weight_decay: ``True`` (default): ``weight_decay`` is decoupled, AdamW's
            ``p -= lr * wd * p``. ``False``: torch Adam's L2 term, ``g += wd * p`` before the
            moments (after ``maximize``). Also a param-group key, as in torch's Adam.
        deepspeed_compatible: ``True``: DeepSpeed's arithmetic (its optimizer's results for the
            same arguments); see [`OneBitOptimizer`][lightning_onebit.optim.OneBitOptimizer].
    """

    PHASES = (Phase.WARMUP, Phase.COMPRESSION)
    FLOOR_TO_MEAN = True  # see variance_floor above
    _flat_states = ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh")
    _switch_states = ("exp_avg_sq_fresh",)
    _scalar_states: ClassVar[dict[str, float]] = {
        "lamb_coeff_freeze": 0.0,
        "last_factor": 1.0,
        "scaling_coeff": 1.0,
    }
    DEEPSPEED_ARITHMETIC: ClassVar[dict[str, Any]] = {
        **OneBitOptimizer.DEEPSPEED_ARITHMETIC,
        "trust_ratio": "fresh_variance",
    }
    TRUST_RATIOS = ("fresh_variance", "update_norm")
    _checkpoint_attrs = ("scaling_coeff_ready",)
    _host_counters = (*OneBitOptimizer._host_counters, "_seed_coeffs")
    _work_buffers = ("update", "exchanged")

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        trust_ratio: str = "update_norm",
        amsgrad: bool = False,
        process_group: dist.ProcessGroup | None = None,
        average_warmup_grads: bool = True,
        average_dtype: torch.dtype | str = torch.float32,
        variance_window: float | int | None = None,
        bias_correction: bool = False,
        variance_floor: float = VARIANCE_FLOOR,
        preconditioned_exchange: bool = False,
        hierarchical: bool | str = False,
        ranks_per_node: int | None = None,
        decoupled_weight_decay: bool = True,
        deepspeed_compatible: bool = False,
    ) -> None:
        check_int("freeze_step", freeze_step, 0)
        (trust_ratio,) = deepspeed_arithmetic(
            type(self), deepspeed_compatible, trust_ratio=trust_ratio
        ).values()
        self._check_options(
            {
                "coeff_beta": coeff_beta,
                "factor_min": factor_min,
                "factor_max": factor_max,
                "factor_threshold": factor_threshold,
                "trust_ratio": trust_ratio,
            }
        )
        if trust_ratio == "update_norm":  # its reference ratios (0 until the first 1-bit step)
            self._scalar_states = {**self._scalar_states, "ratio_ref": 0.0}
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
        }
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
            hierarchical=hierarchical,
            ranks_per_node=ranks_per_node,
            decoupled_weight_decay=decoupled_weight_decay,
            deepspeed_compatible=deepspeed_compatible,
        )
        # hyperparameters
        self.freeze_step = freeze_step
        self.coeff_beta = coeff_beta
        self.factor_max = factor_max
        self.factor_min = factor_min
        self.factor_threshold = factor_threshold
        self.trust_ratio = trust_ratio
        # internal state (checkpointed; per-layer coefficients are in optimizer.state[p])
        self.scaling_coeff_ready = False  # computed at the first compression step
        # loaded from another optimizer (torch's Adam): no trust-ratio history to average, so
        # the first warmup step starts lamb_coeff_freeze at its ratio (not 0.1 of it)
        self._seed_coeffs = False
        self._coeffs: torch.Tensor | None = None  # the last step's effective trust ratios
        # device copies of per-layer hyperparameters and a host copy of scaling_coeff, kept
        # while their values stay the same: no host synchronisation inside a step on CUDA
        self._per_layer_cache: dict[str, tuple[list[float], Any, torch.Tensor]] = {}
        self._scaling_cache: tuple[torch.Tensor, list[float]] | None = None

    OPTIONS = (
        *OneBitOptimizer.OPTIONS,
        "max_coeff",
        "min_coeff",
        "coeff_beta",
        "factor_max",
        "factor_min",
        "factor_threshold",
        "trust_ratio",
    )

    @classmethod
    def _check_options(cls, o: dict[str, Any]) -> None:
        super()._check_options(o)
        if "coeff_beta" in o:
            check_real("coeff_beta", o["coeff_beta"], 0.0, 1.0, high_open=True)
        # the factor starts at 1 (no correction): factor_min <= 1 <= factor_max
        if "factor_min" in o:
            check_real(
                "factor_min",
                o["factor_min"],
                0.0,
                1.0,
                low_open=True,
                hint="factor_min <= 1 <= factor_max",
            )
        if "factor_max" in o:
            check_real(
                "factor_max", o["factor_max"], 1.0, math.inf, hint="factor_min <= 1 <= factor_max"
            )
        if "factor_threshold" in o:
            check_real("factor_threshold", o["factor_threshold"], 0.0, math.inf)
        if "trust_ratio" in o and o["trust_ratio"] not in cls.TRUST_RATIOS:
            raise ValueError(
                f"trust_ratio must be one of {list(cls.TRUST_RATIOS)}, got {o['trust_ratio']!r}"
            )
        if "max_coeff" in o and "min_coeff" in o:  # also per param group: _check_hparams
            OneBitLamb._check_coeffs(o["max_coeff"], o["min_coeff"])

    @staticmethod
    def _check_coeffs(max_coeff: Any, min_coeff: Any) -> None:
        check_real("max_coeff", max_coeff, 0.0, math.inf, low_open=True)
        check_real(
            "min_coeff",
            min_coeff,
            0.0,
            max_coeff,
            low_open=True,
            hint=f"min_coeff <= max_coeff={max_coeff}",
        )

    @staticmethod
    def _check_hparams(h: dict[str, Any]) -> None:
        OneBitOptimizer._check_hparams(h)
        OneBitLamb._check_coeffs(h["max_coeff"], h["min_coeff"])

    @property
    def lamb_coeffs(self) -> list[float]:
        """The effective per-layer trust ratios of the last step (read from the device: on CUDA
        this waits for the step)."""
        return [] if self._coeffs is None else self._coeffs.tolist()

    def get_lamb_coeffs(self) -> list[float]:
        """The effective per-layer trust ratios of the last step (DeepSpeed's name)."""
        return self.lamb_coeffs

    def _scaling_values(self) -> list[float]:
        """``scaling_coeff`` as Python floats (they scale the exchanged momentum layer by layer):
        read from the device once per value it takes (at the freeze or a checkpoint load), not
        on every step. The cache holds the tensor: a load builds new buffers, and the freeze,
        which writes it in place, drops the cache."""
        t = self.flat.scalars["scaling_coeff"]
        cache = self._scaling_cache
        if cache is None or cache[0] is not t:
            cache = self._scaling_cache = (t, t.tolist())
        return cache[1]

    def _on_foreign_load(self) -> None:
        self._seed_coeffs = True

    def _ready_to_switch(self) -> bool:
        return not self._seed_coeffs  # one warmup step measures the trust ratios first

    def _on_freeze(self) -> None:
        # 2. the fresh variance starts from the frozen one
        self.flat.states["exp_avg_sq_fresh"].copy_(self.flat.states["exp_avg_sq"])
        # 3a. (computed now: m is what the first compression step starts from)
        self._compute_scaling()

    def _compute_scaling(self) -> None:
        """3a. per-layer scaling so that one 1-bit scale fits every layer (of what is exchanged:
        ``m``, or ``m / (sqrt(v) + eps)`` with ``preconditioned_exchange``)."""
        m = self.flat.views["exp_avg"]
        if self.preconditioned_exchange:  # d layer by layer (no buffer of it is held)
            flat = self.flat
            d = denominator(flat, self.param_groups, self.rescale.scales(flat))
            offsets = flat.layout.offsets
            m = [mk / d.segment(k, offsets[k], mk.numel()).view_as(mk) for k, mk in enumerate(m)]
        rms = torch.stack([mk.norm() / math.sqrt(max(mk.numel(), 1)) for mk in m])
        scaling = self.flat.scalars["scaling_coeff"]
        scaling.copy_(torch.where(rms > 0, rms.mean() / rms, 1.0))
        self.scaling_coeff_ready = True
        self._scaling_cache = None  # written in place: read it again now, in the switch step
        self._scaling_values()

    DEVICE_VERDICT = True

    def _overlappable(self) -> bool:
        return self.phase == Phase.COMPRESSION and self.scaling_coeff_ready

    def _exchange_source(self, s: slice) -> MomentumSource:
        """3b for the flat slice ``s`` (whole layers): ``u = (beta1 m + (1 - beta1) g) * scaling``
        (the scaling folded into the coefficients), divided by ``sqrt(v) + eps`` with
        ``preconditioned_exchange``: computed by the exchange as it compresses it where it can
        ([`MomentumSource`][lightning_onebit.kernels.sources.MomentumSource]: one sweep that reads
        each gradient where autograd left it, ``FlatState.grads``), else into scratch."""
        flat, scaling = self.flat, self._scaling_values()
        idx = flat.params_in(s)
        beta, alpha = [], []
        for j in idx:
            beta1, c = self.param_groups[flat.layout.group_of[j]]["betas"][0], scaling[j]
            beta.append(beta1 * c)
            alpha.append((1 - beta1) * c)
        d = None
        if self.preconditioned_exchange:
            d = denominator(flat, self.param_groups, self.rescale.scales(flat), idx)
        return MomentumSource(
            flat.states["exp_avg"],
            flat.grads(self.param_groups, idx),
            d,
            functools.partial(flat.scratch, "update"),  # made only if materialized
            [flat.layout.offsets[j] for j in idx],
            [flat.layout.params[j].numel() for j in idx],
            beta,
            alpha,
        )

    def _per_layer_values(self, key: str) -> list[float]:
        """A group hyperparameter, one value per layer (``beta1``/``beta2``: from ``betas``)."""
        groups, of = self.param_groups, self.flat.layout.group_of
        if key in ("beta1", "beta2"):
            return [groups[gi]["betas"][int(key[-1]) - 1] for gi in of]
        if key == "weight_decay":  # the decoupled part: an L2 term is in the gradient
            return [decoupled_decay(groups[gi]) for gi in of]
        return [groups[gi][key] for gi in of]

    def _per_layer(self, key: str) -> torch.Tensor:
        """A group hyperparameter broadcast to one value per layer, as a tensor on the layout's
        device, copied without a host synchronisation and only when its values (or, on CUDA,
        the current stream: the copy is ordered on the stream it was made on) change."""
        values = self._per_layer_values(key)
        device = self.flat.layout.device
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        cached = self._per_layer_cache.get(key)
        if cached is None or cached[:2] != (values, stream):  # a stream names its device
            t = (
                torch.tensor(values, dtype=torch.float32)
                if stream is None
                else on_device(values, torch.float32, device)
            )
            cached = self._per_layer_cache[key] = (values, stream, t)
        return cached[2]

    def _step(self) -> None:
        m = self.flat.states["exp_avg"]
        lamb_coeff_freeze = self.flat.scalars["lamb_coeff_freeze"]
        last_factor = self.flat.scalars["last_factor"]
        scaling = self.flat.scalars["scaling_coeff"]

        if self.phase == Phase.WARMUP:
            # 1a. full-precision average of the gradients (averaged before the step, or W = 1:
            #     each read where autograd left it, no flat copy; ok: its verdict, on CUDA on
            #     the device: the moments and the parameters change only where it is true)
            grads, ok = self._averaged_grads()
            # 1b. moments
            self.variance_updates += 1
            self._warmup_moments_(grads, ok)
            # 1c. Adam direction with decoupled weight decay, u = m / (sqrt(v) + eps) + wd * p,
            #     layer by layer into scratch of the largest layer's size (no flat buffer of u,
            #     and p read where it lies)
            bias = bias_correction(self) if self.bias_correction else None
            direction = adam_direction(self.flat, self.param_groups, bias)
            layout = self.flat.layout
            scratch = torch.empty(max(p.numel() for p in layout.params), device=layout.device)
            # 1d. trust ratio per layer, and its moving average
            p_norm, u_norm = self._warmup_norms(direction, scratch)
            defined = (p_norm > 0) & (u_norm > 0)
            coeff = (p_norm / u_norm).clamp_(self._per_layer("min_coeff"))
            coeff = torch.where(defined, coeff.minimum(self._per_layer("max_coeff")), 1.0)
            beta = 0.0 if self._seed_coeffs else self.coeff_beta
            self._seed_coeffs = False
            ema = lamb_coeff_freeze * beta + coeff * (1 - beta)
            if ok is not None:
                defined = defined & ok
                coeff = torch.where(ok, coeff, 0.0)  # u is finite: p + 0 * u = p
            lamb_coeff_freeze.copy_(torch.where(defined, ema, lamb_coeff_freeze))
            # 1e. update, each layer's u computed again (the same floats as for its norm)
            self._warmup_step_(direction, scratch, coeff)
            if self.step_count >= self.freeze_step:
                # the switch needs the verdict: read on the host, once
                self.verdict.read_on_host(self.step_count)
                self.freeze()  # 2.
            return

        # 3a. per-layer scaling (at the freeze; here for checkpoints that predate that)
        if not self.scaling_coeff_ready:
            self._compute_scaling()
        # 3b. local momentum, scaled (_exchange_source: each gradient read where autograd left
        #     it, not gathered into the flat buffer first), and
        # 3c. one compressed exchange for all layers (bucket by bucket with
        #     overlap_with_backward(); x changes only if every bucket goes through), masked (the
        #     mask commutes with the scaling); m still holds the last momentum, for 3d
        # (ok: on CUDA the NaN/Inf verdict, on the device; the kernel below writes nothing where
        # it is false and zeroes u, so that 3g leaves p as it was. x: on the CPU the exchange's
        # result where it lies, read by the kernel below without being decoded first)
        ok, x = self._compressed_average(self._exchange_source, "exchanged")
        flat, groups = self.flat, self.param_groups
        d = denominator(flat, groups, self.rescale.scales(flat))  # computed as the kernel reads v
        u = self.flat.work["update"]  # (made at the first compression step)
        # 3c (unscaling; with preconditioned_exchange x was exchanged divided by sqrt(v) + eps:
        # times it first), 3d and 3e in one sweep (a C++ kernel on CPU): m = x / scaling,
        # reconstructed gradient -> v_fresh, u = m / (sqrt(v) + eps) + weight_decay * p, and per
        # layer max((sqrt(v) + eps) / (sqrt(v_fresh) + eps)) and the norms of u before/after decay
        # p: each layer's parameter where it lies, read by the kernel for the decay term
        layers = list(range(len(self.flat.layout.params)))
        p = self.flat.params(layers) if any_weight_decay(flat, groups) else None
        hparams = ("beta1", "beta2", "eps", "weight_decay")
        stats = lamb_frozen_update(
            x,
            m,
            d,
            self.flat.states["exp_avg_sq_fresh"],
            p,
            u,
            [*self.flat.layout.offsets, self.flat.layout.numel],
            self._scaling_values(),
            *(self._per_layer_values(k) for k in hparams),
            preconditioned=self.preconditioned_exchange,
            ok=ok,
        ).to(device=scaling.device, dtype=torch.float32)
        ratio_max, prelim_norm, u_norm = stats[:, 0], stats[:, 1].sqrt(), stats[:, 2].sqrt()
        # 3f. the fresh-variance factor, blended, clipped in value and in speed (and, at once, by
        # the update's norm)
        factor = ratio_max
        if any_weight_decay(flat, groups):
            wd = self._per_layer("weight_decay")
            r = (prelim_norm / u_norm).nan_to_num(1.0, posinf=1.0).clamp_(max=1.0)
            factor = torch.where(wd > 0, factor * r + (1.0 - r), factor)
        factor = factor.clamp(self.factor_min, self.factor_max)
        factor = torch.minimum(factor, last_factor * (1.0 + self.factor_threshold))
        factor = torch.maximum(factor, last_factor * (1.0 - self.factor_threshold))
        if self.trust_ratio == "update_norm":
            p_norm = torch._foreach_norm([fp32_param(q) for q in self.flat.layout.params])
            factor = update_norm_cap(
                factor, torch.stack(p_norm).to(u_norm.device), u_norm,
                flat.scalars["ratio_ref"], self.factor_max, ok,
            )  # fmt: skip
        if ok is not None:
            factor = torch.where(ok, factor, last_factor)
        last_factor.copy_(factor)
        # 3g. update
        self._scale_layers_and_step_(u, lamb_coeff_freeze * factor)

    def _warmup_moments_(self, grads: list[torch.Tensor | None], ok: torch.Tensor | None) -> None:
        """1b, layer by layer: ``m = beta1 m + (1 - beta1) g``, ``v = beta2 v + (1 - beta2) g**2``
        (``grads``: one per layer, ``None``: zeros), kept only where the verdict ``ok`` (on the
        device; ``None``: always) is true."""
        ms, vs = self.flat.views["exp_avg"], self.flat.views["exp_avg_sq"]
        of = self.flat.layout.group_of
        for j, (m, v, g) in enumerate(zip(ms, vs, grads, strict=True)):
            beta1, beta2 = self.param_groups[of[j]]["betas"]
            g = torch.zeros_like(m) if g is None else g  # (the floats of a buffer of zeros)
            if ok is None:
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                continue
            m_new = torch.mul(m, beta1).add_(g, alpha=1 - beta1)
            torch.where(ok, m_new, m, out=m)
            v_new = torch.mul(v, beta2).addcmul_(g, g, value=1 - beta2)
            torch.where(ok, v_new, v, out=v)

    def _warmup_norms(
        self, direction: Callable[[int, torch.Tensor], torch.Tensor], scratch: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """1d's per-layer L2 norms of the parameters (read where they lie) and of the Adam
        direction (``direction``, written into ``scratch`` one layer at a time)."""
        p_norms, u_norms = [], []
        for j, p in enumerate(self.flat.layout.params):
            u = direction(j, scratch[: p.numel()].view(p.shape))
            p_norm, u_norm = torch._foreach_norm([fp32_param(p), u])
            p_norms.append(p_norm)
            u_norms.append(u_norm)
        return torch.stack(p_norms), torch.stack(u_norms)

    def _warmup_step_(
        self,
        direction: Callable[[int, torch.Tensor], torch.Tensor],
        scratch: torch.Tensor,
        coeff: torch.Tensor,
    ) -> None:
        """1e: ``p_k -= lr * coeff_k * u_k`` for every layer ``k``, ``u_k`` written by
        ``direction`` into ``scratch`` again (from the parameter before its step): the floats of
        ``_scale_layers_and_step_`` on a flat buffer of ``u``, without one."""
        self._coeffs = coeff
        layout = self.flat.layout
        if layout.device.type == "cpu":
            lrs, coeffs = [g["lr"] for g in self.param_groups], coeff.tolist()
            for j, p in enumerate(layout.params):
                u = direction(j, scratch[: p.numel()].view(p.shape))
                p.add_(u, alpha=-lrs[layout.group_of[j]] * coeffs[j])
            return
        alpha = (coeff * self._per_layer("lr")).neg_()
        for j, p in enumerate(layout.params):
            u = direction(j, scratch[: p.numel()].view(p.shape))
            layer_step(scratch, [p], [0], alpha[j : j + 1])

    def _scale_layers_and_step_(self, u: torch.Tensor, coeff: torch.Tensor) -> None:
        """``p_k -= lr * coeff_k * u_k`` for every layer ``k``. On the CPU with the coefficients
        read as Python floats (free there), one sweep per layer; on a GPU as device values
        (``-lr_k * coeff_k`` in float32 on the device: no host synchronisation; rounds
        differently from the CPU's float64 product in the last bit), one kernel for all layers
        ([`layer_step`][lightning_onebit.kernels.updates.layer_step])."""
        self._coeffs = coeff
        if u.device.type == "cpu":
            views = self.flat.views_of(u)
            lrs, of, coeffs = (
                [group["lr"] for group in self.param_groups],
                self.flat.layout.group_of,
                coeff.tolist(),
            )
            for j, p in enumerate(self.flat.layout.params):
                p.add_(views[j], alpha=-lrs[of[j]] * coeffs[j])
            return
        alpha = (coeff * self._per_layer("lr")).neg_()
        layer_step(u, self.flat.layout.params, self.flat.layout.offsets, alpha)
