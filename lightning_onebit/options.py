"""What the Trainer strategy (:class:`~lightning_onebit.OneBitStrategy`) and the Fabric strategy
(:class:`~lightning_onebit.fabric.OneBitFabricStrategy`) share: the options and their checks,
turning the user's optimizer into the 1-bit one, the names they are registered under.

One implementation of each, used by both: the strategies differ only in how Lightning calls them.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import os
import sys
from collections.abc import Generator, Mapping
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_onebit import _deepspeed
from lightning_onebit._checks import _check_same_model_on_every_rank
from lightning_onebit._errors import misspellings, refuse_misspelled
from lightning_onebit.comm import as_average_dtype
from lightning_onebit.convert import convert_adam
from lightning_onebit.optim import OneBitAdam, OneBitLamb, OneBitOptimizer, ZeroOneAdam
from lightning_onebit.optim._base import close_all
from lightning_onebit.phase_switch import PhaseSwitch

__all__ = ["ALGORITHMS", "OneBitOptions"]

ALGORITHMS: dict[str, type[OneBitOptimizer]] = {
    "onebit_adam": OneBitAdam,
    "zero_one_adam": ZeroOneAdam,
    "onebit_lamb": OneBitLamb,
}

#: DDP options that the 1-bit strategies set themselves
_REFUSED_DDP_KWARGS = (
    "ddp_comm_state",
    "ddp_comm_hook",
    "ddp_comm_wrapper",
    "model_averaging_period",
)

_NO_FLOAT64 = (
    "precision='64-true' is not supported by {who}: the 1-bit optimizers keep "
    "their states and the compressed exchange in float32, so float64 parameters would "
    "be updated with float32 arithmetic (0/1 Adam would even round them to float32 at "
    "every synchronisation); use precision='32-true', 'bf16-mixed' or '16-mixed'"
)


def check_strategy_args(algorithm: str, timeout: Any, kwargs: dict[str, Any]) -> None:
    """The checks that come before ``DDPStrategy.__init__`` (both strategies)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {sorted(ALGORITHMS)}, got {algorithm!r}")
    if timeout is not None and not (isinstance(timeout, timedelta) and timeout > timedelta(0)):
        raise ValueError(
            f"timeout must be a datetime.timedelta > 0 or None, got {timeout!r}; "
            "e.g. timeout=timedelta(minutes=30)"
        )
    if any(kwargs.get(k) is not None for k in _REFUSED_DDP_KWARGS):
        raise ValueError(
            "OneBitStrategy installs its own DDP communication hook (and averages no "
            f"models); remove {'/'.join(_REFUSED_DDP_KWARGS)}"
        )


#: the algorithms' options among the strategies' arguments (passed on to the optimizer): read
#: from the optimizers' own ``OPTIONS``, where each is declared with its default and checks
OPTIMIZER_OPTIONS = tuple(dict.fromkeys(k for cls in ALGORITHMS.values() for k in cls.OPTIONS))


#: options the strategies set (unless given) when they build the optimizer, where that differs
#: from the optimizer's own default (DeepSpeed's arithmetic)
CONVERSION_DEFAULTS: dict[str, dict[str, Any]] = {
    "onebit_adam": {"rescale_variance": True},
    "zero_one_adam": {"compressed_variance_phase": False, "rescale_variance": True},
}


class OneBitOptions:
    """The options of both strategies (validated at construction) and what they do with them:
    the optimizer's keyword arguments, the conversion of a torch Adam/AdamW."""

    algorithm: str

    def _set_options(self, given: Mapping[str, Any]) -> None:
        """Validate and keep the options in ``given`` (the constructor's arguments by name)."""
        algorithm, freeze_step = given["algorithm"], given["freeze_step"]
        adaptive_freeze, freeze_threshold = given["adaptive_freeze"], given["freeze_threshold"]
        freeze_window, lamb_lr = given["freeze_window"], given["lamb_lr"]
        overlap_bucket_mb, average_dtype = given["overlap_bucket_mb"], given["average_dtype"]
        timeout, start_method = given["timeout"], given["start_method"]
        optimizer_options = {k: given[k] for k in OPTIMIZER_OPTIONS}
        self.algorithm = algorithm
        self.start_method = start_method
        self.timeout = timeout
        self.freeze_step = PhaseSwitch(
            freeze_step, adaptive_freeze, freeze_threshold, freeze_window
        ).freeze_step  # (validated now: the switch itself is built where it runs)
        self.optimizer_options = optimizer_options
        self._validate_optimizer_options()
        if lamb_lr is not None and not (
            isinstance(lamb_lr, (int, float)) and not isinstance(lamb_lr, bool) and lamb_lr > 0
        ):
            raise ValueError(f"lamb_lr must be a number > 0 or None, got {lamb_lr!r}")
        self.lamb_lr = lamb_lr
        if overlap_bucket_mb is not None and not (
            isinstance(overlap_bucket_mb, (int, float))
            and not isinstance(overlap_bucket_mb, bool)
            and 0 < overlap_bucket_mb < float("inf")
        ):
            raise ValueError(
                f"overlap_bucket_mb must be a number in (0, inf) or None (no overlap), got "
                f"{overlap_bucket_mb!r}"
            )
        self.overlap_bucket_mb = overlap_bucket_mb
        self.average_dtype = None if average_dtype is None else as_average_dtype(average_dtype)
        hierarchical = given["hierarchical"]
        if hierarchical not in (True, False, "auto"):
            raise ValueError(f"hierarchical must be True, False or 'auto', got {hierarchical!r}")
        self.hierarchical = hierarchical
        self._converted_optimizer = False  # the strategy built the optimizer from Adam/AdamW
        self._lr_scale = 1.0  # what the conversion multiplied the learning rates by

    def _validate_optimizer_options(self) -> None:
        """Each optimizer's own checks, now, before any process starts. Every algorithm's
        options are checked, not only the chosen one's: a bad value is a mistake even where
        this algorithm ignores it."""
        for cls in ALGORITHMS.values():
            cls.check_options(**self._given_options(cls))

    def _given_options(self, cls: type[OneBitOptimizer]) -> dict[str, Any]:
        """The options of ``cls`` given to this strategy (``None``: the optimizer's default)."""
        return {
            k: v for k, v in self.optimizer_options.items() if k in cls.OPTIONS and v is not None
        }

    def _algorithm_kwargs(
        self, cls: type[OneBitOptimizer], defaults: dict[str, Any]
    ) -> dict[str, Any]:
        kw = dict(defaults)
        given = self._given_options(ALGORITHMS[self.algorithm])
        kw.update(CONVERSION_DEFAULTS.get(self.algorithm, {}))
        if "var_update_scaler" in given:  # the paper's variance schedule, asked for by name
            kw.pop("compressed_variance_phase", None)  # (as a DeepSpeed config does)
        kw.update(given)
        kw["average_warmup_grads"] = False  # DDP averages the warmup gradients (see the hook)
        kw["average_dtype"] = self.average_dtype or torch.float32
        return kw

    def _onebit_optimizer_from(
        self, original: torch.optim.Optimizer, given: str, expected: str
    ) -> OneBitOptimizer:
        """The 1-bit optimizer to train with: ``original`` itself if it is one, else built from
        a torch Adam/AdamW (``self._lr_scale``: what its learning rates were multiplied by; the
        caller re-points the LR schedulers). ``given``/``expected`` name where the optimizer came
        from in messages ("configure_optimizers returned" / "configure_optimizers must return")."""
        if isinstance(original, OneBitOptimizer):
            if type(original) is not ALGORITHMS[self.algorithm]:
                rank_zero_warn(
                    f"{given} {type(original).__name__}, but the strategy is "
                    f"{self.algorithm!r} ({ALGORITHMS[self.algorithm].__name__}): training with "
                    f"{type(original).__name__} as built (the strategy's algorithm and optimizer "
                    "options apply when it converts a torch.optim.Adam/AdamW)"
                )
            original.average_warmup_grads = False
            if self.average_dtype is not None:
                original.average_dtype = self.average_dtype
            new = original
        elif type(original) in (torch.optim.Adam, torch.optim.AdamW):
            cls = ALGORITHMS[self.algorithm]
            new, self._lr_scale = convert_adam(
                original,
                cls,
                self.algorithm,
                lambda defaults: self._algorithm_kwargs(cls, defaults),
                self.lamb_lr,
            )
            self._converted_optimizer = True
        else:
            raise MisconfigurationException(
                f"OneBitStrategy cannot run {type(original).__name__}: {expected} "
                "torch.optim.Adam, torch.optim.AdamW, or one of lightning_onebit.optim.OneBitAdam / "
                "ZeroOneAdam / OneBitLamb"
            )
        _check_same_model_on_every_rank(
            [
                (f"param_groups[{gi}][{i}]", tuple(p.shape))
                for gi, g in enumerate(new.param_groups)
                for i, p in enumerate(g["params"])
            ]
        )
        return new

    def _optimizer_from_hparams(
        self, params: list[torch.nn.Parameter], hparams: dict[str, Any], where: str
    ) -> OneBitOptimizer:
        """The chosen algorithm's optimizer over ``params`` (one group) with ``hparams`` (lr,
        betas, ...; e.g. a DeepSpeed config's)."""
        cls = ALGORITHMS[self.algorithm]
        new = cls(params, **self._algorithm_kwargs(cls, dict(hparams or {})))
        rank_zero_info(f"OneBitStrategy: {cls.__name__} from the {where} ({hparams or 'defaults'})")
        return new

    def _init_from_deepspeed_config(self, cls: type, given: Mapping[str, Any]) -> None:
        """``cls.__init__`` with the options of ``given["deepspeed_config"]`` merged in (an
        argument given explicitly wins; ``given``: the constructor's ``locals()``), the config's
        optimizer hyperparameters kept in ``self.deepspeed_optimizer``, and one warning naming
        what the config sets without effect here."""
        given = {k: v for k, v in given.items() if k not in ("self", "__class__")}
        defaults = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()}
        args, hparams, note = _deepspeed.strategy_arguments(given, defaults)
        cls.__init__(self, **args)
        self.deepspeed_optimizer = hparams
        if note:
            rank_zero_warn(note, category=UserWarning)

    @staticmethod
    def _refuse_float64(who: str) -> None:
        raise ValueError(_NO_FLOAT64.format(who=who))


def register_names(cls: type, strategy_registry: Any) -> None:
    """Register ``cls`` under every algorithm's names (the same in the Trainer's and in Fabric's
    registry): ``<algorithm>``, the fork-started ``<algorithm>_notebook`` and their
    ``_find_unused_parameters_true`` variants; near-miss names raise an error naming the right one."""
    for algorithm in ALGORITHMS:
        for name, start_method in ((algorithm, "popen"), (f"{algorithm}_notebook", "fork")):
            for suffix, unused in (("", False), ("_find_unused_parameters_true", True)):
                if name + suffix in strategy_registry:
                    continue  # a second import (or registration) must not fail
                strategy_registry.register(
                    name + suffix,
                    cls,
                    description=f"1-bit compressed DDP ({algorithm}), "
                    f"start_method={start_method!r}, find_unused_parameters={unused}",
                    algorithm=algorithm,
                    start_method=start_method,
                    find_unused_parameters=unused,
                )
    # near-miss names ("onebit-adam", "1bit_adam", "OneBitAdam"): an error naming the right one
    canonical = set(strategy_registry)
    for algorithm in ALGORITHMS:
        for name, meant in misspellings(algorithm, canonical).items():
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    partial(refuse_misspelled, name, meant),
                    description=f"not a name: did you mean {meant!r}?",
                )


def check_no_inherited_group(expected: int) -> None:
    """Refuse a process group inherited through fork from an earlier run in the parent process
    (e.g. a notebook that ran devices=1 under plain DDP). Its first collective would never
    return, and it cannot be destroyed from a forked child."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() != expected:
        raise RuntimeError(
            f"a torch.distributed process group of world size {dist.get_world_size()} from an "
            f"earlier run is still initialised in this process, but this run has {expected} "
            "ranks; call torch.distributed.destroy_process_group() before Trainer.fit"
        )


def notebook_message(algorithm: str, cls_name: str) -> str:
    """Why a script-launched strategy cannot run in a notebook, and what to use instead."""
    return (
        f"strategy={algorithm!r} starts each rank by running your script again, and "
        "an interactive session (a notebook, the Python shell) has none: use "
        f"strategy='{algorithm}_notebook' (fork-started ranks), or "
        f"{cls_name}(algorithm='{algorithm}', start_method='fork')"
    )


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


def configure_hierarchy(
    opt: OneBitOptimizer, hierarchical: bool | str, ranks_per_node: int
) -> None:
    """Give ``opt`` the strategy's two-level setting and the launch's layout (``ranks_per_node``
    processes per node), and build its groups now (collective: every rank at setup, before the
    first backward needs them); one info line when it is on."""
    opt.hierarchical, opt.ranks_per_node = hierarchical, ranks_per_node or None
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


def one_thread_per_forked_rank(start_method: str, num_processes: int) -> None:
    """GNU OpenMP cannot run a parallel region in a forked child once the parent has used its
    thread pool (the child waits forever for threads that did not survive the fork), and a
    notebook's parent process usually has. One thread per fork-started rank."""
    if start_method == "fork" and num_processes > 1:
        torch.set_num_threads(1)


def stop_overlaps(optimizers: list[Any], hook_state: Any = None) -> None:
    """At teardown: stop the overlap (its thread, hooks and process groups), destroy the
    two-level exchange's groups, stop the DDP hook's thread: nothing the strategy or the
    optimizer started outlives the fit."""
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)  # (LightningOptimizer)
        if isinstance(opt, OneBitOptimizer):
            if opt.overlaps_backward:
                opt.overlap_with_backward(None)
            opt.close()
    if hook_state is not None:
        hook_state.close()


#: the default process group a 1-bit strategy created (see own_default_group), with the id of
#: the process that created it
_owned: tuple[int, Any] | None = None
#: what a forked process inherited in ``_owned`` from its parent: kept, never released there (the
#: group's threads stayed in the parent, and its destructor would wait for them forever)
_inherited: list[tuple[int, Any]] = []
_destroy_registered = False


@contextlib.contextmanager
def own_default_group() -> Generator[None, None, None]:
    """Around the strategy's process-group setup: a default group it creates there is destroyed
    at interpreter exit, while the interpreter is still whole.

    Lightning leaves the default group initialised after ``fit`` (the next ``fit``/``test``
    reuses it), and torch's C++ side keeps it alive past the interpreter's shutdown: left there,
    its gloo threads, sockets and the rank-0 store are torn down by C++ static destructors,
    which can abort a finished run ("terminate called without an active exception", exit
    status -6 on a rank). The group stays usable until exit (``torch.distributed`` after
    ``fit`` works as under DDP); one destroyed or replaced by the user is left alone, as is one
    that existed before (the user's: they destroy it), and, after an uncaught exception, any
    (another rank may still be inside a collective on it: destroying could block).
    """
    existed = dist.is_available() and dist.is_initialized()
    yield
    if existed or not (dist.is_available() and dist.is_initialized()):
        return
    global _owned, _destroy_registered
    _forget_owned()
    _owned = (os.getpid(), dist.group.WORLD)
    if not _destroy_registered:
        atexit.register(_destroy_owned_group)
        _destroy_registered = True


def _forget_owned() -> None:
    """Drop ``_owned``; a copy inherited through ``fork`` is kept aside instead (see
    ``_inherited``)."""
    global _owned
    if _owned is not None and _owned[0] != os.getpid():
        _inherited.append(_owned)
    _owned = None


def _destroy_owned_group() -> None:
    owned = _owned
    _forget_owned()
    if owned is None or owned[0] != os.getpid() or getattr(sys, "last_value", None) is not None:
        return  # (none, a parent's, or after an uncaught exception)
    close_all()  # (the optimizers' own groups first: Fabric never tears its strategy down)
    if dist.is_initialized() and dist.group.WORLD is owned[1]:
        with contextlib.suppress(Exception):  # a peer already gone: the exit goes on as before
            dist.destroy_process_group()


def destroy_single_process_group() -> None:
    """At teardown: a single-process run initialised a group in this process; leaving it would
    be inherited by the ranks of a later fork-started run (notebooks) and break them."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == 1:
        _forget_owned()
        dist.destroy_process_group()


def warn_single_process(algorithm: str) -> None:
    rank_zero_warn(
        f"{algorithm} with a single process (devices=1, num_nodes=1) has nobody to "
        "exchange with: it sends nothing either way, and its steps are those of a "
        "1-rank 1-bit run (compressed momentum), not Adam's. Use it to debug; train on "
        "one device with strategy='auto' and torch.optim.Adam/AdamW"
    )
