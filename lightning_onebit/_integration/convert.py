"""Converting a torch Adam/AdamW into a 1-bit optimizer: group keys, learning-rate scaling
(``lamb_lr``), the LR schedulers that drove the original (the ones they hold included), and what
is said about it."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_onebit._compat import mark_step_for_lr_schedulers
from lightning_onebit.optim import OneBitOptimizer
from lightning_onebit.optim._validation import REFUSED_FLAGS, check_group_flags

__all__ = [
    "convert_adam",
    "repoint_schedulers",
    "rescale_restored_lrs",
    "schedulers_of",
    "warn_about_unscaled_schedulers",
    "warn_if_config_differs",
]

#: torch Adam/AdamW group keys with no effect on the math: dropped (said in the message)
_DROPPED = ("foreach", "fused")

#: torch Adam/AdamW implementation switches the 1-bit optimizers refuse when ``True``
#: (``check_group_flags`` says why): dropped where ``False``
#: learning rates that converting to 1-bit LAMB with ``lamb_lr`` rescales: param-group keys
#: (torch's schedulers keep their own there) and LR scheduler attributes
_LR_GROUP_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")


_TORCH_SCHEDULER_GROUP_KEYS = ("max_momentum", "base_momentum")


_LR_SCHEDULER_ATTRS = ("base_lrs", "max_lrs", "min_lrs", "eta_min", "_last_lr")


_SCHEDULER_TYPES = (
    torch.optim.lr_scheduler.LRScheduler,
    torch.optim.lr_scheduler.ReduceLROnPlateau,
)


def _plain(value: Any) -> Any:
    """Hyperparameters as Python numbers (torch allows 0-dim tensors for lr/betas)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


def _repoint_scheduler(
    scheduler: Any,
    old: torch.optim.Optimizer,
    new: torch.optim.Optimizer,
    lr_scale: float,
    error: type[Exception],
) -> None:
    """Make an LR scheduler built for ``old`` drive ``new`` (same groups, same order).

    Every reference to ``old`` is replaced, in the scheduler and in the schedulers it holds
    (SequentialLR's and ChainedScheduler's children, or a custom scheduler's), and their
    absolute learning rates (``base_lrs``, ``eta_min``, ...) are multiplied by ``lr_scale``.
    """
    found = False
    for obj in _schedulers_within(scheduler):
        for key, value in vars(obj).items():
            if value is old:
                setattr(obj, key, new)
                found = True
            elif isinstance(value, list) and any(v is old for v in value):
                setattr(obj, key, [new if v is old else v for v in value])
                found = True
        if lr_scale != 1.0:
            for key in _LR_SCHEDULER_ATTRS:
                value = getattr(obj, key, None)
                if isinstance(value, list):
                    setattr(obj, key, [v * lr_scale for v in value])
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    setattr(obj, key, value * lr_scale)
    if not found:
        raise error(
            f"LR scheduler {type(scheduler).__name__} does not drive the optimizer given to the "
            "strategy: build it on that optimizer"
        )
    # torch wraps optimizer.step to warn when scheduler.step() comes first; wrap the new one too
    mark_step_for_lr_schedulers(new)


def repoint_schedulers(
    schedulers: list[Any],
    old: torch.optim.Optimizer,
    new: torch.optim.Optimizer,
    lr_scale: float,
    error: type[Exception],
) -> None:
    """Make every LR scheduler built for ``old`` drive ``new`` (see ``_repoint_scheduler``);
    warn about learning rates that ``lr_scale`` could not reach. ``error``: raised for a
    scheduler that does not drive ``old``."""
    for scheduler in schedulers:
        _repoint_scheduler(scheduler, old, new, lr_scale, error)
    if lr_scale != 1.0:
        warn_about_unscaled_schedulers(schedulers, old)


def _scale_group_lrs(groups: list[dict[str, Any]], lr_scale: float) -> None:
    """Multiply the learning rates the param groups hold (``_LR_GROUP_KEYS``) by ``lr_scale``."""
    for g in groups:
        for k in _LR_GROUP_KEYS:
            if isinstance(g.get(k), (int, float)):
                g[k] *= lr_scale


def rescale_restored_lrs(
    opt: OneBitOptimizer, schedulers: list[Any], lr_scale: float, error: type[Exception]
) -> None:
    """After restoring a checkpoint of torch's Adam (e.g. from ``strategy="ddp"``) into a
    converted 1-bit LAMB: scale its learning rates (param groups, schedulers) by ``lr_scale``,
    as the conversion scaled the ones the user built. Once per load."""
    if not opt.loaded_foreign or lr_scale == 1.0:
        return
    opt.loaded_foreign = False
    _scale_group_lrs(opt.param_groups, lr_scale)
    repoint_schedulers(schedulers, opt, opt, lr_scale, error)
    rank_zero_info(
        f"{type(opt).__name__}: the checkpoint holds torch Adam's learning rates; scaled by "
        f"{lr_scale:g} (lamb_lr), as the conversion scaled the optimizer's own"
    )


def schedulers_of(optimizer: torch.optim.Optimizer) -> list[Any]:
    """The LR schedulers (torch's, or any object with an ``optimizer`` attribute that is one of
    torch's scheduler types) that hold ``optimizer``, found among its referrers: a Fabric user
    builds them before ``fabric.setup`` and may not pass them to it. The outermost ones only
    (a SequentialLR's children are re-pointed through it)."""
    found: list[Any] = []
    for obj in gc.get_referrers(optimizer):
        if isinstance(obj, dict):  # an instance's __dict__: its owner
            owners = [o for o in gc.get_referrers(obj) if getattr(o, "__dict__", None) is obj]
        else:
            owners = [obj]
        for o in owners:
            if isinstance(o, _SCHEDULER_TYPES) and not any(o is f for f in found):
                found.append(o)
    children = [c for s in found for c in _schedulers_within(s)[1:]]
    return [s for s in found if not any(s is c for c in children)]


def _schedulers_within(scheduler: Any) -> list[Any]:
    """``scheduler`` and every scheduler it holds, at any depth (each once)."""
    found: list[Any] = []
    todo = [scheduler]
    while todo:
        obj = todo.pop()
        if any(obj is f for f in found):
            continue
        found.append(obj)
        for value in vars(obj).values():
            for v in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(v, _SCHEDULER_TYPES):
                    todo.append(v)
    return found


# --------------------------------------------------------------------------- the conversion


def convert_adam(
    original: torch.optim.Optimizer,
    cls: type[OneBitOptimizer],
    algorithm: str,
    options: Callable[[dict[str, Any]], dict[str, Any]],
    lamb_lr: float | None,
    *,
    strategy: str,
    error: type[Exception],
) -> tuple[OneBitOptimizer, float]:
    """Build the 1-bit optimizer ``cls`` from a torch Adam/AdamW with the same groups and
    settings; ``options(defaults)`` gives its constructor's keyword arguments. Returns it and
    what the learning rates were multiplied by (``lamb_lr``, 1-bit LAMB only). ``strategy``
    names the strategy class in messages; ``error`` is raised for a flag that cannot be honoured."""
    d = original.defaults
    for gi, g in enumerate(original.param_groups):
        try:
            check_group_flags(algorithm, gi, g)
        except ValueError as err:
            raise error(f"{type(original).__name__}'s {err}") from None
    # Every group key is kept (LR schedulers store their own there: OneCycleLR's max_lr,
    # min_lr, max_momentum, ...) except torch's implementation switches: the refused ones
    # (False), those with no effect on the math, and maximize where False (the default).
    # decoupled_weight_decay is kept where False: torch Adam's L2 term, computed as Adam does.
    decoupled = isinstance(original, torch.optim.AdamW)
    groups = []
    for g in original.param_groups:
        group = {
            k: v if k == "params" else _plain(v)
            for k, v in g.items()
            if k not in (*_DROPPED, *REFUSED_FLAGS, "maximize", "decoupled_weight_decay")
        }
        if g.get("maximize", False):
            group["maximize"] = True
        if not g.get("decoupled_weight_decay", decoupled):
            group["decoupled_weight_decay"] = False
        groups.append(group)
    defaults = {k: _plain(d[k]) for k in ("lr", "betas", "eps", "weight_decay") if k in d}
    lr_scale = _lamb_lr_scale(algorithm, lamb_lr, defaults.get("lr"), strategy)
    if lr_scale != 1.0:
        _scale_group_lrs(groups, lr_scale)
        defaults["lr"] *= lr_scale
    new = cls(groups, **options(defaults))
    robust = ", ".join(
        f"{k}={getattr(new, k)}"
        for k in (*OneBitOptimizer.OPTIONS, "rescale_variance", "compressed_variance_phase")
        if k in cls.OPTIONS
    )
    dropped = sorted({k for g in original.param_groups for k in _DROPPED if g.get(k)})
    rank_zero_info(
        f"{strategy}: replaced {type(original).__name__} by {cls.__name__} "
        f"({len(groups)} param group(s), {_describe_groups(new.param_groups)}; {robust})"
        + (
            f"; dropped {', '.join(f'{k}=True' for k in dropped)} (no effect on the math: "
            f"{cls.__name__} runs its own fused kernels)"
            if dropped
            else ""
        )
    )
    return new, lr_scale


#: the group hyperparameters the conversion message shows
_SHOWN = ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay", "maximize")


def _describe_groups(groups: list[dict[str, Any]]) -> str:
    """The first group's hyperparameters, then each other group's where they differ from it."""

    def value(g: dict[str, Any], k: str) -> Any:
        return g.get(k, {"decoupled_weight_decay": True, "maximize": False}.get(k))

    first = groups[0]
    parts = [", ".join(f"{k}={value(first, k)}" for k in _SHOWN)]
    for gi, g in enumerate(groups[1:], start=1):
        differ = [f"{k}={value(g, k)}" for k in _SHOWN if value(g, k) != value(first, k)]
        if differ:
            parts.append(f"group {gi}: {', '.join(differ)}")
    return "; ".join(parts)


def _lamb_lr_scale(
    algorithm: str, lamb_lr: float | None, adam_lr: float | None, strategy: str
) -> float:
    """What converting Adam/AdamW to 1-bit LAMB multiplies the learning rates by."""
    if algorithm != "onebit_lamb":
        return 1.0
    if lamb_lr is None:
        rank_zero_warn(
            f"onebit_lamb runs at the converted optimizer's lr={adam_lr}, which was chosen for "
            "Adam: LAMB scales each layer's step by ||p|| / ||u|| and usually wants another "
            f"lr. Pass {strategy}(algorithm='onebit_lamb', lamb_lr=...) (it rescales "
            "every group and LR scheduler), or give the strategy a lightning_onebit.OneBitLamb "
            "of your own"
        )
        return 1.0
    return lamb_lr / adam_lr if adam_lr else 1.0


def warn_about_unscaled_schedulers(schedulers: list[Any], original: torch.optim.Optimizer) -> None:
    """``lamb_lr`` rescales what torch's schedulers hold; a user's own may hold more."""
    custom = sorted(
        {
            type(s).__name__
            for scheduler in schedulers
            for s in _schedulers_within(scheduler)
            if not type(s).__module__.startswith("torch.")
        }
    )
    if not custom:
        return
    known = {"params", *_LR_GROUP_KEYS, *original.defaults, *_TORCH_SCHEDULER_GROUP_KEYS}
    keys = sorted({k for g in original.param_groups for k in g if k not in known})
    rank_zero_warn(
        f"lamb_lr rescaled the learning rates in the param groups ({', '.join(_LR_GROUP_KEYS)}) "
        f"and those torch's LR schedulers hold, but {', '.join(custom)} is not one of torch's: "
        "learning rates it keeps elsewhere"
        + (f" (param-group keys {keys})" if keys else "")
        + " were not rescaled. Give the strategy a lightning_onebit.OneBitLamb(lr=...) of your "
        "own to build the schedule for LAMB's lr yourself"
    )


def warn_if_config_differs(
    original: torch.optim.Optimizer,
    config: dict[str, Any],
    given: str,
    instead: str,
) -> None:
    """A DeepSpeed config's optimizer params that the user's torch optimizer overrides
    (``given``: where it came from, e.g. "fabric.setup got"; ``instead``: what to do to use the
    config's, or "")."""
    d = original.defaults
    differ = {k: (v, _plain(d[k])) for k, v in config.items() if k in d and _plain(d[k]) != v}
    if differ:
        shown = ", ".join(f"{k}={mine!r} (config: {cfg!r})" for k, (cfg, mine) in differ.items())
        rank_zero_warn(
            f"{given} {type(original).__name__} with {shown}: its hyperparameters are used, "
            f"the DeepSpeed config's optimizer params are not{instead}"
        )
