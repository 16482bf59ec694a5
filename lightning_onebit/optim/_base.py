"""Machinery shared by the three 1-bit optimizers: flat state, the exchange, phases, checkpoints.

Each algorithm (``onebit_adam.py``, ``zero_one_adam.py``, ``onebit_lamb.py``) subclasses
:class:`OneBitOptimizer`; its ``_step`` reads like its paper's Algorithm 1. The base class is
here (the contract, phases, the step's outline, the overlap API); its other jobs have a module
each: the flat layout and buffers (``_layout.py``), the arithmetic ``_step`` is written in
(``_ops.py``), checkpoints (``_checkpoint.py``), options and argument checks
(``_validation.py``), the variance's bias correction and floor (``_variance.py``). Composed
objects the optimizer holds: ``verdict`` (:class:`~lightning_onebit.optim._verdict.StepVerdict`,
the NaN/Inf verdict and skip policy), ``topology``
(:class:`~lightning_onebit.optim._topology.Topology`, process group, world size, node groups),
``counters`` (:class:`~lightning_onebit.optim._counters.CommCounters`, ``comm_stats``). The
contract:

==============================  ========  ===================================================
what a subclass defines         needed    what it is
==============================  ========  ===================================================
``_step()``                     abstract  one step on the flat buffers (the algorithm)
``_exchange_source(s)``         abstract  what the next step exchanges, for flat slice ``s``,
                                          from the gradients alone (overlap with backward)
``PHASES``                      yes       its two :class:`Phase` s, the first at construction
``OPTIONS``, ``__init__``       yes       its options (defaults in ``__init__``'s signature)
``_check_options(o)``           extend    validate options (classmethod; also for the strategy)
``_check_hparams(h)``           extend    validate one param group's hyperparameters
``_flat_states``                optional  flat fp32 states (default: ``exp_avg, exp_avg_sq``)
``_scalar_states``              optional  one fp32 value per parameter, with initial values
``_work_buffers``               optional  flat scratch buffers (not checkpointed)
``_checkpoint_attrs``           optional  optimizer-wide attributes that are checkpointed
``_switch_attr``                optional  the attribute holding the switch step
``_overlappable()``             optional  whether the next step's exchange may start early
``expects_averaged_grads``      optional  whether the next step wants averaged gradients
``_on_freeze()``                optional  work at the phase switch
``_on_layout()``                optional  work after the flat buffers were (re)built
``params_differ_across_ranks``  optional  with ``synchronize()``: local steps (0/1 Adam)
==============================  ========  ===================================================

Everything else lives here, once:

* **Flat buffers.** All trainable parameters of all groups (``requires_grad=True`` when the first
  step runs) are laid out back to back, group after group, in one flat fp32 buffer per state
  (``exp_avg``, ``exp_avg_sq``, ...). ``optimizer.state[p]["exp_avg"]`` is a view into it, so the
  usual per-parameter view of torch optimizers still works, and the algorithm works on one
  contiguous slice per parameter group (``self._segments()``) instead of one tensor at a time.
* **One exchange.** A single :class:`~lightning_onebit.comm.CompressedAllreduce` over the flat
  buffer (built at the first step, on the parameters' device, over ``process_group``): one
  compressed collective per step instead of one per tensor, and one pair of error buffers.
* **Gradients.** Each step copies the gradients into a persistent flat fp32 buffer; a parameter
  whose ``.grad`` is ``None`` contributes zeros. All ranks therefore run the same arithmetic on
  the same layout even when some parameter is unused on some rank (as DDP's
  ``find_unused_parameters`` does). Its momentum keeps decaying and it keeps moving by it,
  unlike ``torch.optim.Adam``, which skips such parameters.
* **Parameters that join mid-run** (``add_param_group``, ``requires_grad`` turned on, e.g. a
  backbone a fine-tuning callback unfreezes) rebuild the layout at the next step. While every
  step measures the variance (the first phase) they train as in torch's Adam: zero state, and an
  added group's bias correction counts from the step it joined (``group["joined_at"]``).
  After the switch they are refused (``ValueError`` naming them, before any change): they have
  no variance to be preconditioned by.
* **Phases.** ``optimizer.phase`` is public; ``optimizer.freeze()`` switches to the compression
  phase from the next ``step()`` on. The switch must happen on the same step on every rank: the
  built-in switch depends only on the step counter, which every rank advances identically; a
  caller that switches by hand must call ``freeze()`` on every rank between the same two steps.
* **Checkpoints.** ``state_dict()`` is torch's (per-parameter state, param groups) plus an
  ``"onebit"`` entry with the step counter, the phase, each algorithm's counters and this rank's
  exchange error buffers; ``load_state_dict()`` restores all of it, so a run continues exactly as
  if it had never stopped. Nothing is re-derived from the step count on load (DeepSpeed's 0/1
  Adam decides the next step's allreduce from the saved interval and then resets the interval,
  so ranks can drift after a reload).

* **Non-finite values.** A NaN/Inf in what a step communicates (the averaged gradient, or any
  rank's input to the compressed exchange) is known to every rank in the same call, before any
  state was written (the exchange reads its input into scratch buffers and updates its error
  buffers only once every rank's scale is finite). The step is then dropped on every rank as if
  its batch had not been there (``skipped_steps`` counts them, a ``RuntimeWarning`` says so);
  ``max_consecutive_skips`` in a row raise :class:`~lightning_onebit.comm.NonFiniteError`.
  On CUDA every step keeps that verdict on the device (a host read would wait for the GPU, and
  for the exchange's ``all_to_all``): the exchange puts its error buffers back, and the update
  kernels and ``torch.where`` write nothing, where it is false; the host learns it at the start
  of the next ``step()`` (or ``state_dict()``, ``freeze()``), from a copy made at the end of the
  step, which has long arrived by then, and puts the step's counters back
  (``_host_counters``). The step is dropped exactly as above; its warning (and, after
  ``max_consecutive_skips``, the error) comes one step later. The step that switches the phase
  reads its verdict at once (a host synchronisation, once per run).

Gradient averaging contract, common to the three optimizers: steps that need full-precision
averaged gradients (warmup of 1-bit Adam and 1-bit LAMB, variance-update steps of 0/1 Adam;
``optimizer.expects_averaged_grads`` says whether the *next* step is one) average the flat
gradient themselves with one fp32 ``all_reduce`` when ``average_warmup_grads=True`` (the
default: plain ``torch.distributed`` use, call ``step()`` on local gradients). A strategy whose
DDP already averaged those gradients passes ``average_warmup_grads=False`` and sets
:attr:`caller_averaged` to the parameters DDP knows; the optimizer averages the others itself (DDP
registers only the parameters that required grad when it was built). All other steps expect
*local* gradients: the optimizer communicates only what its algorithm compresses.
"""

from __future__ import annotations

import atexit
import inspect
import math
import weakref
from abc import ABCMeta, abstractmethod
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from lightning_onebit.comm import (
    BucketedAllreduce,
    CompressedAllreduce,
    NodeGroups,
    NonFiniteError,
    as_average_dtype,
)
from lightning_onebit.optim._checkpoint import Checkpointing
from lightning_onebit.optim._counters import CommCounters, restore, snapshot
from lightning_onebit.optim._layout import FlatBuffers, Layout
from lightning_onebit.optim._ops import RESCALE_INTERVAL, RESCALE_REFERENCE_UPDATES, FlatOps
from lightning_onebit.optim._overlap import BackwardOverlap
from lightning_onebit.optim._phase import Phase
from lightning_onebit.optim._topology import Delegated, Topology
from lightning_onebit.optim._validation import (
    check_common_args,
    check_grads_are_local,
    check_group,
    check_hparams,
    check_int,
    check_real,
    deepspeed_arithmetic,
)
from lightning_onebit.optim._variance import (
    divergence_hint,
    floor_variance_,
    fold_bias_correction_,
    warn_if_variance_is_young,
)
from lightning_onebit.optim._verdict import StepVerdict

__all__ = ["VARIANCE_FLOOR", "OneBitOptimizer", "Phase"]

#: Default ``variance_floor``: where a variance preconditions 1-bit steps, no coordinate's
#: ``sqrt(v)`` counts as less than this fraction of its tensor's or its group's RMS ``sqrt(v)``
#: (see ``floor_variance_`` (``_variance.py``)).
VARIANCE_FLOOR = 0.01

#: ``rescale_variance``'s per-tensor states: this rank's sum of ``g**2`` since the last
#: all-reduce, the ranks' running mean square and its reference value
_RESCALE_STATES = {"grad_sq_sum": 0.0, "grad_sq_avg": 0.0, "grad_sq_ref": 0.0}


class OneBitOptimizer(
    Checkpointing, FlatBuffers, FlatOps, torch.optim.Optimizer, metaclass=ABCMeta
):
    """Base class: see the module docstring. Subclasses define the class attributes below and
    ``_step()``, and call ``super().__init__`` with their defaults.

    Args (shared by every subclass):
        process_group: the group to communicate over; ``None`` is the default group, and without
            an initialised process group the optimizer runs with ``W = 1``.
        average_warmup_grads: whether steps that need averaged gradients average them here (one
            fp32 ``all_reduce``); ``False`` when DDP already averaged them.
        average_dtype: the dtype those averages travel in: ``torch.float32`` (default, exact),
            or ``torch.bfloat16``/``torch.float16`` (or ``"bf16"``/``"fp16"``) for half the
            bytes on the warmup steps, as DDP's bf16/fp16 compress hooks (see
            :func:`~lightning_onebit.comm.start_average`). An explicit trade: the warmup's
            gradients, hence the variance that the compression phase freezes, lose precision.
        bias_correction: Adam's bias correction, as torch's Adam/AdamW: ``m / (1 - beta1**t)``
            over ``sqrt(v / (1 - beta2**k)) + eps`` (``k``: variance updates) on the steps with
            full-precision gradients, folded into ``m`` and ``v`` at the switch, so the 1-bit
            steps are preconditioned by the unbiased variance. ``False`` (default): DeepSpeed's
            arithmetic, whose young variance makes short runs' 1-bit steps several times Adam's.
        variance_floor: where a variance preconditions 1-bit steps, raise it to at least
            ``f**2 * max(mean_k, mean_g)`` (``f = variance_floor``; the mean variance of
            the coordinate's tensor and of its group; ``_variance.floor_variance_``):
            coordinates whose gradient was ~0 cannot take ``lr * scale / eps`` steps. ``0``:
            DeepSpeed's.
        preconditioned_exchange: exchange what the algorithm sends divided by
            ``sqrt(v) + eps`` and multiply back after it (1-bit Adam, 0/1 Adam): the 1-bit
            error is then about the same size relative to every coordinate's Adam step.
            ``False``: DeepSpeed's (the momentum, or 0/1 Adam's gradient, as is).
        rescale_variance: (1-bit Adam, 0/1 Adam) in the frozen phase, precondition each tensor
            by its frozen variance times ``max(1, G / G_ref)``, ``G`` the running mean square
            of its gradients, ``G_ref`` that at the switch (one float per tensor all-reduced
            every 10th exchange; :meth:`_rescale_variance_`): where gradients grow after
            the switch, the 1-bit steps stay Adam-sized. ``False`` (default): the variance
            stays as frozen (the papers' and DeepSpeed's).
        hierarchical: ``True``/``"auto"``: on several nodes of several ranks, full precision
            inside a node and 1 bit between nodes (:meth:`node_groups`); ``False`` (default):
            the flat exchange, every rank's values compressed (DeepSpeed's).
        ranks_per_node: the ranks on each node (ranks numbered node by node); default
            ``LOCAL_WORLD_SIZE`` (torchrun). Also splits the byte counters into the part
            that left the node (``comm_stats["bytes_total_inter"]``).
        deepspeed_compatible: compute what DeepSpeed's optimizer of the same name computes with
            the same arguments: the options of :attr:`DEEPSPEED_ARITHMETIC` take DeepSpeed's
            values (``bias_correction=False``, ``variance_floor=0``,
            ``preconditioned_exchange=False``, ``rescale_variance=False``; 0/1 Adam's
            ``compressed_variance_phase=True``). Raises ``ValueError`` where one of them is
            also given another value than its default. ``False`` (default): this library's
            defaults, more robust on ordinary models.
    """

    #: The options ``deepspeed_compatible=True`` sets, with DeepSpeed's values.
    DEEPSPEED_ARITHMETIC: ClassVar[dict[str, Any]] = {
        "bias_correction": False,
        "variance_floor": 0.0,
        "preconditioned_exchange": False,
        "rescale_variance": False,
    }

    #: The algorithm's options: keyword arguments of ``__init__``, whose signature holds their
    #: defaults and whose docstring documents them; :meth:`check_options` validates them.
    #: ``OneBitStrategy`` offers each one (``None`` there: this default) and reads them from here.
    OPTIONS: ClassVar[tuple[str, ...]] = (
        "bias_correction",
        "variance_floor",
        "preconditioned_exchange",
    )
    #: The two phases, the first one active at construction.
    PHASES: ClassVar[tuple[Phase, Phase]] = (Phase.WARMUP, Phase.COMPRESSION)
    #: Flat per-parameter states (one fp32 value per parameter value).
    _flat_states: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    #: Per-parameter scalar states and their initial values (one fp32 value per parameter).
    _scalar_states: ClassVar[dict[str, float]] = {}
    #: Optimizer-wide attributes that go into the checkpoint (besides step count and phase).
    _checkpoint_attrs: tuple[str, ...] = ()
    #: raise floored variances to their tensor's mean (see ``floor_variance_`` (``_variance.py``))
    _floor_to_mean: ClassVar[bool] = False
    #: Flat scratch buffers (not checkpointed).
    _work_buffers: tuple[str, ...] = ("update",)
    #: After this many skipped steps in a row the run has diverged: ``step()`` raises.
    max_consecutive_skips: int = 10
    #: Whether the steps can keep their NaN/Inf verdicts on the device (their writes take it),
    #: which they do on CUDA; see "Non-finite values".
    DEVICE_VERDICT: ClassVar[bool] = False
    #: Host-side counters a step advances: put back when the step turns out dropped (its
    #: verdict was non-finite), whether the host learnt that in the step or one step later.
    _host_counters: ClassVar[tuple[str, ...]] = (
        "step_count",
        "variance_updates",
        "grad_sq_steps",
        "_rescale_due",
    )
    #: ``rescale_variance``: steps between the all-reduces of the gradients' mean squares, and
    #: all-reduces before their running mean is the reference (see ``_rescale_variance_``)
    rescale_interval: int = RESCALE_INTERVAL
    rescale_reference_updates: int = RESCALE_REFERENCE_UPDATES
    process_group = Delegated("topology", "The group the optimizer communicates over.")
    hierarchical = Delegated("topology", "The two-level exchange (see :meth:`node_groups`).")
    ranks_per_node = Delegated("topology", "Ranks per node (see :meth:`node_groups`).")

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        process_group: dist.ProcessGroup | None = None,
        average_warmup_grads: bool = True,
        average_dtype: torch.dtype | str = torch.float32,
        amsgrad: bool = False,
        bias_correction: bool = False,
        variance_floor: float = VARIANCE_FLOOR,
        preconditioned_exchange: bool = False,
        rescale_variance: bool = False,
        hierarchical: bool | str = False,
        ranks_per_node: int | None = None,
        decoupled_weight_decay: bool = True,
        deepspeed_compatible: bool = False,
    ) -> None:
        name = type(self).__name__
        bias_correction, variance_floor, preconditioned_exchange, rescale_variance = (
            deepspeed_arithmetic(
                type(self),
                deepspeed_compatible,
                bias_correction=bias_correction,
                variance_floor=variance_floor,
                preconditioned_exchange=preconditioned_exchange,
                rescale_variance=rescale_variance,
            ).values()
        )
        check_common_args(name, amsgrad, decoupled_weight_decay, hierarchical, ranks_per_node)
        if not decoupled_weight_decay:  # (a group key only where it is not the default)
            defaults = {**defaults, "decoupled_weight_decay": False}
        average_dtype = as_average_dtype(average_dtype)
        self._check_hparams(defaults)  # (the same message as check_options: no prefix)
        OneBitOptimizer._check_options({"variance_floor": variance_floor})
        super().__init__(params, defaults)
        # hyperparameters shared by the three algorithms
        self.bias_correction = bool(bias_correction)
        self.variance_floor = float(variance_floor)
        self.preconditioned_exchange = bool(preconditioned_exchange)
        self.rescale_variance = bool(rescale_variance)
        if self.rescale_variance:  # its per-tensor states and counters (see _rescale_variance_)
            self._scalar_states = {**self._scalar_states, **_RESCALE_STATES}
            self._checkpoint_attrs = (
                *self._checkpoint_attrs,
                "grad_sq_updates",
                "grad_sq_steps",
                "grad_sq_weight",
                "_rescale_due",
            )
        self.grad_sq_updates = 0  # all-reduced updates of the running mean squares
        self.grad_sq_steps = 0  # steps summed into grad_sq_sum since the last one
        self._rescale_due = False  # (device verdicts: a reduce waits for the next step's start)
        self.grad_sq_weight = 0.0  # 1 - the initial zeros' weight in them (bias correction)
        #: parameter -> name, for messages (``OneBitStrategy`` fills it from the module)
        self.param_names: dict[torch.Tensor, str] = {}
        self.average_warmup_grads = bool(average_warmup_grads)
        self.average_dtype = average_dtype
        #: the process group, the world size and the node groups (see :meth:`node_groups`)
        self.topology = Topology(process_group, hierarchical, ranks_per_node)

        # internal state (checkpointed)
        self.step_count = 0  # steps taken; identical on every rank
        self.variance_updates = 0  # steps that updated the variance (bias correction counts them)
        #: coordinates whose variance was floored at the last floor, per parameter name
        self.floored: dict[str, int] = {}
        self._phase = self.PHASES[0]
        self._warned_young = False  # warn_if_variance_is_young says it once per run
        self._checked_local_grads = False  # check_grads_are_local runs once
        #: the step's NaN/Inf verdict and the skip policy (skipped steps are checkpointed)
        self.verdict = StepVerdict(name, self.DEVICE_VERDICT)
        #: the bytes the steps send (:attr:`comm_stats`; checkpointed)
        self.counters = CommCounters()

        #: ``id``s of the parameters whose warmup gradients the caller averages
        #: (``average_warmup_grads=False``; ``OneBitStrategy`` sets those DDP registered),
        #: ``None``: all of them. The others are averaged here (see ``_average_uncovered_``).
        self.caller_averaged: frozenset[int] | None = None
        #: whether the last ``load_state_dict`` was another optimizer's (torch's Adam): the
        #: strategies then scale 1-bit LAMB's restored learning rates by ``lamb_lr / lr``
        self.loaded_foreign = False

        # internal state (rebuilt lazily by _prepare)
        self._layout: Layout | None = None
        self._trained_ids: frozenset[int] = frozenset()  # the last layout's parameters
        self._flat: dict[str, torch.Tensor] = {}
        self._scalars: dict[str, torch.Tensor] = {}
        self._views: dict[str, list[torch.Tensor]] = {}
        self._work: dict[str, torch.Tensor] = {}
        self._grad: torch.Tensor | None = None
        self._param_flat: torch.Tensor | None = None
        self._exchange: CompressedAllreduce | BucketedAllreduce | None = None
        self._pending_exchange_state: dict[str, Any] | None = None
        self._overlap: BackwardOverlap | None = None  # see overlap_with_backward()
        self._denominator: tuple[torch.Tensor, list[torch.Tensor], list[float]] | None = None
        self._skip_gather: set[int] = set()
        #: this step's parameters without a gradient and what they hold (see :meth:`_hold`)
        self._held: tuple[Any, ...] | None = None
        #: Set True around backward passes that are not followed by ``step()`` (gradient
        #: accumulation) when overlapping the exchange with backward.
        self.overlap_paused = False
        _OPEN.add(self)  # (closed at interpreter exit: see close())

    # ------------------------------------------------------------------ hyperparameters

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        """Each of :attr:`OPTIONS` with its default (from ``__init__``'s signature)."""
        params = inspect.signature(cls.__init__).parameters
        return {k: params[k].default for k in cls.OPTIONS}

    @classmethod
    def check_options(cls, **options: Any) -> None:
        """Raise the ``ValueError`` the constructor would raise for these options (any of
        :attr:`OPTIONS`; the others at their defaults), without building an optimizer."""
        unknown = sorted(set(options) - set(cls.OPTIONS))
        if unknown:
            raise TypeError(
                f"{cls.__name__} has no option(s) {unknown}; it has {list(cls.OPTIONS)}"
            )
        cls._check_options({**cls.option_defaults(), **options})

    @classmethod
    def _check_options(cls, o: dict[str, Any]) -> None:
        """Validate the options in ``o`` (subclasses extend; ``o`` may hold only some)."""
        if "variance_floor" in o:
            check_real("variance_floor", o["variance_floor"], 0.0, 1.0, high_open=True)

    #: Validate one param group's hyperparameters (subclasses extend). ``lr = 0`` is accepted:
    #: it keeps the group fixed (as in torch's Adam, e.g. a warmup from zero).
    _check_hparams = staticmethod(check_hparams)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:
            gi = len(self.param_groups) - 1
            check_group(type(self).__name__, self.param_groups[gi], gi, self._check_hparams)
        except ValueError:
            self.param_groups.pop()  # a refused group must not stay in the optimizer
            raise
        # the step and variance update the group joins at: its bias correction counts from
        # there, as torch's Adam counts each parameter's own steps (e.g. a backbone that a
        # fine-tuning callback unfreezes mid-run); kept in the group, so checkpoints carry it
        # (torch's __init__ adds the first groups before the counters exist: they join at 0)
        if getattr(self, "step_count", 0) > 0:
            self.param_groups[-1].setdefault("joined_at", (self.step_count, self.variance_updates))
        self._layout = None  # re-layout at the next step

    # ------------------------------------------------------------------ phases

    @property
    def phase(self) -> Phase:
        """The current phase, one of :attr:`PHASES`."""
        return self._phase

    @property
    def expects_averaged_grads(self) -> bool:
        """Whether the next ``step()`` uses full-precision averaged gradients.

        With ``average_warmup_grads=False`` the caller (e.g. DDP) must provide averaged
        gradients exactly on these steps and local gradients on all others.
        """
        return self._phase == self.PHASES[0]

    @torch.no_grad()
    def freeze(self) -> None:
        """Switch to the compression phase from the next ``step()`` on.

        Call it on every rank between the same two steps (the built-in switch, driven by the
        step counter, always does). Calling it again is a no-op.

        At the switch, with ``bias_correction``, the bias corrections are folded into the
        moments (``m /= 1 - beta1**t``, ``v /= 1 - beta2**k``): the compression phase then runs
        the paper's algorithm unchanged, preconditioned by Adam's unbiased variance. Then the
        variance is floored (``floor_variance_`` (``_variance.py``)).
        """
        if self._phase == self.PHASES[1]:
            return
        self._resolve_verdict()  # (called between steps: the last step's counts are final)
        self._prepare()
        self._release()  # (the switch step's held parameters: before the state changes meaning)
        self._phase = self.PHASES[1]
        self._denominator = None  # v changed until now: sqrt(v) + eps is computed afresh
        if self.bias_correction:
            fold_bias_correction_(self)
        else:
            warn_if_variance_is_young(self)
        floor_variance_(self, report=True)
        self._on_freeze()

    def _param_name(self, j: int, layout: Layout | None = None) -> str:
        layout = layout or self._layout
        p = layout.params[j]
        name = self.param_names.get(p)
        if name is None:
            gi = layout.group_of[j]
            i = next(i for i, q in enumerate(self.param_groups[gi]["params"]) if q is p)
            name = f"param_groups[{gi}][{i}]"
        return f"{name} {tuple(p.shape)}"

    def _on_freeze(self) -> None:
        """What the algorithm does when its phase switches (subclasses override)."""

    def _on_foreign_load(self) -> None:
        """After loading a state dict of another optimizer (torch's Adam): subclasses whose
        first phase keeps more than Adam's moments note what is missing."""

    def _ready_to_switch(self) -> bool:
        """Whether the first phase's state is complete enough to freeze (subclasses override)."""
        return True

    def catch_up_switch(self) -> bool:
        """Switch now if the step count is already past the switch step; call between steps,
        on every rank. The built-in switch runs at the end of the step that reaches it, so this
        matters only after loading a checkpoint of another optimizer (torch's Adam under
        ``strategy="ddp"``: its moments are this optimizer's warmup) past the switch, or after
        moving the switch below the step count. Returns whether it switched."""
        self._resolve_verdict()
        if self._phase != self.PHASES[0] or self.step_count < self.switch_step:
            return False
        if not self._ready_to_switch():
            return False
        self.freeze()
        return True

    def _joins_allowed(self) -> bool:
        """Whether parameters may become trainable now: while every step measures the
        variance (the first phase; 0/1 Adam overrides)."""
        return self._phase == self.PHASES[0]

    def _check_joined(self, layout: Layout) -> None:
        """Refuse parameters that became trainable (``add_param_group``, ``requires_grad``
        turned on) after the variance froze, before the step changes anything: they have no
        variance, and a 1-bit step divides by it (their first steps would be ``lr * scale /
        eps``)."""
        if not self._trained_ids or self._joins_allowed():
            return
        joined = [j for j, p in enumerate(layout.params) if id(p) not in self._trained_ids]
        if not joined:
            return
        names = ", ".join(self._param_name(j, layout) for j in joined[:8])
        more = f" and {len(joined) - 8} more" if len(joined) > 8 else ""
        raise ValueError(
            f"{type(self).__name__}: {len(joined)} parameter(s) became trainable at step "
            f"{self.step_count + 1}, in the {self.phase} phase: {names}{more} (add_param_group, "
            "or requires_grad turned on: e.g. a fine-tuning callback such as Lightning's "
            "BackboneFinetuning unfreezing a backbone). Their variance was never measured, and "
            "the 1-bit steps divide by the variance frozen at the switch (step "
            f"{self.switch_step}). Make them trainable before the switch: unfreeze earlier, or "
            f"switch later (OneBitStrategy(freeze_step=...), the optimizer's {self._switch_attr})"
        )

    @property
    def switch_step(self) -> int:
        """The step after which the built-in phase switch happens (``freeze_step`` or, for 0/1
        Adam, ``var_freeze_step``). Settable: a callback may move it before that step."""
        return int(getattr(self, self._switch_attr))

    @switch_step.setter
    def switch_step(self, step: int) -> None:
        check_int(self._switch_attr, step, 0)
        setattr(self, self._switch_attr, int(step))

    _switch_attr = "freeze_step"

    @property
    def params_differ_across_ranks(self) -> bool:
        """Whether parameters (and momenta) may differ across ranks right now, so a checkpoint
        must keep every rank's copy (0/1 Adam between synchronisations)."""
        return False

    def synchronize(self) -> None:
        """Make the parameters equal on every rank now, where :attr:`params_differ_across_ranks`
        (0/1 Adam between synchronisations); a no-op for the others. Collective."""

    @property
    def variance(self) -> torch.Tensor | None:
        """The flat second-moment buffer (``None`` before the first step)."""
        return self._flat.get("exp_avg_sq")

    # ------------------------------------------------------------------ overlap with backward

    def overlap_with_backward(
        self, bucket_cap_mb: float | None = 25.0, *, timeout: timedelta | None = None
    ) -> None:
        """Start the step's communication during backward, bucket by bucket (``None``: off).

        The flat buffers are cut into buckets of about ``bucket_cap_mb`` MiB (whole parameters,
        last layers first), each exchanged as soon as backward has produced its gradients, on a
        communication thread and a process group of its own; ``step()`` then only finishes what
        is left. Compression steps start the compressed exchange; steps that average fp32
        gradients (warmup, with ``average_warmup_grads=True``) start async ``all_reduce`` s, as
        DDP does. Each bucket has its own 1-bit scale and error buffers (so the numbers differ
        slightly from one exchange for the whole model); a NaN/Inf in any bucket still drops the
        whole step on every rank. See ``lightning_onebit/optim/_overlap.py`` for the contract:
        the exchange sees ``.grad`` as backward leaves it (no clipping or unscaling in between),
        and backward passes not followed by ``step()`` need ``overlap_paused = True``.

        Call it on every rank, before the first step or between two steps; changing the buckets
        of a run in progress restarts the error buffers (with a warning). ``timeout`` is that of
        the exchange's process group (a dead or stuck peer raises after it; ``None``: torch's
        default for new groups, 30 minutes): pass the one of your ``init_process_group``.
        """
        if bucket_cap_mb is not None:
            check_real("bucket_cap_mb", bucket_cap_mb, 0.0, math.inf, low_open=True)
        cap = None if bucket_cap_mb is None else max(4, int(bucket_cap_mb * 2**20))
        if self._overlap is not None:
            if cap == self._overlap.cap and timeout == self._overlap.timeout:
                return
            self._overlap.close()
            self._release_exchange()  # (built on the overlap's groups, just destroyed)
        self._overlap = None if cap is None else BackwardOverlap(self, cap, timeout)
        self._layout = None  # new buckets (and hooks) at the next step

    @property
    def overlaps_backward(self) -> bool:
        """Whether the exchange is started during backward (see :meth:`overlap_with_backward`)."""
        return self._overlap is not None

    def _overlappable(self) -> bool:
        """Whether the next step's exchange can start from its gradients alone (subclasses)."""
        return False

    # (the OverlapHost interface, what BackwardOverlap calls: _overlap_* and three attributes)

    def _overlap_mode(self) -> str | None:
        """What backward may start for the next step: ``"average"`` (the fp32 average of the
        gradients), ``"exchange"`` (the compressed exchange) or ``None`` (nothing)."""
        if self._layout is None:
            return None
        if self.expects_averaged_grads:
            return "average" if self.average_warmup_grads and self.world_size > 1 else None
        return "exchange" if self._overlappable() else None

    def _overlap_gradients(self, params: list[int], s: slice) -> torch.Tensor:
        if params:
            self._gather_grads(params)
        return self._grad[s]

    def _overlap_start_exchange(self, bucket: int, s: slice) -> None:
        self._exchange.start_bucket(bucket, self._exchange_source(s))

    def _overlap_discard(self) -> None:
        self._exchange.discard()

    @abstractmethod
    def _exchange_source(self, s: slice) -> torch.Tensor:
        """What the next step exchanges, for the flat slice ``s`` (needs ``grad[s]`` only)."""

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Perform one optimization step (see the class docstring for the algorithm).

        Args:
            closure: optional callable that re-evaluates the model and returns the loss.
        """
        self._resolve_verdict()  # the last step's, if on the device (may raise: diverged)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._prepare()
        if not self._checked_local_grads and (
            self.average_warmup_grads or not self.expects_averaged_grads
        ):
            self._checked_local_grads = True
            check_grads_are_local(self)
        if self._overlap is not None:  # buckets the communication thread already started
            self._skip_gather = self._overlap.collect()
        self.counters.start_step()
        if self._device_verdicts:
            self._rescale_reduce_if_due()  # (now that the host knows which steps counted)
        counters = snapshot(self, self._host_counters)
        self.step_count += 1
        skipped = self.skipped_steps
        self.verdict.begin()
        self._hold(self._params_without_grad())
        try:
            self._step()
        except NonFiniteError as err:
            self._release(count=False)
            restore(self, counters)
            self._skipped(err)
        finally:
            self._release()
            self._skip_gather = set()
            if self._overlap is not None:
                self._exchange.discard()  # started buckets a step did not use (none normally)
                self._overlap.end_step()
        self.verdict.end(self.step_count, counters, skipped)
        w = self.world_size
        self.counters.end_step(self._layout.numel, w, self.topology.node_size(w))
        return loss

    # ------------------------------------------------------------------ parameters without gradients

    def _params_without_grad(self) -> list[int]:
        """The parameters (layout indices) that have no gradient this step (``.grad`` is
        ``None``) on every rank, known without asking the other ranks: in one process, and
        where DDP produced the gradients (:attr:`caller_averaged`), which leaves ``.grad``
        ``None`` exactly where no rank used a parameter (``find_unused_parameters=True``; DDP
        refuses unused parameters otherwise). Elsewhere (plain ``torch.distributed``, a
        parameter DDP does not know) a missing gradient counts as zeros: a parameter that other
        ranks use is averaged with them, as DDP averages it."""
        params = self._layout.params
        idx = [j for j, p in enumerate(params) if p.grad is None]
        if not idx or self.world_size == 1:
            return idx
        covered = self.caller_averaged
        return [] if covered is None else [j for j in idx if id(params[j]) in covered]

    def _hold(self, idx: list[int]) -> None:
        """Keep the parameters ``idx`` (without a gradient on every rank) out of this step, as
        torch's Adam skips them: their values, their state and their part of the exchange's
        error buffers are saved now and put back by :meth:`_release`. The step itself runs
        unchanged over the whole flat layout (a missing gradient counts as zeros there), so
        every rank runs the same collectives. Their exchanged values are sent (1 bit cannot
        send a zero) and dropped; their error buffers then do not remember them."""
        if not idx:
            return
        views, layout = self._views, self._layout
        saved = {
            name: [views[name][j].clone() for j in idx] for name in (*self._flat, *self._scalars)
        }
        values = [layout.params[j].detach().clone() for j in idx]
        errors = [
            [e.clone() for e in self._exchange.error_views(lo, lo + layout.params[j].numel())]
            for j, lo in ((j, layout.offsets[j]) for j in idx)
        ]
        self._held = (idx, saved, values, errors, self.variance_updates)

    def _release(self, count: bool = True) -> None:
        """Put back what :meth:`_hold` saved (at the end of the step, or at the phase switch,
        before the state changes meaning); with ``count``, the step counts as one the held
        parameters missed (their bias correction counts their own steps, as torch's Adam's)."""
        held, self._held = self._held, None
        if held is None:
            return
        idx, saved, values, errors, variance_updates = held
        views, layout = self._views, self._layout
        for name, kept in saved.items():
            for j, v in zip(idx, kept, strict=True):
                views[name][j].copy_(v)
        for j, v, errs in zip(idx, values, errors, strict=True):
            layout.params[j].copy_(v)
            lo = layout.offsets[j]
            for e, kept in zip(self._exchange.error_views(lo, lo + v.numel()), errs, strict=True):
                e.copy_(kept)
            if count:
                state = self.state[layout.params[j]]
                t, k = state.get("steps_without_grad", (0, 0))
                k += self.variance_updates - variance_updates
                state["steps_without_grad"] = (t + 1, k)

    def _missed_steps(self, j: int) -> tuple[int, int]:
        """``(steps, variance updates)`` that parameter ``j`` (layout index) missed for want of
        a gradient (see :meth:`_hold`)."""
        return self.state[self._layout.params[j]].get("steps_without_grad", (0, 0))

    def _any_missed_steps(self) -> bool:
        return any("steps_without_grad" in self.state[p] for p in self._layout.params)

    @abstractmethod
    def _step(self) -> None:
        """One step of the algorithm on the flat buffers (``self.step_count`` already counts it).
        Raise :class:`NonFiniteError` before writing any state to have the step dropped."""

    @property
    def _device_verdicts(self) -> bool:
        """Whether this step's verdicts stay on the device (see :class:`StepVerdict`)."""
        return self._layout is not None and self.verdict.uses_device(self._layout.device)

    @property
    def comm_stats(self) -> dict[str, int]:
        """Bytes sent: ``bytes_last_step``, ``bytes_total``, ``fp32_equiv_total`` (what fp32
        ring allreduces of the gradients would have sent) and their ``_inter`` parts (what left
        the node)."""
        return self.counters.totals

    @property
    def skipped_steps(self) -> int:
        """Steps dropped on every rank (or, 0/1 Adam's local steps, on one) for NaN/Inf."""
        return self.verdict.skipped_steps

    def _resolve_verdict(self) -> None:
        """The host's half of a step whose verdict stayed on the device: if it was non-finite,
        the step (which wrote nothing) is uncounted, its counters put back, and reported as a
        skipped step (``"local"``: 0/1 Adam's local step, skipped by its own rank only). Runs
        at the start of the next step and before a checkpoint."""
        dropped = self.verdict.resolve()
        if dropped is None:
            return
        if dropped.kind == "local":  # (0/1 Adam's)
            self._skipped_locally()
            return
        restore(self, dropped.counters)
        self._skipped(NonFiniteError(dropped.message))

    def _skipped(self, err: NonFiniteError) -> None:
        """A NaN/Inf reached a communicated quantity: every rank learnt it in the same call and
        nothing was changed yet (the algorithms only write their state after the exchange), so
        the step is dropped on every rank, as if its batch had not been there."""
        self.verdict.drop(
            err,
            step=self.step_count,
            limit=self.max_consecutive_skips,
            announce=self._exchange is None or self._exchange.rank == 0,  # (same on every rank)
            hint=lambda: divergence_hint(self),
        )

    def _skipped_locally(self) -> None:
        """This rank's local step (0/1 Adam's) had a non-finite gradient (subclasses)."""
        raise NotImplementedError

    def node_groups(self) -> NodeGroups | None:
        """The two-level layout the exchange runs on, or ``None`` for the flat exchange.

        With ``hierarchical=True`` (or ``"auto"``) and several nodes of several ranks each
        (``ranks_per_node``, default ``LOCAL_WORLD_SIZE`` as torchrun sets it), every exchange
        and full-precision average runs in two levels (``lightning_onebit/comm/hierarchical.py``): full
        precision inside a node, 1 bit between nodes, ``ranks_per_node`` times fewer bytes
        through each node's network link. ``True`` with one node or one rank per node warns and
        runs the flat exchange; ``"auto"`` decides silently. Collective on its first call (every
        rank at the same point: the first step, or the strategy's setup); cached after it.
        """
        return self.topology.node_groups()

    def close_node_groups(self) -> None:
        """Destroy the groups of :meth:`node_groups` (the strategies do it at teardown); the
        next step builds them again."""
        if self.topology.close():
            self._release_exchange()

    def close(self) -> None:
        """Stop what this optimizer started: the overlap's communication thread, gradient hooks
        and process groups, the two-level exchange's groups, and the exchange that runs on
        them (its error buffers are kept). Settings stay: a later ``step()`` starts them
        again (collectively: every rank steps). The strategies call it at teardown, and every
        optimizer is closed at interpreter exit (a process group left to the interpreter's
        shutdown can abort a finished run)."""
        if self._overlap is not None:
            self._overlap.close()
            self._release_exchange()
        self.close_node_groups()

    def _release_exchange(self) -> None:
        """Let go of the exchange when the process groups it runs on are destroyed: a group
        destroyed while an object still references it keeps its threads and sockets until
        that object is collected (at the latest in the interpreter's exit, where it can abort
        the process). Its error buffers wait in the pending state for the next step's
        exchange (restored where the buckets match, else restarted with a warning)."""
        ex, self._exchange = self._exchange, None
        if ex is not None and ex.calls > 0 and self._pending_exchange_state is None:
            self._pending_exchange_state = ex.state_dict()
        self._layout = None  # (a new exchange at the next step)

    @property
    def world_size(self) -> int:
        """Ranks in ``process_group`` (1 without an initialised process group)."""
        if self._exchange is not None:
            return self._exchange.world_size
        return self.topology.world_size()


#: every live optimizer, for close_all()
_OPEN: weakref.WeakSet[OneBitOptimizer] = weakref.WeakSet()


def close_all() -> None:
    """:meth:`OneBitOptimizer.close` every live optimizer (at interpreter exit)."""
    for opt in list(_OPEN):
        opt.close()


atexit.register(close_all)
