"""Every private API of Lightning and torch that lightning_onebit relies on, in one place.

Each entry names what it is, why no public API does the job, and the versions it was checked on;
``tests/integration/test_compat.py`` has one test per entry, so an upgrade that breaks one fails there, by
name, instead of somewhere in a training run. Checked on torch 2.13.0 with Lightning 2.6.0 and
2.6.6 (the floors in pyproject.toml). Not listed: ``torch._foreach_*`` ops, which torch's own
optimizers are built on (a documented, stable family despite the underscore).

Done with public APIs instead, so not listed: writing and reading rank files
(``torch.save``/``torch.load`` through ``fsspec``), local paths (``fsspec.core.strip_protocol``),
the unused-parameters message (our own), the precision plugin (``Strategy.precision_plugin``'s
setter), the start method and timeout (kept by the strategies' options), DDP's device ids
(``None`` on CPU, else the root device's index, as both ``DDPStrategy``s compute them), a
``LightningOptimizer``'s optimizer (its ``optimizer`` property).

Lightning's private hooks are overridden here too (`LauncherCheck`,
`TrainerDDPHooks`), each routed to a public method of the strategy, so that no other
module names them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Fabric's DDP control of `fabric.no_backward_sync` (DDP's no_sync), which OneBitFabricStrategy
# extends to pause the overlap with backward; no public way to wrap it exists. (2.6.0-2.6.6)
from lightning.fabric.strategies.ddp import _DDPBackwardSyncControl as DDPBackwardSyncControl

# Lightning's own test for "a notebook or the Python shell", before which our message about
# `*_notebook` names must come (Lightning's suggests 'ddp_notebook'). (2.6.0-2.6.6)
from lightning.fabric.utilities.imports import _IS_INTERACTIVE as IS_INTERACTIVE

# The placeholder optimizer Lightning installs when configure_optimizers returns None; a DeepSpeed
# config then builds ours. (2.6.0-2.6.6)
from lightning.pytorch.core.optimizer import _MockOptimizer as MockOptimizer

__all__ = [
    "DDP_HOOKS_OVERRIDDEN",
    "FABRIC_DDP_PRIVATE",
    "IS_INTERACTIVE",
    "DDPBackwardSyncControl",
    "LauncherCheck",
    "MockOptimizer",
    "TrainerDDPHooks",
    "ddp_kwargs",
    "mark_step_for_lr_schedulers",
    "process_group_backend",
    "scaler_found_inf",
    "set_backward_sync_control",
    "stateful_state",
]

# --------------------------------------------------------------------------- Lightning

#: DDPStrategy's private hooks that OneBitStrategy overrides (2.6.0-2.6.6), in
#: `TrainerDDPHooks` and `LauncherCheck`: ``_setup_model`` wraps the model in DDP
#: (ours: on the current stream, with our comm hook registered on every device);
#: ``_register_ddp_hooks`` registers DDP's comm hook, on CUDA only (ours does nothing: the hook is
#: registered); ``_configure_launcher`` builds the launcher (our interactive-session message must
#: come before Lightning's check in ``Trainer``). If Lightning renames one, our override would
#: silently never run: the test checks that Lightning still calls each.
DDP_HOOKS_OVERRIDDEN = ("_setup_model", "_register_ddp_hooks", "_configure_launcher")

#: Fabric DDPStrategy's private members that OneBitFabricStrategy overrides or uses (2.6.0-2.6.6):
#: ``_configure_launcher`` (`LauncherCheck`), ``_backward_sync_control`` (what
#: ``fabric.no_backward_sync`` calls: `set_backward_sync_control`),
#: ``_convert_stateful_objects_in_state`` (`stateful_state`), ``_ddp_kwargs``
#: (`ddp_kwargs`), ``_get_process_group_backend`` (`process_group_backend`).
FABRIC_DDP_PRIVATE = (
    "_configure_launcher",
    "_backward_sync_control",
    "_convert_stateful_objects_in_state",
    "_ddp_kwargs",
    "_get_process_group_backend",
)


class LauncherCheck:
    """Lightning's ``_configure_launcher`` (the Trainer's and Fabric's ``DDPStrategy``), then the
    strategy's public ``check_launcher()``: our message about an interactive session must come
    before Lightning's own check, which suggests ``'ddp_notebook'`` (plain DDP). Placed before
    ``DDPStrategy`` in a strategy's bases."""

    def _configure_launcher(self) -> None:
        super()._configure_launcher()  # type: ignore[misc]
        self.check_launcher()  # type: ignore[attr-defined]


class TrainerDDPHooks:
    """The Trainer ``DDPStrategy``'s private model hooks, routed to the strategy's public
    ``wrap_module(model)``: DDP built on the current stream (``DDPStrategy`` builds it on a side
    stream) with our comm hook registered on every device (``DDPStrategy`` registers one on CUDA
    only). Placed before ``DDPStrategy`` in a strategy's bases."""

    def _setup_model(self, model: torch.nn.Module) -> Any:
        return self.wrap_module(model)  # type: ignore[attr-defined]

    def _register_ddp_hooks(self) -> None:
        pass  # ours is registered by wrap_module


def ddp_kwargs(strategy: Any) -> dict[str, Any]:
    """The keyword arguments a ``DDPStrategy`` (the Trainer's or Fabric's) passes on to
    ``DistributedDataParallel``: what the user gave it beyond its own arguments. No public
    accessor exists. (2.6.0-2.6.6: ``_ddp_kwargs``)"""
    return strategy._ddp_kwargs


def process_group_backend(strategy: Any) -> str:
    """The backend a ``DDPStrategy`` (the Trainer's or Fabric's) will start its default process
    group with (the one given, else the device's default). The public ``process_group_backend``
    is ``None`` until the group starts, and we start it ourselves under torchrun.
    (2.6.0-2.6.6: ``_get_process_group_backend``)"""
    return strategy._get_process_group_backend()


def stateful_state(
    strategy: Any, state: dict[str, Any], filter: dict[str, Any] | None
) -> dict[str, Any]:
    """What Fabric's ``DDPStrategy.save_checkpoint`` writes for ``state``: each module,
    optimizer and stateful object replaced by its state dict (``filter`` applied), the rest as
    given. No public function does it. (2.6.0-2.6.6: ``_convert_stateful_objects_in_state``)"""
    return strategy._convert_stateful_objects_in_state(state, filter=filter or {})


def set_backward_sync_control(strategy: Any, control: DDPBackwardSyncControl) -> None:
    """Make ``control`` what ``fabric.no_backward_sync`` of Fabric's ``strategy`` uses.
    (2.6.0-2.6.6: ``_backward_sync_control``)"""
    strategy._backward_sync_control = control


# --------------------------------------------------------------------------- torch


def scaler_found_inf(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer
) -> list[torch.Tensor]:
    """The found-inf flags ``scaler.unscale_(optimizer)`` just computed (one per device), which
    ``scaler.step`` reads: reducing them across ranks makes the skip decision the same on every
    rank. No public accessor exists. (torch 2.13; also in 2.3 and 2.6: ``_per_optimizer_states``)"""
    return list(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())


def mark_step_for_lr_schedulers(optimizer: torch.optim.Optimizer) -> None:
    """Wrap ``optimizer.step`` as torch's LR schedulers do for the optimizer they were built on
    (the scheduler warns "lr_scheduler.step() before optimizer.step()" unless the optimizer's
    step set ``_opt_called``), for a scheduler re-pointed at the converted optimizer. A no-op
    if already wrapped. (torch 2.13; also in 2.3 and 2.6: ``_opt_called``, ``_wrapped_by_lr_sched``)"""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step: Callable[..., Any] = optimizer.step

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    wrapped._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapped  # type: ignore[method-assign]
