"""1-bit Adam (Tang et al., 2021, https://arxiv.org/abs/2102.02888), as DeepSpeed runs it.

Adam's variance becomes stable early in training. 1-bit Adam runs plain Adam for ``freeze_step``
steps (the warmup), then freezes the variance and turns Adam into momentum SGD with a fixed
per-coordinate preconditioner. Momentum SGD tolerates compressed communication with error
feedback, so from then on each rank updates its momentum with its *local* gradient and only the
momentum is exchanged, 1 bit per value, and every rank receives the same averaged momentum,
so parameters stay identical on all ranks.

Why compression cannot start at step 1: with a variance still moving, the preconditioned
compression error is not bounded and Adam diverges (the paper's Section 3); the warmup is what
makes the frozen variance a good preconditioner.

Communication contract: warmup steps need averaged gradients. With
``average_warmup_grads=True`` (default) this optimizer averages the local gradients itself, one
fp32 ``all_reduce`` per step, so plain ``torch.distributed`` code just calls ``step()``; a DDP
strategy that already averaged them passes ``False``. Compression steps always expect *local*
gradients (switch DDP's allreduce off) and send about ``n / 4`` bytes per rank instead of
``8 n (W - 1) / W``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from lightning_onebit.kernels import MomentumSource
from lightning_onebit.optim._base import VARIANCE_FLOOR, OneBitOptimizer
from lightning_onebit.optim._ops import (
    adam_step_,
    denominator,
    frozen_adam_update_,
)
from lightning_onebit.optim._phase import Phase
from lightning_onebit.optim._validation import check_int
from lightning_onebit.optim._variance import bias_correction

__all__ = ["OneBitAdam"]


class OneBitAdam(OneBitOptimizer):
    """1-bit Adam: Adam warmup, then frozen variance and 1-bit compressed momentum.

    Each step, with ``g`` the gradient, ``m``/``v`` the first/second moments, all fp32:

    1. Warmup (``phase == "warmup"``, the first ``freeze_step`` steps):

       a. ``g = mean over ranks of g`` (fp32 allreduce; see ``average_warmup_grads``).
       b. ``m = beta1 * m + (1 - beta1) * g``;  ``v = beta2 * v + (1 - beta2) * g**2``.

    2. Compression (``phase == "compression"``, after ``freeze_step`` steps or ``freeze()``):

       a. ``m = beta1 * m + (1 - beta1) * g_local``  (this rank's gradient).
       b. ``m = compressed_allreduce(m)``: error-compensated 1-bit average, identical on
          every rank; then ``m *= exp_avg_mask`` where the group has one.
       c. ``v`` is frozen.

    3. Both phases: ``p -= lr * (m / (sqrt(v) + eps) + weight_decay * p)`` (no bias
       correction, decoupled weight decay, as DeepSpeed).

    At ``W = 1`` step 2b still compresses (no communication), so a single process sees the
    compression error a multi-rank run would; DeepSpeed skips it there.

    Args:
        params: parameters or param groups. Groups may override ``lr``, ``betas``, ``eps``,
            ``weight_decay`` and may carry an ``exp_avg_mask`` tensor (broadcastable to each of
            the group's parameters) that multiplies the momentum after each exchange: 1-bit
            signs cannot encode an exact zero, so momenta that must stay zero (e.g. position
            embeddings beyond the trained sequence length) need a mask.
        lr: learning rate.
        freeze_step: number of warmup (uncompressed) steps before the variance freezes and the
            compressed exchange starts (at least one step runs: a variance that never saw a
            gradient cannot precondition). DeepSpeed's default is 100000; its tutorials use 15-25%
            of the total steps.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to ``sqrt(v)`` in the denominator.
        weight_decay: decoupled weight decay (``p -= lr * weight_decay * p``).
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
            [`OneBitOptimizer`][lightning_onebit.optim.OneBitOptimizer]. With
            ``preconditioned_exchange`` (default) step 2b exchanges ``m / (sqrt(v) + eps)`` and sets
            ``m = result * (sqrt(v) + eps)``; ``variance_floor=0, preconditioned_exchange=False``
            is DeepSpeed's arithmetic.
        rescale_variance: step 2c keeps ``v`` frozen but preconditions each tensor by
            ``v * A / A_switch``, ``A`` its mean of Adam's variance kept up to date from its
            gradients' mean square (one float per tensor all-reduced every 10 steps), so that
            the 1-bit steps stay Adam's size as the gradients grow or shrink; see
            ``VarianceRescale`` (``optim/_rescale.py``).
        hierarchical, ranks_per_node: the two-level exchange on several nodes (full precision
            inside a node, 1 bit between nodes); see
            [`node_groups`][lightning_onebit.optim.OneBitOptimizer.node_groups].
        decoupled_weight_decay: ``True`` (default): ``weight_decay`` is decoupled, AdamW's
            ``p -= lr * wd * p``. ``False``: torch Adam's L2 term, ``g += wd * p`` before the
            moments (after ``maximize``). Also a param-group key, as in torch's Adam.
        deepspeed_compatible: ``True``: DeepSpeed's arithmetic (its optimizer's results for the
            same arguments); see [`OneBitOptimizer`][lightning_onebit.optim.OneBitOptimizer].

    DeepSpeed's ``cuda_aware``/``comm_backend_name`` have no equivalent: pass a
    ``process_group`` of the backend you want (gloo, NCCL).
    """

    PHASES = (Phase.WARMUP, Phase.COMPRESSION)
    OPTIONS = (*OneBitOptimizer.OPTIONS, "rescale_variance")

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
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
        check_int("freeze_step", freeze_step, 0)
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
        self.freeze_step = freeze_step

    DEVICE_VERDICT = True

    def _overlappable(self) -> bool:
        return self.phase == Phase.COMPRESSION

    def _exchange_source(self, s: slice) -> MomentumSource:
        """2a for the flat slice ``s`` (whole parameters): ``u = beta1 * m + (1 - beta1) * g``
        (m itself unchanged), divided by ``sqrt(v) + eps`` with ``preconditioned_exchange``;
        the exchange computes it as it compresses it where it can (one sweep that reads each
        gradient where autograd left it, ``FlatState.grads``), else into scratch."""
        flat, groups = self.flat, self.param_groups
        idx = flat.params_in(s)
        d = None
        if self.preconditioned_exchange:
            d = denominator(flat, groups, self.rescale.scales(flat), idx)
        beta = [groups[flat.layout.group_of[j]]["betas"][0] for j in idx]
        return MomentumSource(
            flat.states["exp_avg"],
            flat.grads(groups, idx),
            d,
            functools.partial(flat.scratch, "update"),  # made only if materialized
            [flat.layout.offsets[j] for j in idx],
            [flat.layout.params[j].numel() for j in idx],
            beta,
            [1 - b for b in beta],
        )

    def _step(self) -> None:
        if self.phase == Phase.WARMUP:
            # 1a. full-precision average of the gradients (averaged before the step, or W = 1:
            #     each read where autograd left it, no flat copy)
            grads, ok = self._averaged_grads()
            self.rescale.warmup_(self.flat, grads, ok)  # rescale_variance: the gradients' scale
            # 1b + 3. Adam's moments and update, one fused sweep
            self.variance_updates += 1
            bias = bias_correction(self) if self.bias_correction else None
            adam_step_(self.flat, self.param_groups, bias, grads, ok=ok)
            if self.step_count >= self.freeze_step:
                # the switch needs the verdict: read on the host, once
                self.verdict.read_on_host(self.step_count)
                self.freeze()
            return

        # 2a. momentum from the local gradient (_exchange_source: read where autograd left
        #     it, not gathered into the flat buffer first), and
        # 2b. its 1-bit average: every rank gets the same m (bucket by bucket, started during
        #     backward with overlap_with_backward(); m changes only if every bucket goes through)
        # (CUDA: the NaN/Inf verdict ok stays on the device, and the update kernel writes m and
        # p only where it is true: the same step, without a host synchronisation. Elsewhere ok
        # is None: a non-finite exchange raised, nothing changed.) With preconditioned_exchange
        # the exchange is in the units of the update: x = 1-bit average of m / (sqrt(v) + eps),
        # then m = x * (sqrt(v) + eps) and 3. p -= lr * (x + weight_decay * p).
        # (x: on the CPU the exchange's result where it lies, which the update reads without
        # decoding it into a buffer first; elsewhere decoded, into m where it can be)
        m, into_m = self.flat.states["exp_avg"], not self.flat.exchange.device_verdict
        x = m if into_m and not self.preconditioned_exchange else "update"
        ok, x = self._compressed_average(self._exchange_source, x)
        # 2c. v stays frozen; 3. the update, with the frozen variance as preconditioner (one
        # sweep: m and p)
        flat, groups = self.flat, self.param_groups
        d = denominator(flat, groups, self.rescale.scales(flat))
        frozen_adam_update_(flat, groups, d, ok, x, self.preconditioned_exchange)
        # rescale_variance: the next steps' sqrt(v) + eps follows the gradients' scale
        if self.rescale_variance:
            grads = self.flat.grads(self.param_groups, list(range(len(self.flat.layout.params))))
            self.rescale.accumulate_(self.flat, self.param_groups, grads, reduce=True, ok=ok)
