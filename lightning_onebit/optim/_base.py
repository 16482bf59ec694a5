"""The base class of the three 1-bit optimizers: its contract and the step's outline.

Each algorithm (``onebit_adam.py``, ``zero_one_adam.py``, ``onebit_lamb.py``) subclasses
:class:`OneBitOptimizer`, defines ``_step`` (one step on the flat buffers, read like its paper's
Algorithm 1) and what the contract asks: the class attributes and hooks below whose docstrings
say "subclasses" (``docs/contributing.md``, "Adding an algorithm", lists them;
``docs/how-it-works.md`` tells the design). The optimizer is made of composed objects, each with
its own module and interface: ``flat`` (``_flat.py``: the layout, the flat fp32 buffers and their
views, the exchange over them), ``verdict`` (``_verdict.py``: the NaN/Inf verdict and the skip
policy), ``topology`` (``_topology.py``: process group, world size, node groups), ``counters``
(``_counters.py``: the bytes sent), ``phases`` (``_phase.py``), ``overlap`` (``_overlap.py``:
the exchange started during backward). The algorithms' arithmetic is in ``_ops.py``, the
checkpoints in ``_checkpoint.py``, the parameters without a gradient in ``_nograd.py``, the
checks in ``_validation.py``, the variance's bias correction and floor in ``_variance.py``.

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

from lightning_onebit.comm import NodeGroups, NonFiniteError, as_average_dtype
from lightning_onebit.optim._checkpoint import load_rank_state, load_state, rank_state, save_state
from lightning_onebit.optim._counters import CommCounters, restore, snapshot
from lightning_onebit.optim._flat import FlatState, Layout
from lightning_onebit.optim._nograd import HeldParams, params_without_grad
from lightning_onebit.optim._ops import (
    RESCALE_INTERVAL,
    RESCALE_REFERENCE_UPDATES,
    init_rescale,
    rescale_reduce_if_due,
)
from lightning_onebit.optim._overlap import BackwardOverlap, replace_overlap
from lightning_onebit.optim._phase import Phase, Phases
from lightning_onebit.optim._topology import Delegated, Topology
from lightning_onebit.optim._validation import (
    check_common_args,
    check_grads_are_local,
    check_group,
    check_hparams,
    check_int,
    check_joined,
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


class OneBitOptimizer(torch.optim.Optimizer, metaclass=ABCMeta):
    """Base class of the 1-bit optimizers (see the module docstring). Subclasses define ``_step()``
    and the class attributes and hooks marked "subclasses", and call ``super().__init__`` with
    their defaults.

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
            every 10th exchange; ``rescale_variance_`` (``_ops.py``)): where gradients grow after
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
    #: The algorithm's options (subclasses extend): keyword arguments of ``__init__``, whose
    #: signature holds their defaults; :meth:`check_options` validates them. ``OneBitStrategy``
    #: offers each one (``None`` there: this default) and reads them from here.
    OPTIONS: ClassVar[tuple[str, ...]] = (
        "bias_correction",
        "variance_floor",
        "preconditioned_exchange",
    )
    #: The two phases, the first one active at construction (subclasses).
    PHASES: ClassVar[tuple[Phase, Phase]] = (Phase.WARMUP, Phase.COMPRESSION)
    #: The attribute holding the step after which the built-in switch happens (subclasses).
    SWITCH_OPTION: ClassVar[str] = "freeze_step"
    #: Whether the steps can keep their NaN/Inf verdicts on the device, which they do on CUDA
    #: (their writes take it; see :class:`~lightning_onebit.optim._verdict.StepVerdict`).
    DEVICE_VERDICT: ClassVar[bool] = False
    #: After this many skipped steps in a row the run has diverged: ``step()`` raises.
    max_consecutive_skips: int = 10
    #: Flat per-parameter states, per-parameter scalar states with their initial values, flat
    #: scratch buffers (not checkpointed), optimizer-wide checkpointed attributes (subclasses).
    _flat_states: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    _scalar_states: ClassVar[dict[str, float]] = {}
    _work_buffers: tuple[str, ...] = ("update",)
    _checkpoint_attrs: tuple[str, ...] = ()
    #: Host-side counters a step advances, put back when its verdict turns out non-finite.
    _host_counters: ClassVar[tuple[str, ...]] = (
        "step_count",
        "variance_updates",
        "grad_sq_steps",
        "_rescale_due",
    )
    #: raise floored variances to their tensor's mean (see ``floor_variance_``; 1-bit LAMB)
    _floor_to_mean: ClassVar[bool] = False
    #: ``rescale_variance``: steps between the all-reduces of the gradients' mean squares, and
    #: all-reduces before their running mean is the reference (see ``rescale_variance_``)
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
        init_rescale(self)  # its counters (and, where on, its states)
        #: parameter -> name, for messages (``OneBitStrategy`` fills it from the module)
        self.param_names: dict[torch.Tensor, str] = {}
        self.average_warmup_grads = bool(average_warmup_grads)
        self.average_dtype = average_dtype
        #: ``id``s of the parameters whose warmup gradients the caller averages
        #: (``average_warmup_grads=False``; ``OneBitStrategy`` sets those DDP registered),
        #: ``None``: all of them. The others are averaged here (``average_uncovered_``).
        self.caller_averaged: frozenset[int] | None = None
        #: whether the last ``load_state_dict`` was another optimizer's (torch's Adam): the
        #: strategies then scale 1-bit LAMB's restored learning rates by ``lamb_lr / lr``
        self.loaded_foreign = False
        #: Set True around backward passes that are not followed by ``step()`` (gradient
        #: accumulation) when overlapping the exchange with backward.
        self.overlap_paused = False

        # checkpointed
        self.step_count = 0  # steps taken; identical on every rank
        self.variance_updates = 0  # steps that updated the variance (bias correction counts them)
        #: coordinates whose variance was floored at the last floor, per parameter name
        self.floored: dict[str, int] = {}
        self.phases = Phases(self.PHASES)
        #: the step's NaN/Inf verdict and the skip policy (skipped steps are checkpointed)
        self.verdict = StepVerdict(name, self.DEVICE_VERDICT)
        #: the bytes the steps send (:attr:`comm_stats`; checkpointed)
        self.counters = CommCounters()
        # composed, not checkpointed
        #: the process group, the world size and the node groups (see :meth:`node_groups`)
        self.topology = Topology(process_group, hierarchical, ranks_per_node)
        #: the layout, the flat buffers and the exchange (built at the first step)
        self.flat = FlatState(name)
        #: the exchange started during backward (see :meth:`overlap_with_backward`)
        self.overlap: BackwardOverlap | None = None
        self._trained_ids: frozenset[int] = frozenset()  # the last layout's parameters
        self._held = HeldParams()  # this step's parameters without a gradient
        self._checked_local_grads = False  # check_grads_are_local runs once
        _OPEN.add(self)  # (closed at interpreter exit: see close())

    # ------------------------------------------------------------------ options

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
        if hasattr(self, "flat"):
            self.flat.invalidate()  # re-layout at the next step

    # ------------------------------------------------------------------ phases

    @property
    def phase(self) -> Phase:
        """The current phase, one of :attr:`PHASES`."""
        return self.phases.current

    @property
    def expects_averaged_grads(self) -> bool:
        """Whether the next ``step()`` uses full-precision averaged gradients.

        With ``average_warmup_grads=False`` the caller (e.g. DDP) must provide averaged
        gradients exactly on these steps and local gradients on all others.
        """
        return not self.phases.switched

    @torch.no_grad()
    def freeze(self) -> None:
        """Switch to the compression phase from the next ``step()`` on.

        Call it on every rank between the same two steps (the built-in switch, driven by the
        step counter, always does). Calling it again is a no-op.

        With ``bias_correction`` the bias corrections are folded into the moments (``m /= 1 -
        beta1**t``, ``v /= 1 - beta2**k``), so the compression phase runs the paper's algorithm
        unchanged; then the variance is floored (``variance_floor``).
        """
        if self.phases.switched:
            return
        self._resolve_verdict()  # (called between steps: the last step's counts are final)
        self._prepare()
        self._held.release(self)  # (the switch step's: before the state changes meaning)
        self.phases.switch()
        self.flat.denominator = None  # v changed until now: sqrt(v) + eps is computed afresh
        if self.bias_correction:
            fold_bias_correction_(self)
        else:
            warn_if_variance_is_young(self)
        floor_variance_(self, report=True)
        self._on_freeze()

    def _on_freeze(self) -> None:
        """What the algorithm does when its phase switches (subclasses override)."""

    def _on_foreign_load(self) -> None:
        """After loading a state dict of another optimizer (torch's Adam): subclasses whose
        first phase keeps more than Adam's moments note what is missing."""

    def _ready_to_switch(self) -> bool:
        """Whether the first phase's state is complete enough to freeze (subclasses override)."""
        return True

    def _joins_allowed(self) -> bool:
        """Whether parameters may become trainable now: while every step measures the
        variance (the first phase; subclasses override)."""
        return not self.phases.switched

    def catch_up_switch(self) -> bool:
        """Switch now if the step count is already past the switch step; call between steps,
        on every rank. The built-in switch runs at the end of the step that reaches it, so this
        matters only after loading a checkpoint of another optimizer (torch's Adam under
        ``strategy="ddp"``: its moments are this optimizer's warmup) past the switch, or after
        moving the switch below the step count. Returns whether it switched."""
        self._resolve_verdict()
        if self.phases.switched or self.step_count < self.switch_step:
            return False
        if not self._ready_to_switch():
            return False
        self.freeze()
        return True

    @property
    def switch_step(self) -> int:
        """The step after which the built-in phase switch happens (:attr:`SWITCH_OPTION`:
        ``freeze_step`` or, for 0/1 Adam, ``var_freeze_step``). Settable: a callback may move it
        before that step."""
        return int(getattr(self, self.SWITCH_OPTION))

    @switch_step.setter
    def switch_step(self, step: int) -> None:
        check_int(self.SWITCH_OPTION, step, 0)
        setattr(self, self.SWITCH_OPTION, int(step))

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
        return self.flat.states.get("exp_avg_sq")

    # ------------------------------------------------------------------ overlap with backward

    def overlap_with_backward(
        self, bucket_cap_mb: float | None = 25.0, *, timeout: timedelta | None = None
    ) -> None:
        """Start the step's communication during backward, bucket by bucket (``None``: off).

        The flat buffers are cut into buckets of about ``bucket_cap_mb`` MiB (whole parameters,
        last layers first), each exchanged (compression steps) or averaged in fp32 (warmup, with
        ``average_warmup_grads=True``) as soon as backward has produced its gradients, on a
        communication thread and a process group of its own; ``step()`` finishes what is left.
        Each bucket has its own 1-bit scale and error buffers; a NaN/Inf in any bucket drops the
        whole step on every rank. The exchange sees ``.grad`` as backward leaves it (no clipping
        or unscaling in between), and backward passes not followed by ``step()`` need
        ``overlap_paused = True`` (``lightning_onebit/optim/_overlap.py`` has the details).

        Call it on every rank, before the first step or between two steps; changing the buckets
        of a run in progress restarts the error buffers (with a warning). ``timeout`` is that of
        the exchange's process group (a dead or stuck peer raises after it; ``None``: torch's
        default for new groups, 30 minutes): pass the one of your ``init_process_group``.
        """
        if bucket_cap_mb is not None:
            check_real("bucket_cap_mb", bucket_cap_mb, 0.0, math.inf, low_open=True)
        cap = None if bucket_cap_mb is None else max(4, int(bucket_cap_mb * 2**20))
        self.overlap = replace_overlap(self.overlap, self, cap, timeout)

    @property
    def overlaps_backward(self) -> bool:
        """Whether the exchange is started during backward (see :meth:`overlap_with_backward`)."""
        return self.overlap is not None

    def _overlappable(self) -> bool:
        """Whether the next step's exchange can start from its gradients alone (subclasses)."""
        return False

    def _unsynced(self) -> torch.Tensor | None:
        """Per parameter (layout order, on its device): whether this rank has earlier local
        steps of it to synchronise in the step being taken (subclasses: 0/1 Adam's sync
        steps); ``None``: none."""
        return None

    @abstractmethod
    def _exchange_source(self, s: slice) -> torch.Tensor:
        """What the next step exchanges, for the flat slice ``s`` (needs ``grad[s]`` only)."""

    # ------------------------------------------------------------------ the step

    @abstractmethod
    def _step(self) -> None:
        """One step of the algorithm on the flat buffers (``self.step_count`` already counts it).
        Raise :class:`NonFiniteError` before writing any state to have the step dropped."""

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
        if self.overlap is not None:  # buckets the communication thread already started
            self.flat.gathered = self.overlap.collect()
        self.counters.start_step()
        if self._device_verdicts:
            rescale_reduce_if_due(self)  # (now that the host knows which steps counted)
        counters = snapshot(self, self._host_counters)
        self.step_count += 1
        skipped = self.skipped_steps
        self.verdict.begin()
        self._held.hold(self, params_without_grad(self))  # (kept out of the step)
        try:
            self._step()
        except NonFiniteError as err:
            self._held.release(self, count=False)
            restore(self, counters)
            self._skipped(err)
        finally:
            self._held.release(self)
            self.flat.gathered = set()
            if self.overlap is not None:
                self.flat.exchange.discard()  # started buckets a step did not use (none normally)
                self.overlap.end_step()
        self.verdict.end(self.step_count, counters, skipped)
        w = self.world_size
        self.counters.end_step(self.flat.layout.numel, w, self.topology.node_size(w))
        return loss

    def _prepare(self) -> None:
        """(Re)build the flat buffers and the exchange at the first step and whenever the
        parameters, their device or a state tensor changed behind our back
        (``load_state_dict``, ``add_param_group``, a tool that moved the state)."""
        flat = self.flat
        if flat.intact(self.param_groups, self.state):
            return
        layout = Layout(self.param_groups)
        check_joined(self, layout, self._trained_ids)  # (before anything changes)
        flat.build(layout, self.state, self._flat_states, self._scalar_states, self._work_buffers)
        nodes = self.node_groups()  # (collective the first time: every rank is here)
        on_device = self.verdict.uses_device(layout.device)
        flat.fit_exchange(layout, self.overlap, self.process_group, nodes, on_device)
        flat.layout = layout
        self._trained_ids = frozenset(layout.key)
        flat.check_masks(self.param_groups)
        self._on_layout()

    def _on_layout(self) -> None:
        """Work after the flat buffers were (re)built (subclasses whose state depends on the
        layout, e.g. per-group lists)."""

    @property
    def _device_verdicts(self) -> bool:
        """Whether this step's verdicts stay on the device (see :class:`StepVerdict`)."""
        layout = self.flat.layout
        return layout is not None and self.verdict.uses_device(layout.device)

    def _resolve_verdict(self) -> None:
        """The host's half of the last step's device verdict (:meth:`StepVerdict.settle`)."""
        kept = self.verdict.settle(lambda c: restore(self, c), self._skipped, self._skipped_locally)
        self._held.settle(self, kept)  # (its held parameters' missed step counts if it did)

    def _skipped(self, err: NonFiniteError) -> None:
        """A NaN/Inf reached a communicated quantity before anything was written: the step is
        dropped on every rank, as if its batch had not been there (:meth:`StepVerdict.drop`)."""
        ex = self.flat.exchange
        announce = ex is None or ex.rank == 0  # (the same on every rank)
        limit, hint = self.max_consecutive_skips, lambda: divergence_hint(self)
        self.verdict.drop(err, step=self.step_count, limit=limit, announce=announce, hint=hint)

    def _skipped_locally(self) -> None:
        """This rank's local step (0/1 Adam's) had a non-finite gradient (subclasses)."""
        raise NotImplementedError

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

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state plus ``"onebit"``: step count, phase, counters, error buffers.

        The error buffers belong to this rank: save one state dict per rank to resume exactly.
        Each parameter's state also has torch Adam's ``step``, so that ``torch.optim.Adam``/
        ``AdamW`` can load it (back to ``strategy="ddp"``; after the switch the moments hold the
        bias correction folded in, which torch applies again in its first steps).
        """
        self._resolve_verdict()  # (a verdict still on the device: the count must be final)
        return save_state(self, super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the next step continues exactly where it left off.

        Per-parameter states are copied into this optimizer's fp32 flat buffers (torch's loader
        would cast them to the parameters' dtype). Each group's current ``exp_avg_mask`` is kept
        (as in DeepSpeed: the mask belongs to the training script, not to the checkpoint).
        A state dict without ``"onebit"`` (e.g. ``torch.optim.Adam``'s, from a run under DDP)
        loads the moments and takes its step count from torch's per-parameter ``step`` (a group
        whose parameters counted fewer steps joined later: ``joined_at``), in the first phase:
        the next steps' bias correction is the one torch's Adam would apply. The phase switch,
        if that count is already past it, is :meth:`catch_up_switch`'s.
        """
        load_state(self, state_dict, super().load_state_dict)

    def rank_state_dict(self) -> dict[str, Any]:
        """What of this rank's state differs from the other ranks': its error buffers, or
        (0/1 Adam between synchronisations, :attr:`params_differ_across_ranks`) the whole
        :meth:`state_dict`. With every rank's :meth:`state_dict` saved once (they are
        otherwise equal), each rank's ``rank_state_dict`` restores it exactly."""
        return rank_state(self)

    def load_rank_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`rank_state_dict` after loading the shared :meth:`state_dict`."""
        load_rank_state(self, state_dict)

    # ------------------------------------------------------------------ process groups

    def node_groups(self) -> NodeGroups | None:
        """The two-level layout the exchange runs on, or ``None`` for the flat exchange.

        With ``hierarchical=True`` (or ``"auto"``) and several nodes of several ranks each
        (``ranks_per_node``, default ``LOCAL_WORLD_SIZE``), every exchange and full-precision
        average runs in two levels: full precision inside a node, 1 bit between nodes
        (``ranks_per_node`` times fewer bytes through each node's link). ``True`` with one node
        or one rank per node warns and runs the flat exchange; ``"auto"`` decides silently.
        Collective on its first call (every rank at the same point); cached after it.
        """
        return self.topology.node_groups()

    def close_node_groups(self) -> None:
        """Destroy the groups of :meth:`node_groups` (the strategies do it at teardown); the
        next step builds them again."""
        if self.topology.close():
            self.flat.release_exchange()

    def close(self) -> None:
        """Stop what this optimizer started: the overlap's thread, hooks and process groups, the
        node groups and the exchange on them (its error buffers are kept); a later ``step()``
        starts them again. The strategies call it at teardown, and every optimizer is closed at
        interpreter exit (a process group left to the shutdown can abort a finished run)."""
        if self.overlap is not None:
            self.overlap.close()
            self.flat.release_exchange()
        self.close_node_groups()

    @property
    def world_size(self) -> int:
        """Ranks in ``process_group`` (1 without an initialised process group)."""
        if self.flat.exchange is not None:
            return self.flat.exchange.world_size
        return self.topology.world_size()


#: every live optimizer, for close_all()
_OPEN: weakref.WeakSet[OneBitOptimizer] = weakref.WeakSet()


def close_all() -> None:
    """:meth:`OneBitOptimizer.close` every live optimizer (at interpreter exit)."""
    for opt in list(_OPEN):
        opt.close()


atexit.register(close_all)
