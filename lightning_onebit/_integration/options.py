"""The options of both 1-bit strategies, declared, held and validated in one place.

``StrategyOptions`` declares every option
once: its fields give the name, type and default, its docstring's ``Args`` the meaning. Both
strategies' ``__init__`` signatures and the ``Args`` of their docstrings are made from it when
the classes are defined (``strategy_base.takes_options``), so ``inspect.signature``, ``help()``,
IPython's completion, the API reference and LightningCLI (jsonargparse: typed options, ranges,
help text, ``--print_config``) all read every option with its type and default. Why not
``**kwargs: Unpack[TypedDict]``, which jsonargparse also reads: a TypedDict holds no defaults
(``--help`` and ``--print_config`` would show none, ``inspect.signature`` only ``**kwargs``), and
the strategies' ``**kwargs`` also takes DDP's own options. What only static analysis sees (a
type checker, an editor without a running interpreter) is ``*args, **kwargs`` plus each
strategy's own options.

The types of the numeric options (``NonNegativeInt``, ``PositiveFloat``, ...) live here too:
``int`` and ``float`` as far as Python and type checkers are concerned, and, where jsonargparse
is installed, its range-checked types, so that LightningCLI refuses a value out of range while
it parses a config (a short parse error) instead of the constructor raising from inside its
instantiation (a traceback of 50 lines). The constructors check every value as before. The
checks, the defaults the strategies apply when they build the optimizer, and the merge of a
DeepSpeed config live here as well.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from lightning_onebit._integration import deepspeed
from lightning_onebit._integration.front_end import FrontEnd
from lightning_onebit._integration.phase_switch import PhaseSwitch
from lightning_onebit.comm import CODED_BITS, as_average_dtype
from lightning_onebit.optim import (
    DIVERGENCE_ACTIONS,
    OneBitAdam,
    OneBitLamb,
    OneBitOptimizer,
    ZeroOneAdam,
)
from lightning_onebit.optim._coded_average import check_coded, check_variance_window

__all__ = [
    "ALGORITHMS",
    "CONVERSION_DEFAULTS",
    "OPTIMIZER_OPTIONS",
    "REFUSED_DDP_KWARGS",
    "AboveZeroToOne",
    "AtLeastOne",
    "NonNegativeFloat",
    "NonNegativeInt",
    "OpenUnitInterval",
    "PositiveFloat",
    "PositiveInt",
    "StrategyOptions",
    "ZeroToBelowOne",
]

# The numeric options' types (see the module's docstring). Each range is the constructor's own
# check of that option; where that check has a bound the type cannot know (min_coeff <=
# max_coeff, overlap_bucket_mb < inf), the constructor still refuses what the type lets through.
if TYPE_CHECKING:
    NonNegativeInt = PositiveInt = int
    NonNegativeFloat = PositiveFloat = OpenUnitInterval = float
    ZeroToBelowOne = AboveZeroToOne = AtLeastOne = float
else:
    try:
        from jsonargparse.typing import (
            NonNegativeFloat,
            NonNegativeInt,
            OpenUnitInterval,
            PositiveFloat,
            PositiveInt,
            restricted_number_type,
        )
    except ImportError:  # no LightningCLI here
        NonNegativeInt = PositiveInt = int
        NonNegativeFloat = PositiveFloat = OpenUnitInterval = float
        ZeroToBelowOne = AboveZeroToOne = AtLeastOne = float
    else:
        ZeroToBelowOne = restricted_number_type(
            "ZeroToBelowOne", float, [(">=", 0.0), ("<", 1.0)], docstring="a float in [0, 1)"
        )
        AboveZeroToOne = restricted_number_type(
            "AboveZeroToOne", float, [(">", 0.0), ("<=", 1.0)], docstring="a float in (0, 1]"
        )
        AtLeastOne = restricted_number_type(
            "AtLeastOne", float, (">=", 1.0), docstring="a float >= 1"
        )

ALGORITHMS: dict[str, type[OneBitOptimizer]] = {
    "onebit_adam": OneBitAdam,
    "zero_one_adam": ZeroOneAdam,
    "onebit_lamb": OneBitLamb,
}

#: the algorithms' options among the strategies' arguments (passed on to the optimizer): read
#: from the optimizers' own ``OPTIONS``, where each is declared with its default and checks
OPTIMIZER_OPTIONS = tuple(dict.fromkeys(k for cls in ALGORITHMS.values() for k in cls.OPTIONS))

#: options the strategies set (unless given) when they build the optimizer, where that differs
#: from the optimizer's own default (which is DeepSpeed's arithmetic): torch Adam's bias
#: correction, and the variance rescaling. ``deepspeed_compatible`` sets none of them.
CONVERSION_DEFAULTS: dict[str, dict[str, Any]] = {
    "onebit_adam": {"bias_correction": True, "rescale_variance": True},
    "zero_one_adam": {
        "bias_correction": True,
        "compressed_variance_phase": False,
        "rescale_variance": True,
    },
    "onebit_lamb": {"bias_correction": True},
}

#: DDP options that the 1-bit strategies set themselves
REFUSED_DDP_KWARGS = (
    "ddp_comm_state",
    "ddp_comm_hook",
    "ddp_comm_wrapper",
    "model_averaging_period",
)


def _builtin(value: Any) -> Any:
    """``value`` as a plain ``int`` or ``float`` where it is an instance of a subclass of one (a
    range-checked type of jsonargparse's): what the options hold goes into param groups,
    checkpoints (loaded with ``weights_only=True``) and messages."""
    for kind in (float, int):
        if isinstance(value, kind) and type(value) is not kind and not isinstance(value, bool):
            return kind(value)
    return value


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class StrategyOptions:
    """The options of [OneBitStrategy][lightning_onebit.OneBitStrategy] and
    [OneBitFabricStrategy][lightning_onebit.OneBitFabricStrategy], validated at construction,
    before any process starts. ``freeze_step`` and ``average_dtype`` are kept normalised (a whole
    float step count as an int; a dtype). These fields, with their types and defaults, and the
    entries below are the one declaration of the options: both strategies' signatures and
    docstrings are made from them (see the module's docstring).

    Args:
        algorithm: ``"onebit_adam"``, ``"zero_one_adam"`` or ``"onebit_lamb"``.
        freeze_step: when compression starts: an int is the number of warmup optimizer steps, a
            float in (0, 1) a fraction of the run (``Trainer.estimated_stepping_batches``;
            Fabric: the strategy's ``max_steps``). ``None`` keeps the ``freeze_step`` /
            ``var_freeze_step`` of an optimizer of ours from ``configure_optimizers`` (Fabric:
            given to ``fabric.setup``), and means 0.2 when the strategy builds the optimizer (the
            1-bit Adam paper and DeepSpeed's tutorials use 15–25%). 0/1 Adam: ``var_freeze_step``.
        adaptive_freeze: switch earlier, once the variance's relative change over
            ``freeze_window`` steps falls below ``freeze_threshold`` (identically on every
            rank); ``freeze_step`` stays the latest switch.
        freeze_threshold: relative change of the variance that counts as stable (adaptive only).
        freeze_window: steps between two variance snapshots (adaptive only).
        var_update_scaler: 0/1 Adam: variance updates between doublings of the variance interval.
            ``None`` here and for every algorithm option below (they apply to the optimizer the
            strategy builds; one from ``configure_optimizers`` keeps its own): the optimizer's
            default (``lightning_onebit.optim.ZeroOneAdam``, ...).
        local_step_scaler: 0/1 Adam: steps between doublings of the local-step interval.
            ``None``, when the strategy builds the optimizer: 0.4 of the run (decided once per
            run, like a fractional ``freeze_step``): after a switch at 0.2 the interval is 1 step
            until 0.6 of the run and 2 steps after, 25% fewer synchronisations than 1-bit
            Adam's after the switch. DeepSpeed's 32768 (the optimizer's default) with
            ``deepspeed_compatible`` or a DeepSpeed config, for an optimizer from
            ``configure_optimizers``, and where the run's length is unknown (an info line says
            so).
        local_step_clipper: 0/1 Adam: the largest local-step interval.
        compressed_variance_phase: 0/1 Adam: whether the steps between phase 1's variance steps
            exchange a 1-bit gradient (the paper's phase 1). ``None``: ``False`` when the
            strategy builds the optimizer (unless ``var_update_scaler`` is given): every step up
            to ``freeze_step`` averages uncompressed, as 1-bit Adam's warmup does.
        max_coeff: 1-bit LAMB: upper clamp of the layer-wise trust ratio
            (``lightning_onebit.optim.OneBitLamb``).
        min_coeff: 1-bit LAMB: lower clamp of the layer-wise trust ratio.
        coeff_beta: 1-bit LAMB: moving-average factor of the trust ratio in warmup.
        factor_max: 1-bit LAMB: upper clamp of the fresh-variance correction factor.
        factor_min: 1-bit LAMB: lower clamp of the fresh-variance correction factor.
        factor_threshold: 1-bit LAMB: largest relative change of the factor per step.
        trust_ratio: 1-bit LAMB: what corrects the frozen trust ratios after the switch:
            ``"update_norm"`` (LAMB's ratio of each 1-bit step against the first one's; the
            default, ``"fresh_variance"`` with ``deepspeed_compatible``) or ``"fresh_variance"``
            (DeepSpeed's, which lets the steps of a layer whose updates grow grow with them).
        bias_correction: torch Adam's bias correction in the optimizer the strategy builds (the
            warmup is then that optimizer, step for step). ``False`` is DeepSpeed's arithmetic,
            whose uncorrected variance makes 1-bit steps several times larger than Adam's after
            a short warmup. ``None``: ``True``, or ``False`` with ``deepspeed_compatible``.
        variance_floor: no coordinate's ``sqrt(v)`` counts as less than this fraction of its
            tensor's or group's RMS (the larger), so coordinates whose variance is too small to
            precondition (no gradient at all, as a conv bias before BatchNorm, or small ones,
            as some attention query/key weights) cannot take ``lr * scale / eps`` steps; the
            switch's message counts them per parameter. ``0`` is DeepSpeed's arithmetic.
        preconditioned_exchange: exchange what the optimizer sends divided by ``sqrt(v) + eps``,
            so the 1-bit error is the same size relative to every coordinate's step. ``False``
            exchanges the momentum, as DeepSpeed does.
        rescale_variance: precondition the 1-bit steps by the frozen variance times
            ``A / A_switch`` per tensor (``A``: its mean of Adam's variance, kept up to date
            from its gradients' mean square), so they stay Adam-sized as the gradients grow or
            shrink after the switch. ``None``: on for 1-bit Adam and for 0/1 Adam with
            its full-precision phase 1; ``False``: the variance stays as frozen (DeepSpeed's).
            Not an option of 1-bit LAMB.
        deepspeed_compatible: ``True``: the optimizer the strategy builds computes what
            DeepSpeed's of the same name computes with the same arguments (``bias_correction``,
            ``variance_floor``, ``preconditioned_exchange``, ``rescale_variance``,
            ``compressed_variance_phase`` take DeepSpeed's values; giving one of them another
            value raises ``ValueError``). ``None``: ``True`` with a ``deepspeed_config``, else
            ``False``.
        lamb_lr: 1-bit LAMB's learning rate when converting a torch Adam/AdamW: every learning
            rate in the groups and in torch's LR schedulers is multiplied by ``lamb_lr / lr``
            (LAMB's trust ratio rarely suits Adam's lr). ``None`` keeps Adam's lr, with a warning.
        overlap_bucket_mb: overlap the 1-bit exchange with backward, in buckets of this many MiB;
            ``None``: exchange in ``optimizer.step()``. Turned off (with an info message) under
            gradient clipping or the ``16-mixed`` loss scaler (they edit the gradients after
            backward); paused on the backward passes of gradient accumulation.
        average_dtype: the dtype of the warmup's gradient average: ``"bf16"``/``"fp16"`` send
            half the bytes of ``"float32"`` on the warmup's steps, which are DDP's and as slow
            on a slow network; their rounding (a relative 2**-9 per value for bf16) is far
            below the gradients' batch noise. ``"float32"``: the warmup is torch's Adam on
            DDP's average, step for step. ``"int4"``/``"int8"``: integer codes with a scale
            per block of 256 values and error feedback, 7.8x/3.9x fewer bytes than fp32; the
            optimizer averages them itself (DDP sends nothing), overlapped with backward in the
            buckets of ``overlap_bucket_mb`` (else in ``optimizer.step()``), and keeps the
            rounding errors (in the rank files); one level only
            (``hierarchical=False`` on several nodes). ``None``, for an optimizer the strategy
            builds: ``"int4"`` with its ``variance_window`` on CPU parameters, a one-level
            exchange and a fixed switch; ``"bf16"`` on CUDA parameters, in two levels or with
            an adaptive switch (whose step the window cannot precede); ``"float32"`` with
            ``deepspeed_compatible``. For the optimizer from ``configure_optimizers``: what it
            was given.
        variance_window: with ``average_dtype="int4"``: the warmup's last steps (a float: a
            fraction of the warmup; an int: steps) average in int8, and their squares alone
            estimate the variance the switch freezes (4-bit rounding noise would inflate it
            where values are small against their block's largest). ``None``: the steps Adam's
            variance remembers, ``1 / (1 - beta2)`` (at most the warmup; or the
            ``variance_window`` of the optimizer from ``configure_optimizers``, if it is one);
            0: every warmup step in int4.
        hierarchical: on several nodes, full precision inside a node and the 1-bit exchange
            only between nodes (``devices`` times fewer bytes through each node's link).
            ``"auto"``: on with several nodes of several processes; ``True``: the same, with a
            warning where it cannot apply; ``False``: every rank compresses its own values.
        on_divergence: what a compression phase whose parameters blow up does (each tensor's
            RMS against its RMS at the switch, checked every 16 steps on the device: more than
            10 times, or not finite): ``"warn"`` once, naming the parameter, the step and what
            to try; ``"raise"``: stop with ``lightning_onebit.optim.DivergenceError`` on every
            rank.
        timeout: collective timeout: a dead or stuck rank makes the others fail after this long;
            also bounds the creation of every process group at setup.
        start_method: how processes start: ``"popen"`` (scripts), ``"fork"`` (notebooks),
            ``"spawn"``, ``"forkserver"``.
    """

    algorithm: Literal["onebit_adam", "zero_one_adam", "onebit_lamb"] = "onebit_adam"
    freeze_step: NonNegativeInt | OpenUnitInterval | None = None
    adaptive_freeze: bool = False
    freeze_threshold: PositiveFloat = 0.05
    freeze_window: PositiveInt = 50
    var_update_scaler: PositiveInt | None = None
    local_step_scaler: PositiveInt | None = None
    local_step_clipper: PositiveInt | None = None
    compressed_variance_phase: bool | None = None
    max_coeff: PositiveFloat | None = None
    min_coeff: PositiveFloat | None = None
    coeff_beta: ZeroToBelowOne | None = None
    factor_max: AtLeastOne | None = None
    factor_min: AboveZeroToOne | None = None
    factor_threshold: NonNegativeFloat | None = None
    trust_ratio: Literal["fresh_variance", "update_norm"] | None = None
    bias_correction: bool | None = None
    variance_floor: ZeroToBelowOne | None = None
    preconditioned_exchange: bool | None = None
    rescale_variance: bool | None = None
    deepspeed_compatible: bool | None = None
    lamb_lr: PositiveFloat | None = None
    overlap_bucket_mb: PositiveFloat | None = 25.0
    average_dtype: str | torch.dtype | None = None
    variance_window: float | int | None = None
    hierarchical: bool | Literal["auto"] = "auto"
    on_divergence: Literal["warn", "raise"] = "warn"
    timeout: timedelta | None = timedelta(minutes=30)
    start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen"

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # a parsed config's range-checked int or float
            object.__setattr__(self, field.name, _builtin(getattr(self, field.name)))
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"algorithm must be one of {sorted(ALGORITHMS)}, got {self.algorithm!r}"
            )
        if self.on_divergence not in DIVERGENCE_ACTIONS:
            raise ValueError(
                f"on_divergence must be one of {list(DIVERGENCE_ACTIONS)}, got {self.on_divergence!r}"
            )
        if self.timeout is not None and not (
            isinstance(self.timeout, timedelta) and self.timeout > timedelta(0)
        ):
            raise ValueError(
                f"timeout must be a datetime.timedelta > 0 or None, got {self.timeout!r}; "
                "e.g. timeout=timedelta(minutes=30)"
            )
        switch = PhaseSwitch(
            self.freeze_step, self.adaptive_freeze, self.freeze_threshold, self.freeze_window
        )  # validated now: the switch itself is built where it runs
        object.__setattr__(self, "freeze_step", switch.freeze_step)
        # Each optimizer's own checks. Every algorithm's options are checked, not only the
        # chosen one's: a bad value is a mistake even where this algorithm ignores it.
        for cls in ALGORITHMS.values():
            cls.check_options(**self.given_options(cls))
        if self.deepspeed_compatible not in (None, True, False):
            raise ValueError(
                f"deepspeed_compatible must be True, False or None, got {self.deepspeed_compatible!r}"
            )
        if self.deepspeed_compatible:
            self._check_deepspeed_arithmetic()
        if self.lamb_lr is not None and not _positive(self.lamb_lr):
            raise ValueError(f"lamb_lr must be a number > 0 or None, got {self.lamb_lr!r}")
        if self.overlap_bucket_mb is not None and not (
            _positive(self.overlap_bucket_mb) and self.overlap_bucket_mb < float("inf")
        ):
            raise ValueError(
                f"overlap_bucket_mb must be a number in (0, inf) or None (no overlap), got "
                f"{self.overlap_bucket_mb!r}"
            )
        if self.average_dtype is not None:
            object.__setattr__(self, "average_dtype", as_average_dtype(self.average_dtype))
            check_coded(self.average_dtype, True, self.hierarchical is True)
        check_variance_window(self.variance_window, self.average_dtype)
        if self.hierarchical not in (True, False, "auto"):
            raise ValueError(
                f"hierarchical must be True, False or 'auto', got {self.hierarchical!r}"
            )

    def _check_deepspeed_arithmetic(self) -> None:
        """An option given explicitly (not ``None``) with another value than DeepSpeed's
        contradicts ``deepspeed_compatible=True``."""
        cls = ALGORITHMS[self.algorithm]
        for key, want in cls.DEEPSPEED_ARITHMETIC.items():
            value = getattr(self, key, None)
            if key in cls.OPTIONS and value is not None and value != want:
                raise ValueError(
                    f"deepspeed_compatible=True computes with DeepSpeed's {key}={want!r}, and "
                    f"{key}={value!r} was given too: drop one of the two (a DeepSpeed config "
                    "turns deepspeed_compatible on; pass deepspeed_compatible=False to keep this "
                    "library's arithmetic with it)"
                )

    @property
    def optimizer_options(self) -> dict[str, Any]:
        """The algorithms' options as given (``None``: the optimizer's default)."""
        return {k: getattr(self, k) for k in OPTIMIZER_OPTIONS}

    def given_options(self, cls: type[OneBitOptimizer]) -> dict[str, Any]:
        """The options of ``cls`` given to the strategy (not ``None``)."""
        return {
            k: v for k, v in self.optimizer_options.items() if k in cls.OPTIONS and v is not None
        }

    def optimizer_kwargs(self, hparams: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments the strategy builds the chosen algorithm's optimizer with:
        ``hparams`` (lr, betas, ...), the strategy's defaults for a built optimizer (unless
        ``deepspeed_compatible``), the options given, and the averaging settings."""
        kw = dict(hparams)
        given = self.given_options(ALGORITHMS[self.algorithm])
        if self.deepspeed_compatible:
            kw["deepspeed_compatible"] = True
        else:
            kw.update(CONVERSION_DEFAULTS[self.algorithm])
            if "var_update_scaler" in given:  # the paper's variance schedule, asked for by name
                kw.pop("compressed_variance_phase", None)  # as a DeepSpeed config does
        kw.update(given)
        # int4 where it applies: OptimizerBuilder.settle_average, once the run's layout is known
        kw["average_dtype"] = self.average_dtype or (
            torch.float32 if self.deepspeed_compatible else torch.int4
        )
        if self.variance_window is not None:
            kw["variance_window"] = self.variance_window
        # DDP averages the warmup gradients (see the hook), unless in integer codes
        kw["average_warmup_grads"] = kw["average_dtype"] in CODED_BITS
        return kw

    def with_deepspeed_config(
        self, config: str | Path | dict[str, Any] | None, front_end: FrontEnd
    ) -> tuple[StrategyOptions, dict[str, Any] | None, str | None]:
        """These options with those of a DeepSpeed ``config`` merged in (an option given here,
        i.e. not at its default, wins, and is named in the note), ``deepspeed_compatible`` on
        unless given; the config's optimizer hyperparameters; one note naming what the config
        sets without effect here, and what to do instead in ``front_end``'s terms (or ``None``).
        Without a config: ``(self, None, None)``."""
        if config is None:
            return self, None, None
        algorithm, options, hparams, notes = deepspeed.read(config, front_end)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        merged: dict[str, Any] = {}
        for key, value in options.items():
            mine = getattr(self, key)
            if mine != defaults[key] and mine != value:  # an explicit argument wins
                notes.append(f"{key}={mine!r} given as an argument (the config: {value!r})")
            else:
                merged[key] = value
        if self.deepspeed_compatible is None:
            merged["deepspeed_compatible"] = True
        note = f"DeepSpeed config ({algorithm}): " + "; ".join(notes) if notes else None
        return dataclasses.replace(self, **merged), hparams, note
