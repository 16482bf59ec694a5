"""Argument checks shared by the optimizers: a ``ValueError`` naming the argument, its value and
the valid range."""

from __future__ import annotations

import inspect
import math
import numbers
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from lightning_onebit.optim._base import OneBitOptimizer
    from lightning_onebit.optim._flat import Layout

__all__ = [
    "HONOURED_FLAGS",
    "REFUSED_FLAGS",
    "add_checked_group",
    "check_betas",
    "check_common_args",
    "check_grads_are_local",
    "check_group",
    "check_group_flags",
    "check_hparams",
    "check_int",
    "check_joined",
    "check_real",
    "check_shared_options",
    "deepspeed_arithmetic",
    "option_defaults",
    "raise_for_options",
]


def check_real(
    name: str,
    value: Any,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
    hint: str = "",
) -> None:
    """Raise a ValueError naming ``name``, its value and the valid range unless it is inside
    (``hint``, if given, is appended: what the range depends on, or what to do)."""
    lo, hi = ("(" if low_open else "["), (")" if high_open else "]")
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (
            value < high if high_open else value <= high
        )
    if not ok:
        raise ValueError(
            f"{name} must be a number in {lo}{low}, {high}{hi}, got {value!r}"
            + (f" ({hint})" if hint else "")
        )


def check_int(name: str, value: Any, low: int) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def check_betas(betas: Any) -> None:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    check_real("betas[0]", betas[0], 0.0, 1.0, high_open=True)
    check_real("betas[1]", betas[1], 0.0, 1.0, high_open=True)


#: torch Adam/AdamW per-group flags the 1-bit optimizers cannot honour, and why
REFUSED_FLAGS = {
    "amsgrad": "has no amsgrad variant (its variance is frozen after the warmup)",
    "capturable": "cannot be captured in a CUDA graph (its step communicates and reads "
    "its non-finite verdict on the host)",
    "differentiable": "does not differentiate through its step (it runs under no_grad, in "
    "fused kernels)",
}

#: torch Adam/AdamW per-group flags the 1-bit optimizers honour per group
HONOURED_FLAGS = ("maximize", "decoupled_weight_decay")


def add_checked_group(
    opt: OneBitOptimizer,
    group: dict[str, Any],
    add: Callable[[dict[str, Any]], None],
    check: Callable[[dict[str, Any]], None],
) -> None:
    """``opt.add_param_group(group)``: torch's ``add`` (which fills in the defaults), then the
    group checked (``check_group`` with ``check``, its hyperparameters' check) and taken
    out again if refused; a group added mid-run notes where its bias correction counts from."""
    add(group)
    gi = len(opt.param_groups) - 1
    try:
        check_group(type(opt).__name__, opt.param_groups[gi], gi, check)
    except ValueError:
        opt.param_groups.pop()  # a refused group must not stay in the optimizer
        raise
    # where its bias correction counts from (torch's __init__ adds the first groups: at 0)
    if getattr(opt, "step_count", 0) > 0:
        opt.param_groups[-1].setdefault("joined_at", (opt.step_count, opt.variance_updates))
    if hasattr(opt, "flat"):
        opt.flat.invalidate()


def check_group_flags(name: str, gi: int, group: dict[str, Any]) -> None:
    """Refuse, naming param group ``gi``, the torch flags ``name`` cannot honour (set to
    ``True``), and honoured flags that are not booleans."""
    for key, why in REFUSED_FLAGS.items():
        if group.get(key):
            raise ValueError(f"param group {gi} has {key}=True: {name} {why}; set {key}=False")
    for key in HONOURED_FLAGS:
        if key in group and not isinstance(group[key], bool):
            raise ValueError(f"param group {gi}: {key} must be True or False, got {group[key]!r}")


def check_hparams(h: dict[str, Any]) -> None:
    """Validate the hyperparameters the three optimizers share, of one param group or of the
    defaults. ``lr = 0`` is accepted: it keeps the group fixed (as in torch's Adam, e.g. a
    warmup from zero)."""
    if "initial_lr" in h:  # an LR scheduler's setting (``lr`` is its current value)
        check_real("initial_lr", h["initial_lr"], 0.0, math.inf, high_open=True,
                    hint="a learning rate >= 0")  # fmt: skip
    check_real("lr", h["lr"], 0.0, math.inf, high_open=True,
                hint="a learning rate >= 0; 0 keeps the parameters fixed")  # fmt: skip
    check_betas(h["betas"])
    check_real("eps", h["eps"], 0.0, math.inf, low_open=True, high_open=True,
                hint="a small positive number, e.g. 1e-8")  # fmt: skip
    check_real("weight_decay", h["weight_decay"], 0.0, math.inf, hint="0 for none")


def check_group(
    name: str, group: dict[str, Any], gi: int, check: Callable[[dict[str, Any]], None]
) -> None:
    """Validate param group ``gi`` of optimizer ``name``: its hyperparameters (``check``),
    torch's per-group flags, parameter kinds, mask type. Every error names the group."""
    try:
        check(group)
    except ValueError as err:
        raise ValueError(f"param group {gi}: {err}; set it in that group") from None
    check_group_flags(name, gi, group)
    for i, p in enumerate(group["params"]):
        what = f"parameter {i} of param group {gi} (shape {tuple(p.shape)}, dtype {p.dtype})"
        if p.layout != torch.strided:
            raise ValueError(
                f"{what} has layout {p.layout}: {name} supports dense (torch.strided) "
                "parameters only; make the parameter dense (.to_dense())"
            )
        if p.is_complex():
            raise ValueError(
                f"{what} is complex: {name} supports real floating-point parameters only "
                "(float32, float16, bfloat16, float64); view complex ones as real with "
                "torch.view_as_real"
            )
        if not p.is_floating_point():
            raise ValueError(
                f"{what}: parameters must be floating point (float32, float16, bfloat16, float64)"
            )
    mask = group.get("exp_avg_mask")
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise ValueError(f"exp_avg_mask must be a tensor, got {type(mask).__name__}")


def check_shared_options(o: dict[str, Any]) -> None:
    """Validate the options every optimizer has, those of them in ``o``."""
    if "variance_floor" in o:
        check_real("variance_floor", o["variance_floor"], 0.0, 1.0, high_open=True)


def check_common_args(
    name: str,
    amsgrad: Any,
    decoupled_weight_decay: Any,
    hierarchical: Any,
    ranks_per_node: Any,
) -> None:
    """Validate the constructor arguments of optimizer ``name`` that are not options."""
    if not isinstance(decoupled_weight_decay, bool):
        raise ValueError(
            f"decoupled_weight_decay must be True or False, got {decoupled_weight_decay!r}"
        )
    if hierarchical not in (True, False, "auto"):
        raise ValueError(f"hierarchical must be True, False or 'auto', got {hierarchical!r}")
    if ranks_per_node is not None:
        check_int("ranks_per_node", ranks_per_node, 1)
    if amsgrad:
        raise ValueError(f"{name} does not support amsgrad=True (its variance is frozen)")


def deepspeed_arithmetic(cls: type, on: bool, **options: Any) -> dict[str, Any]:
    """``options`` (by name, in their order) with DeepSpeed's values where ``on`` (the
    optimizer class ``cls``'s ``deepspeed_compatible``; its ``DEEPSPEED_ARITHMETIC`` holds
    them). Raises ``ValueError`` for an option given a value that is neither DeepSpeed's nor
    its default: the two settings contradict each other."""
    if not isinstance(on, bool):
        raise ValueError(f"deepspeed_compatible must be True or False, got {on!r}")
    if not on:
        return options
    params = inspect.signature(cls.__init__).parameters
    out = dict(options)
    for k, v in options.items():
        if k not in cls.DEEPSPEED_ARITHMETIC:
            continue
        want = cls.DEEPSPEED_ARITHMETIC[k]
        default = params[k].default if k in params else want
        if v != want and v != default:
            raise ValueError(
                f"{cls.__name__}(deepspeed_compatible=True) computes with DeepSpeed's "
                f"{k}={want!r}, and {k}={v!r} was given too: drop one of the two"
            )
        out[k] = want
    return out


def option_defaults(cls: type[OneBitOptimizer]) -> dict[str, Any]:
    """Each of ``cls.OPTIONS`` with its default (from ``cls.__init__``'s signature)."""
    params = inspect.signature(cls.__init__).parameters
    return {k: params[k].default for k in cls.OPTIONS}


def raise_for_options(cls: type[OneBitOptimizer], options: dict[str, Any]) -> None:
    """Raise what ``cls(..., **options)`` would raise for these options (the others at their
    defaults): ``TypeError`` for a name not in ``cls.OPTIONS``, ``cls._check_options``'s
    ``ValueError`` for a value."""
    unknown = sorted(set(options) - set(cls.OPTIONS))
    if unknown:
        raise TypeError(f"{cls.__name__} has no option(s) {unknown}; it has {list(cls.OPTIONS)}")
    cls._check_options({**option_defaults(cls), **options})


def check_grads_are_local(opt: OneBitOptimizer) -> bool:
    """At a step that should receive each rank's own gradients: warn if they are identical on
    every rank. Then something averaged them in full precision already (plain DDP:
    ``strategy="ddp"`` or a ``DistributedDataParallel`` model), and every step pays DDP's fp32
    allreduce plus the 1-bit exchange; or every rank trains on the same batches. Two 2-value
    all_reduces. Returns whether the step was one (checked): the caller checks once a run."""
    if opt.expects_averaged_grads and not opt.average_warmup_grads:
        return False  # the caller averages this step's gradients
    if opt.world_size < 2:
        return True
    grads = [p.grad for p in opt.flat.layout.params if p.grad is not None]
    summary = torch.zeros(2, dtype=torch.float64, device=opt.flat.layout.device)
    for g in grads:  # every rank takes part, with or without gradients
        summary += torch.stack([g.double().sum(), g.double().abs().sum()])
    low = summary.clone()
    group = opt.process_group
    dist.all_reduce(summary, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    if not (torch.equal(low, summary) and float(summary[1]) > 0):
        return True
    if (dist.get_rank(group) if group is not None else dist.get_rank()) == 0:
        warnings.warn(
            f"{type(opt).__name__} received identical gradients on all {opt.world_size} "
            "ranks, where it expects each rank's own: they were averaged in full precision "
            "before step() (DDP: strategy='ddp' or a DistributedDataParallel model), so every "
            "step pays DDP's fp32 allreduce and the 1-bit exchange on top (the byte counters "
            "count only the latter); or every rank trains on the same batches. With "
            "Lightning use strategy='onebit_adam' / 'zero_one_adam' / 'onebit_lamb' (it "
            "turns DDP's allreduce off where the optimizer exchanges); without it, do not "
            "wrap the model in DistributedDataParallel, and give each rank its own data "
            "(DistributedSampler)",
            UserWarning,
            stacklevel=3,
        )
    return True


def check_joined(
    opt: OneBitOptimizer, joins_allowed: bool, layout: Layout, trained: frozenset[int]
) -> None:
    """Refuse parameters of the new ``layout`` that became trainable (``add_param_group``,
    ``requires_grad`` turned on) after the variance froze, before the step changes anything:
    they have no variance, and a 1-bit step divides by it (their first steps would be
    ``lr * scale / eps``). ``joins_allowed``: whether parameters may join now (the variance is
    still measured); ``trained``: the ``id`` s of the last layout's parameters."""
    if not trained or joins_allowed:
        return
    joined = [j for j, p in enumerate(layout.params) if id(p) not in trained]
    if not joined:
        return
    names = ", ".join(layout.name(j, opt.param_groups, opt.param_names) for j in joined[:8])
    more = f" and {len(joined) - 8} more" if len(joined) > 8 else ""
    raise ValueError(
        f"{type(opt).__name__}: {len(joined)} parameter(s) became trainable at step "
        f"{opt.step_count + 1}, in the {opt.phase} phase: {names}{more} (add_param_group, "
        "or requires_grad turned on: e.g. a fine-tuning callback such as Lightning's "
        "BackboneFinetuning unfreezing a backbone). Their variance was never measured, and "
        "the 1-bit steps divide by the variance frozen at the switch (step "
        f"{opt.switch_step}). Make them trainable before the switch: unfreeze earlier, or "
        f"switch later (OneBitStrategy(freeze_step=...), the optimizer's {opt.SWITCH_OPTION})"
    )
