"""The 1-bit optimizer a strategy trains with: built from the user's torch Adam/AdamW (or from a
DeepSpeed config's hyperparameters), or the user's own used as built; then set up for the run
(the two-level exchange, the overlap with backward)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn import Module
from typing_extensions import override

from lightning_onebit._compat import DDPBackwardSyncControl
from lightning_onebit._integration import convert
from lightning_onebit._integration.checks import check_same_model_on_every_rank
from lightning_onebit._integration.lifecycle import warn_single_process
from lightning_onebit._integration.options import ALGORITHMS, StrategyOptions
from lightning_onebit.comm import CODED_BITS
from lightning_onebit.optim import OneBitOptimizer
from lightning_onebit.optim._coded_average import check_variance_window

__all__ = [
    "OptimizerBuilder",
    "PausingBackwardSyncControl",
    "name_parameters",
    "onebit_optimizers",
    "overlap_blocker",
    "overlap_paused",
    "stop_overlap_for_clipping",
]


class OptimizerBuilder:
    """Turns what the user gave into the strategy's 1-bit optimizer, and remembers how.

    Args:
        options: the strategy's options.
        strategy: the name of the strategy class the user built, for messages.
        error: the exception type of the user's mistakes (the Trainer's
            ``MisconfigurationException``, Fabric's ``ValueError``).
        hparams: a DeepSpeed config's optimizer hyperparameters (lr, betas, ...), or ``None``.

    Attributes:
        converted: whether the strategy built the optimizer (from a torch Adam/AdamW or from
            ``hparams``), so that its options and the default switch point apply.
        lr_scale: what the conversion multiplied the learning rates by (``lamb_lr``).
    """

    def __init__(
        self,
        options: StrategyOptions,
        strategy: str,
        error: type[Exception],
        hparams: dict[str, Any] | None = None,
    ) -> None:
        self.options = options
        self.strategy = strategy
        self.error = error
        self.hparams = hparams
        self.converted = False
        self.lr_scale = 1.0

    @property
    def derives_local_step_scaler(self) -> bool:
        """Whether the run's length sets ``local_step_scaler``: the strategy built a 0/1 Adam
        and was given no ``local_step_scaler`` and no ``deepspeed_compatible=True`` (a DeepSpeed
        config's keeps DeepSpeed's 32768 where the config names none; an optimizer from the user
        keeps its own)."""
        o = self.options
        return (
            self.converted
            and o.algorithm == "zero_one_adam"
            and o.local_step_scaler is None
            and not o.deepspeed_compatible
        )

    def from_user(
        self, original: torch.optim.Optimizer, given: str, expected: str, instead: str = ""
    ) -> OneBitOptimizer:
        """The 1-bit optimizer to train with: ``original`` itself if it is one, else built from a
        torch Adam/AdamW (the caller re-points the LR schedulers: ``repoint``).
        ``given``/``expected`` say where the optimizer came from in messages ("configure_optimizers
        returned" / "configure_optimizers must return"); ``instead``: what to do to build it from
        a DeepSpeed config's hyperparameters instead, said where they differ from its own."""
        algorithm = self.options.algorithm
        cls = ALGORITHMS[algorithm]
        if isinstance(original, OneBitOptimizer):
            self._check_own(original, given)
            if self.options.average_dtype is not None:
                original.average_dtype = self.options.average_dtype
            if self.options.variance_window is not None:
                check_variance_window(self.options.variance_window, original.average_dtype)
                original.variance_window = self.options.variance_window
            # DDP averages the warmup gradients (see the hook), unless in integer codes
            original.average_warmup_grads = original.average_dtype in CODED_BITS
            new = original
        elif type(original) in (torch.optim.Adam, torch.optim.AdamW):
            if self.hparams:
                convert.warn_if_config_differs(original, self.hparams, given, instead)
            new, self.lr_scale = convert.convert_adam(
                original,
                cls,
                algorithm,
                self.options.optimizer_kwargs,
                self.options.lamb_lr,
                strategy=self.strategy,
                error=self.error,
            )
            self.converted = True
        else:
            raise self.error(
                f"{self.strategy} cannot run {type(original).__name__}: {expected} "
                "torch.optim.Adam, torch.optim.AdamW, or one of lightning_onebit.optim.OneBitAdam / "
                "ZeroOneAdam / OneBitLamb"
            )
        check_same_model_on_every_rank(
            [
                (f"param_groups[{gi}][{i}]", tuple(p.shape))
                for gi, g in enumerate(new.param_groups)
                for i, p in enumerate(g["params"])
            ]
        )
        return new

    def _check_own(self, opt: OneBitOptimizer, given: str) -> None:
        """Say where the user's own optimizer differs from what the strategy was asked for: it
        is used as built."""
        cls = ALGORITHMS[self.options.algorithm]
        name = type(opt).__name__
        if type(opt) is not cls:
            rank_zero_warn(
                f"{given} {name}, but the strategy is {self.options.algorithm!r} "
                f"({cls.__name__}): training with {name} as built (the strategy's algorithm and "
                "optimizer options apply when it converts a torch.optim.Adam/AdamW)"
            )
        if self.options.deepspeed_compatible:
            differ = [
                f"{k}={getattr(opt, k)!r}"
                for k, v in type(opt).DEEPSPEED_ARITHMETIC.items()
                if hasattr(opt, k) and getattr(opt, k) != v
            ]
            if differ:
                rank_zero_warn(
                    f"{self.strategy}(deepspeed_compatible=True), but {given} {name} with "
                    f"{', '.join(differ)}: training with it as built, not with DeepSpeed's "
                    f"arithmetic; build it with {name}(..., deepspeed_compatible=True)"
                )

    def attach(self, opt: OneBitOptimizer | None, module: Module | None, hook: Any) -> None:
        """Once they exist: ``opt``'s parameters named after ``module``'s (for its messages) and
        ``opt`` given to the DDP hook's state ``hook`` (which asks it what each step needs)."""
        name_parameters(opt, module)
        if hook is not None:
            hook.attach(opt)

    def from_config(
        self, params: list[torch.nn.Parameter], given: str, expected: str
    ) -> OneBitOptimizer:
        """Where the user gave no optimizer (``given`` says where, e.g. "configure_optimizers
        returned"): the chosen algorithm's optimizer over ``params`` from the DeepSpeed config's
        hyperparameters (``from_hparams``). Without a config: an error saying to give one
        (``expected``: how, e.g. "return")."""
        if self.hparams is None:
            raise self.error(
                f"{self.strategy} needs an optimizer, but {given} none; {expected} "
                "torch.optim.Adam, torch.optim.AdamW, or one of "
                "lightning_onebit.optim.OneBitAdam / ZeroOneAdam / OneBitLamb"
            )
        return self.from_hparams(params, "DeepSpeed config")

    def from_hparams(self, params: list[torch.nn.Parameter], where: str) -> OneBitOptimizer:
        """The chosen algorithm's optimizer over ``params`` (one group) with ``hparams``
        (``where`` names them in the message, e.g. "DeepSpeed config")."""
        cls = ALGORITHMS[self.options.algorithm]
        new = cls(params, **self.options.optimizer_kwargs(dict(self.hparams or {})))
        self.converted = True
        rank_zero_info(
            f"{self.strategy}: {cls.__name__} from the {where} ({self.hparams or 'defaults'})"
        )
        return new

    def repoint(
        self, schedulers: list[Any], original: torch.optim.Optimizer, new: OneBitOptimizer
    ) -> None:
        """Make the LR schedulers built on ``original`` drive ``new``."""
        if new is not original:
            convert.repoint_schedulers(schedulers, original, new, self.lr_scale, self.error)

    def rescale_restored(self, opt: OneBitOptimizer, schedulers: list[Any]) -> None:
        """After a checkpoint of torch's Adam was restored into ``opt``: its learning rates
        scaled as the conversion scaled the user's (``lamb_lr``)."""
        convert.rescale_restored_lrs(opt, schedulers, self.lr_scale, self.error)

    def settle_average(self, opt: OneBitOptimizer, adaptive: bool) -> None:
        """The warmup's average where the strategy chooses it (it built ``opt``, with no
        ``average_dtype`` and no ``deepspeed_compatible``), once the run's layout is known
        (after ``set_up``, before the first step): integer codes, ``"int4"`` with its variance
        window, where they apply; else ``"bf16"`` through DDP's hook, said in one info line.
        ``adaptive``: the switch comes when the variance is stable, at a step the window's int8
        steps cannot be placed before.

        Raises:
            the strategy's ``error``: a ``variance_window`` was given where the average is not
            in int4.
        """
        o = self.options
        if not self.converted or o.average_dtype is not None or o.deepspeed_compatible:
            return
        why = None
        if opt.node_groups() is not None:
            why = "the exchange runs in two levels (the int4 average is one level only)"
        elif adaptive:
            why = "the switch is adaptive (int4's variance window must end at a known step)"
        elif any(p.device.type == "cuda" for g in opt.param_groups for p in g["params"]):
            why = "the parameters are on a CUDA device (the int4 codec is not yet checked on a GPU)"
        if why is None:
            opt.average_dtype, opt.average_warmup_grads = torch.int4, True
            return
        if o.variance_window is not None:
            raise self.error(
                f"variance_window={o.variance_window!r} applies to the int4 average, and this "
                f"run's warmup averages in bf16: {why}; drop variance_window, or pass "
                "average_dtype='int4' (one level only)"
            )
        opt.average_dtype, opt.average_warmup_grads = torch.bfloat16, False
        rank_zero_info(
            f"{self.strategy}: the warmup averages in bf16, not in int4 codes: {why}; "
            "average_dtype=... chooses"
        )

    def set_up(
        self,
        opt: OneBitOptimizer,
        ranks_per_node: int,
        world_size: int,
        clipping: bool,
        scaler: bool,
    ) -> None:
        """Set ``opt`` up for a fit: the two-level exchange on ``ranks_per_node`` processes per
        node, the overlap with backward (unless ``clipping`` or a loss ``scaler`` edits the
        gradients after backward), every process group they need (collective: every rank,
        before the first backward, bounded by the strategy's ``timeout``), and a warning for a
        single process."""
        opt.hierarchical, opt.ranks_per_node = self.options.hierarchical, ranks_per_node or None
        opt.on_divergence = self.options.on_divergence
        configure_overlap(
            opt, self.options.overlap_bucket_mb, self.options.timeout, clipping, scaler
        )
        opt.connect(self.options.timeout)
        announce_hierarchy(opt)
        if world_size == 1:
            warn_single_process(self.options.algorithm)


def configure_overlap(
    opt: OneBitOptimizer,
    bucket_mb: float | None,
    timeout: timedelta | None,
    clipping: bool,
    scaler: bool,
) -> None:
    """Overlap ``opt``'s exchange with backward in buckets of ``bucket_mb`` MiB, unless
    something edits the gradients between backward and the step (said once, as info)."""
    if bucket_mb is None:
        return
    why = overlap_blocker(clipping, scaler)
    if why is not None:
        rank_zero_info(f"1-bit exchange after backward, not overlapped with it: {why}")
        return
    opt.overlap_with_backward(bucket_mb, timeout=timeout)


def announce_hierarchy(opt: OneBitOptimizer) -> None:
    """One info line when ``opt``'s exchange runs in two levels (after its groups were made)."""
    nodes = opt.node_groups()
    if nodes is not None:
        rank_zero_info(
            f"1-bit exchange in two levels on {nodes.nodes} nodes x {nodes.local_size} ranks: "
            "full precision inside a node, 1 bit between nodes (hierarchical=False: every "
            "rank compresses its own values)"
        )


@contextlib.contextmanager
def overlap_paused(opts: list[OneBitOptimizer]) -> Generator[None, None, None]:
    """A backward without a step (gradient accumulation): the exchange must not start yet."""
    for o in opts:
        o.overlap_paused = True
    try:
        yield
    finally:
        for o in opts:
            o.overlap_paused = False


def overlap_blocker(clipping: bool, scaler: bool) -> str | None:
    """Why the exchange cannot overlap backward (``None``: it can): something edits the
    gradients between backward and the step, which an exchange started during backward misses."""
    if clipping:
        return "gradient clipping edits the gradients after backward"
    if scaler:
        return "the 16-mixed loss scaler unscales the gradients after backward"
    return None


def onebit_optimizers(optimizers: list[Any]) -> list[OneBitOptimizer]:
    """The 1-bit optimizers among a strategy's ``optimizers`` (a Trainer's
    ``LightningOptimizer`` unwrapped: its public ``optimizer``; a torch optimizer has none)."""
    found = [getattr(o, "optimizer", o) for o in optimizers]
    return [o for o in found if isinstance(o, OneBitOptimizer)]


def name_parameters(opt: OneBitOptimizer | None, module: Module | None) -> None:
    """Name ``opt``'s parameters after ``module``'s, for the optimizer's messages (e.g. the
    variance floor's); nothing until both exist."""
    if opt is not None and module is not None:
        opt.param_names = {p: n for n, p in module.named_parameters()}


def stop_overlap_for_clipping(opt: OneBitOptimizer | None, optimizer: Any) -> None:
    """Before the first ``fabric.clip_gradients`` of ``optimizer``: the exchange runs in
    ``optimizer.step()`` from now on (an exchange that backward started saw the unclipped
    gradients; one already started is dropped and redone)."""
    if opt is None or optimizer is not opt or not opt.overlaps_backward:
        return
    started = opt.flat.layout is not None  # built at the first step
    if started and opt.overlap is not None:
        opt.overlap.drop()  # what backward started saw the unclipped gradients
    opt.overlap_with_backward(None)
    # in the compression phase the optimizer warns that its error buffers restart
    rank_zero_info(
        "fabric.clip_gradients: the 1-bit exchange runs in optimizer.step() from now on, not "
        "overlapped with backward (a clipping after backward cannot reach an exchange that "
        "backward started); pass overlap_bucket_mb=None to the strategy to say so up front"
    )


class PausingBackwardSyncControl(DDPBackwardSyncControl):
    """``fabric.no_backward_sync``: DDP's ``no_sync`` and the 1-bit exchange paused (a backward
    without a step must not start the step's exchange).

    Args:
        optimizers: the strategy's 1-bit optimizers (none before ``fabric.setup``), when asked.
    """

    def __init__(self, optimizers: Callable[[], list[OneBitOptimizer]]) -> None:
        self.optimizers = optimizers

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return contextlib.nullcontext()
        return _both(overlap_paused(self.optimizers()), super().no_backward_sync(module, enabled))


@contextlib.contextmanager
def _both(
    first: AbstractContextManager, second: AbstractContextManager
) -> Generator[None, None, None]:
    with first, second:
        yield
