"""The base class of the three 1-bit optimizers: its contract and the step's outline.

A subclass defines ``_step`` (one step on the flat buffers, read like its paper's Algorithm 1)
and ``_exchange_source``, and may override the rest of its extension points (the same table is in
``docs/contributing.md``): the class attributes ``PHASES``, ``OPTIONS``, ``DEEPSPEED_ARITHMETIC``,
``SWITCH_OPTION``, ``DEVICE_VERDICT``, ``FLOOR_TO_MEAN``, ``_flat_states``, ``_switch_states``,
``_scalar_states``, ``_work_buffers``, ``_checkpoint_attrs``, ``_host_counters``; the checks
``_check_options`` and ``_check_hparams``; the methods and properties under "what subclasses
define" below. Its steps' averages are methods of ``Averages`` (``_averages.py``). Composed parts:
``flat`` (``_flat.py``: layout, buffers, exchange), ``verdict`` (``_verdict.py``: NaN/Inf verdict,
skips), ``topology`` (``_topology.py``), ``counters``, ``phases``, ``overlap``, ``rescale``,
``checkpoint``, ``divergence``, ``coded_average`` (each in its own ``_*.py``); the base passes
its extension points to them as arguments. ``docs/how-it-works.md`` maps the rest.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Iterable
from functools import partial
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_onebit.comm import NonFiniteError, as_average_dtype
from lightning_onebit.kernels import ExchangeSource
from lightning_onebit.optim._averages import Averages
from lightning_onebit.optim._checkpoint import Checkpointed, CheckpointLayout
from lightning_onebit.optim._coded_average import CodedAverage, WindowVariance, check_coded
from lightning_onebit.optim._connections import Connections
from lightning_onebit.optim._counters import CommCounters, restore, snapshot
from lightning_onebit.optim._divergence import DivergenceWatch
from lightning_onebit.optim._flat import FlatState
from lightning_onebit.optim._nograd import HeldParams, params_without_grad
from lightning_onebit.optim._overlap import BackwardOverlap
from lightning_onebit.optim._phase import Phase, Phases
from lightning_onebit.optim._rescale import VarianceRescale
from lightning_onebit.optim._topology import Delegated, Topology, register
from lightning_onebit.optim._validation import (
    add_checked_group,
    check_common_args,
    check_grads_are_local,
    check_hparams,
    check_int,
    check_joined,
    check_shared_options,
    deepspeed_arithmetic,
    option_defaults,
    raise_for_options,
)
from lightning_onebit.optim._variance import (
    bias_correction,
    divergence_hint,
    floor_variance_,
    fold_bias_correction_,
    variance_sample,
    warn_if_variance_is_young,
)
from lightning_onebit.optim._verdict import StepVerdict

__all__ = ["VARIANCE_FLOOR", "OneBitOptimizer", "Phase"]

#: Default ``variance_floor`` (see ``OneBitOptimizer``).
VARIANCE_FLOOR = 0.01


class OneBitOptimizer(Connections, Averages, Checkpointed, Optimizer, metaclass=ABCMeta):
    """Base class of the 1-bit optimizers (see the module docstring).

    Args (shared by every subclass; their docstrings add what is particular to them):
        process_group: the group to communicate over (``None``: the default group; ``W = 1``
            without an initialised process group).
        average_warmup_grads: average here the gradients of the steps that need them averaged;
            ``False`` where DDP averaged them already.
        average_dtype: those averages' dtype: ``torch.float32`` (default), ``torch.bfloat16``,
            ``torch.float16`` (``"bf16"``/``"fp16"``: half the bytes, a less precise variance),
            or integer codes with error feedback, ``torch.int8``/``torch.int4`` (``"int4"``:
            7.8x fewer bytes than fp32; needs ``average_warmup_grads``, one level).
        variance_window: with ``torch.int4``: the warmup's last steps (a fraction, or steps;
            ``None``: ``1 / (1 - beta2)``; 0: none) average in int8; theirs is the frozen variance.
        bias_correction: torch Adam's bias correction on the full-precision steps, folded into
            ``m`` and ``v`` at the switch. ``False`` (default): DeepSpeed's.
        variance_floor: ``f``: where a variance preconditions 1-bit steps, raise it to at least
            ``f**2 * max(mean_k, mean_g)`` (its tensor's and group's mean variance): coordinates
            whose variance is too small to precondition then cannot take ``lr * scale / eps``
            steps. ``0``: DeepSpeed's.
        preconditioned_exchange: exchange what the algorithm sends divided by ``sqrt(v) + eps``
            (and multiply back), so that the 1-bit error is alike relative to every
            coordinate's step. ``False``: DeepSpeed's.
        rescale_variance: (1-bit Adam, 0/1 Adam) after the switch, precondition each tensor by
            its frozen variance times ``A / A_switch``, ``A`` the tensor's mean of Adam's
            variance, kept up to date from the gradients' mean square (one float per tensor
            all-reduced every 10 steps). ``False`` (default): DeepSpeed's.
        hierarchical: ``True``/``"auto"``: the two-level exchange
        ([`node_groups`][lightning_onebit.optim.OneBitOptimizer.node_groups]). ranks_per_node: ranks
        per node, numbered node by node (default ``LOCAL_WORLD_SIZE``; the ``_inter`` counters').
        decoupled_weight_decay: ``True``: ``weight_decay`` is AdamW's ``p -= lr * wd * p``;
            ``False``: torch Adam's L2 term ``g += wd * p`` (also a param-group key).
        deepspeed_compatible: DeepSpeed's values for the options of ``DEEPSPEED_ARITHMETIC``
            (``ValueError`` where one is also given a value other than its default).
    """

    #: The options ``deepspeed_compatible=True`` sets, with DeepSpeed's values.
    DEEPSPEED_ARITHMETIC: ClassVar[dict[str, Any]] = {
        "bias_correction": False,
        "variance_floor": 0.0,
        "preconditioned_exchange": False,
        "rescale_variance": False,
    }
    #: The algorithm's options: keyword arguments of ``__init__`` (subclasses extend).
    OPTIONS: ClassVar[tuple[str, ...]] = (
        "bias_correction",
        "variance_floor",
        "preconditioned_exchange",
    )
    #: The two phases, the first one active at construction (subclasses).
    PHASES: ClassVar[tuple[Phase, Phase]] = (Phase.WARMUP, Phase.COMPRESSION)
    #: The attribute holding the step after which the built-in switch happens (subclasses).
    SWITCH_OPTION: ClassVar[str] = "freeze_step"
    #: Whether the steps can keep their NaN/Inf verdicts on the device (``StepVerdict``).
    DEVICE_VERDICT: ClassVar[bool] = False
    #: After this many skipped steps in a row the run has diverged: ``step()`` raises.
    max_consecutive_skips: int = 10
    #: What a blow-up in the compression phase does: ``"warn"`` once, ``"raise"`` DivergenceError.
    on_divergence: str = "warn"  # one of DIVERGENCE_ACTIONS
    #: Flat per-parameter states, per-parameter scalar states with initial values, flat scratch
    #: (not checkpointed), checkpointed optimizer-wide attributes (subclasses).
    _flat_states: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    #: Those of ``_flat_states`` that only the second phase uses (made at the switch).
    _switch_states: tuple[str, ...] = ()
    _scalar_states: ClassVar[dict[str, float]] = {}
    _work_buffers: tuple[str, ...] = ("update",)
    _checkpoint_attrs: tuple[str, ...] = ()
    #: Host-side counters a step advances, put back when its verdict turns out non-finite.
    _host_counters: ClassVar[tuple[str, ...]] = ("step_count", "variance_updates", "rescale")
    #: Raise floored variances to their tensor's mean (``floor_variance_``'s ``to_mean``).
    FLOOR_TO_MEAN: ClassVar[bool] = False
    rescale_interval = Delegated(
        "rescale", "``rescale_variance``'s steps between all-reduces.", attr="interval"
    )

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        process_group: dist.ProcessGroup | None = None,
        average_warmup_grads: bool = True,
        average_dtype: torch.dtype | str = torch.float32,
        variance_window: float | int | None = None,
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
        shared = deepspeed_arithmetic(
            type(self),
            deepspeed_compatible,
            bias_correction=bias_correction,
            variance_floor=variance_floor,
            preconditioned_exchange=preconditioned_exchange,
            rescale_variance=rescale_variance,
        )
        check_common_args(name, amsgrad, decoupled_weight_decay, hierarchical, ranks_per_node)
        if not decoupled_weight_decay:  # a group key only where it is not the default
            defaults = {**defaults, "decoupled_weight_decay": False}
        average_dtype = as_average_dtype(average_dtype)
        check_coded(average_dtype, average_warmup_grads, hierarchical is True, variance_window)
        self._check_hparams(defaults)  # the same message as check_options: no prefix
        check_shared_options(shared)
        super().__init__(params, defaults)
        self.bias_correction = bool(shared["bias_correction"])
        self.variance_floor = float(shared["variance_floor"])
        self.preconditioned_exchange = bool(shared["preconditioned_exchange"])
        self.rescale_variance = bool(shared["rescale_variance"])
        self.average_warmup_grads, self.average_dtype = bool(average_warmup_grads), average_dtype
        self.coded_average = CodedAverage()  # average_dtype int4/int8: its error buffers
        self.variance_window, self.window_variance = variance_window, WindowVariance()
        #: parameter -> name, for messages (``OneBitStrategy`` fills it from the module)
        self.param_names: dict[torch.Tensor, str] = {}
        #: ``id`` s of the parameters whose averaged gradients the caller provides (``None``: all)
        self.caller_averaged: frozenset[int] | None = None
        #: whether the last ``load_state_dict`` was another optimizer's (torch's Adam)
        self.loaded_foreign = False
        #: set around backward passes not followed by ``step()`` while overlapping
        self.overlap_paused = False
        # checkpointed
        self.step_count = 0  # steps taken; identical on every rank
        self.variance_updates = 0  # steps that updated the variance (bias correction counts them)
        #: coordinates whose variance the last floor raised, per parameter name
        self.floored: dict[str, int] = {}
        self.phases = Phases(self.PHASES)
        self.verdict = StepVerdict(name, self.DEVICE_VERDICT)
        self.counters = CommCounters()  # bytes sent (``comm_stats``)
        self.topology = Topology(process_group, hierarchical, ranks_per_node)  # not saved
        #: ``rescale_variance``'s counters and blocks
        self.rescale = VarianceRescale(self.rescale_variance, self.topology, self.counters)
        scalars = (*self._scalar_states, *self.rescale.states)
        self.checkpoint = CheckpointLayout((*self._flat_states, *scalars), self._checkpoint_attrs)
        # composed, not checkpointed
        self.flat = FlatState(name)  # built at the first step
        self.overlap: BackwardOverlap | None = None  # ``overlap_with_backward``
        #: each tensor's growth in the compression phase (``growth``, ``every``: tunable)
        self.divergence = DivergenceWatch()
        self._held = HeldParams()  # this step's parameters without a gradient
        self._grads_checked = False  # check_grads_are_local: once
        register(self)  # closed at interpreter exit

    # ------------------------------------------------------------------ what subclasses define

    @abstractmethod
    def _step(self) -> None:
        """One step on the flat buffers (``step_count`` counts it already). Raise
        [`NonFiniteError`][lightning_onebit.comm.base.NonFiniteError] before writing any state to
        have the step dropped."""

    @abstractmethod
    def _exchange_source(self, s: slice) -> torch.Tensor | ExchangeSource:
        """What the next step exchanges, for the flat slice ``s`` (whole parameters), from
        those parameters' gradients alone: it reads them where autograd left them or gathers
        them (``FlatState.grads``, ``FlatState.gather_grads``), now or, for a
        [`ExchangeSource`][lightning_onebit.kernels.sources.ExchangeSource], when the exchange
        computes it, so it runs where ``.grad`` may be read (in ``step()``, or the overlap's hook
        during backward, which also runs that part of the exchange)."""

    #: Validate (some) options, and one param group's hyperparameters (subclasses extend).
    _check_options = staticmethod(check_shared_options)
    _check_hparams = staticmethod(check_hparams)

    @property
    def expects_averaged_grads(self) -> bool:
        """Whether the next ``step()`` uses averaged gradients (warmup, 0/1 Adam's variance steps,
        averaged here; with ``average_warmup_grads=False`` the caller's, for the parameters in
        ``caller_averaged``). The other steps expect each rank's local gradients."""
        return not self.phases.switched

    @property
    def params_differ_across_ranks(self) -> bool:
        """Whether parameters may differ across ranks now (0/1 Adam between synchronisations)."""
        return False

    def synchronize(self) -> None:
        """Make the parameters equal on every rank where they may differ (collective)."""

    def _params_agree(self) -> bool:
        """Whether the last step left the parameters bitwise equal on every rank (watched then)."""
        return not self.params_differ_across_ranks

    def _overlappable(self) -> bool:
        """Whether the next step's exchange can start from its gradients alone."""
        return False

    def _syncs_local_steps(self) -> bool:
        """Whether this step synchronises local steps the ranks took apart (0/1 Adam)."""
        return False

    def _unsynced(self, idx: list[int]) -> torch.Tensor:
        """Per parameter of ``idx`` (layout indices), on its device: whether this rank has local
        steps of it to synchronise (asked only where ``_syncs_local_steps``)."""
        raise NotImplementedError

    def _on_layout(self) -> None:
        """Work after the flat buffers were (re)built."""

    def _on_freeze(self) -> None:
        """What the algorithm does when its phase switches."""

    def _on_foreign_load(self) -> None:
        """After loading torch Adam's state dict: note what is missing."""

    def _ready_to_switch(self) -> bool:
        """Whether the first phase's state is complete enough to freeze."""
        return True

    def _joins_allowed(self) -> bool:
        """Whether parameters may become trainable now (while the variance is measured)."""
        return not self.phases.switched

    def _skipped_locally(self) -> None:
        """This rank's local step (0/1 Adam's) had a non-finite gradient."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the step and the switch

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Perform one optimization step (the subclass's docstring has the algorithm).

        Args:
            closure: optional callable that re-evaluates the model and returns the loss.
        """
        self._apply_last_step()  # the last step's, if on the device (may raise: diverged)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._rebuild_if_stale()
        if not self._grads_checked:
            self._grads_checked = check_grads_are_local(self)
        if self.overlap is not None:  # buckets the overlap started
            self.overlap.collect()
        self.counters.start_step()
        if self.rescale.due and self.verdict.uses_device(self.flat.layout.device):
            self.rescale.reduce_(self.flat, self.param_groups)  # the host knows the verdict
        counters = snapshot(self, self._host_counters)
        self.step_count += 1
        self.verdict.start_step()
        unsynced = self._unsynced if self._syncs_local_steps() else None
        self._held.hold(self, params_without_grad(self), unsynced)
        try:
            self._step()
            self.watch_divergence()
        except NonFiniteError as err:
            self._held.release(self, count=False)
            restore(self, counters)
            self._skipped(err)
        finally:
            self._held.release(self)
            self.flat.gathered = set()
            if self.overlap is not None:
                self.overlap.end_step()
        self.verdict.end_step(self.step_count, counters)
        w = self.world_size
        self.counters.end_step(self.flat.layout.numel, w, self.topology.node_size(w))
        return loss

    def watch_divergence(self, now: bool = False) -> None:
        """In the compression phase, where the parameters are equal on every rank: the divergence
        watch's check (every ``divergence.every`` steps; ``now``: at once, as at the end of a fit,
        and then it warns, whatever ``on_divergence``), and what ``on_divergence`` says to do."""
        if not (self.phases.switched and self._params_agree()) or self.flat.layout is None:
            return
        found = self.divergence.check(self.flat.layout.params, self.step_count, now)
        if found is not None:
            name = self.flat.layout.name(found.index, self.param_groups, self.param_names)
            who, action = f"{type(self).__name__}: the {self.PHASES[1]} phase", self.on_divergence
            rank = 0 if self.flat.exchange is None else self.flat.exchange.rank
            action = "warn" if now else action
            self.divergence.respond(found, name, who, action, rank, self.SWITCH_OPTION)

    def _rebuild_if_stale(self) -> None:
        """(Re)build the flat buffers and the exchange where needed (``FlatState.rebuild_if_stale``)."""
        scalars = {**self._scalar_states, **self.rescale.states}
        states = self._flat_states
        if not self.phases.switched:  # the switch's states: not yet, unless loaded
            loaded = {name for pstate in self.state.values() for name in pstate}
            states = tuple(n for n in states if n not in self._switch_states or n in loaded)
        buffers = (states, scalars, self._work_buffers)
        flat, joined = self.flat, partial(check_joined, self, self._joins_allowed())
        if flat.rebuild_if_stale(
            self.param_groups, self.state, buffers, self.overlap, self.topology,
            self.verdict.uses_device, joined,
        ):  # fmt: skip
            self.divergence.reset()  # its tensors are the layout's
            self._on_layout()

    def _apply_last_step(self) -> None:
        """The host's half of the last step's device verdict (``StepVerdict.apply_last_step``)."""
        kept = self.verdict.apply_last_step(
            partial(restore, self), self._skipped, self._skipped_locally
        )
        self._held.count_missed(self, kept)  # its held parameters' missed step counts if it did

    def _skipped(self, err: NonFiniteError) -> None:
        """Drop the step on every rank, as if its batch had not been there (``StepVerdict``)."""
        rank = 0 if self.flat.exchange is None else self.flat.exchange.rank
        limit, hint = self.max_consecutive_skips, partial(divergence_hint, self)
        self.verdict.drop_step(err, step=self.step_count, limit=limit, rank=rank, hint=hint)

    @torch.no_grad()
    def freeze(self) -> None:
        """Switch to the second phase from the next ``step()`` on (on every rank between the same
        two steps; a no-op once switched): fold the bias corrections (else warn of a young
        variance), floor the variance, make the second phase's states."""
        if self.phases.switched:
            return
        self._apply_last_step()  # the last step's counts are final
        self._rebuild_if_stale()
        self._held.release(self)  # the switch step's: before the state changes meaning
        self.phases.switch()
        flat, groups, bias = self.flat, self.param_groups, bias_correction(self)
        self.window_variance.freeze_into_(flat, bias)  # int4: the variance window's estimate
        if self.rescale.enabled:  # Adam's variance as it stands: before the fold and floor
            bc2 = [bias.of(gi, j)[1] for j, gi in enumerate(flat.layout.group_of)]
            self.rescale.at_switch_(flat, bc2, self.variance_updates)
        if self.bias_correction:  # the compression phase then runs unchanged
            fold_bias_correction_(flat, groups, bias)
        warn_if_variance_is_young(self, stacklevel=3)  # (no bias correction only)
        f, to_mean, names = self.variance_floor, self.FLOOR_TO_MEAN, self.param_names
        self.floored = floor_variance_(flat, groups, f, to_mean=to_mean, names=names)
        self.flat.add_states(self._switch_states, self.state)
        self._on_freeze()
        self.flat.release_scratch()  # the warmup's: the compression phase makes what it uses
        self.coded_average.release()
        self.divergence.reset()

    def catch_up_switch(self) -> bool:
        """Switch now (between steps, on every rank) if the step count is past the switch step:
        after loading torch Adam's state, or moving the switch. Returns whether it switched."""
        self._apply_last_step()
        due = not self.phases.switched and self.step_count >= self.switch_step
        if due and self._ready_to_switch():
            self.freeze()
        return due and self.phases.switched

    @property
    def switch_step(self) -> int:
        """The step after which the built-in switch happens (``SWITCH_OPTION``; settable)."""
        return int(getattr(self, self.SWITCH_OPTION))

    @switch_step.setter
    def switch_step(self, step: int) -> None:
        check_int(self.SWITCH_OPTION, step, 0)
        setattr(self, self.SWITCH_OPTION, int(step))

    @property
    def phase(self) -> Phase:
        """The current phase, one of ``PHASES``."""
        return self.phases.current

    # ------------------------------------------------------------------ the rest of the API

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        """Each of ``OPTIONS`` with its default (from ``__init__``'s signature)."""
        return option_defaults(cls)

    @classmethod
    def check_options(cls, **options: Any) -> None:
        """Raise the ``ValueError`` the constructor would raise for these options (any of
        ``OPTIONS``; the others at their defaults), without building an optimizer."""
        raise_for_options(cls, options)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        add_checked_group(self, param_group, super().add_param_group, self._check_hparams)

    @property
    def variance(self) -> torch.Tensor | None:
        """The flat second-moment buffer (``None`` before the first step)."""
        return self.flat.states.get("exp_avg_sq")

    def variance_as_frozen(self, stride: int = 1) -> torch.Tensor | None:
        """A copy of every ``stride``-th (``>= 1``, else ``ValueError``) coordinate of the flat
        second moment as [`freeze`][lightning_onebit.optim.OneBitOptimizer.freeze] would keep it
        now (bias-corrected where it folds the correction in at the switch), or ``None`` before
        the first step; the adaptive switch compares two of these (``variance_sample``)."""
        return variance_sample(self, stride)

    @property
    def skipped_steps(self) -> int:
        """Steps dropped on every rank (or, 0/1 Adam's local steps, on one) for NaN/Inf."""
        return self.verdict.skipped_steps
