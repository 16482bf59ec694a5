"""The processes and process groups of a 1-bit strategy's run, from launch to teardown: what
is checked before they start, what they set up, and what is stopped or destroyed after."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from collections.abc import Generator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_onebit._integration.front_end import FrontEnd
from lightning_onebit._integration.options import REFUSED_DDP_KWARGS
from lightning_onebit.optim import OneBitOptimizer
from lightning_onebit.optim._topology import close_all

__all__ = [
    "check_ddp_kwargs",
    "check_no_inherited_group",
    "destroy_single_process_group",
    "init_default_group_per_attempt",
    "notebook_message",
    "one_thread_per_forked_rank",
    "own_default_group",
    "process_setup",
    "refuse_float64",
    "refusing_float64",
    "stop_overlaps",
    "teardown_steps",
    "warn_single_process",
]

_NO_FLOAT64 = (
    "precision='64-true' is not supported by {who}: the 1-bit optimizers keep "
    "their states and the compressed exchange in float32, so float64 parameters would "
    "be updated with float32 arithmetic (0/1 Adam would even round them to float32 at "
    "every synchronisation); use precision='32-true', 'bf16-mixed' or '16-mixed'"
)


def check_ddp_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse the DDP options the 1-bit strategies set themselves."""
    if any(kwargs.get(k) is not None for k in REFUSED_DDP_KWARGS):
        raise ValueError(
            "a 1-bit strategy installs its own DDP communication hook (and averages no "
            f"models); remove {'/'.join(REFUSED_DDP_KWARGS)}"
        )


def refuse_float64(strategy: str) -> None:
    """``precision='64-true'``, refused by ``strategy`` (the class the user built)."""
    raise ValueError(_NO_FLOAT64.format(who=strategy))


def refusing_float64(base: property, double: type) -> property:
    """A strategy's precision property (``base``: its Lightning parent's) whose setter refuses
    ``double`` (the front end's ``DoublePrecision`` plugin): Lightning sets the plugin when it
    builds the Trainer or Fabric, so ``precision='64-true'`` fails before anything runs."""

    def set_plugin(strategy: Any, plugin: Any) -> None:
        if isinstance(plugin, double):
            refuse_float64(type(strategy).__name__)
        base.fset(strategy, plugin)  # type: ignore[misc]

    return property(base.fget, set_plugin, doc=base.__doc__)


def check_no_inherited_group(expected: int, front_end: FrontEnd) -> None:
    """Refuse a process group inherited through fork from an earlier run in the parent process
    (e.g. a notebook that ran devices=1 under plain DDP). Its first collective would never
    return, and it cannot be destroyed from a forked child."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() != expected:
        raise RuntimeError(
            f"a torch.distributed process group of world size {dist.get_world_size()} from an "
            f"earlier run is still initialised in this process, but this run has {expected} "
            "ranks; call torch.distributed.destroy_process_group() before this run starts "
            f"({front_end.start})"
        )


@contextlib.contextmanager
def process_setup(
    start_method: str, num_processes: int, num_nodes: int, front_end: FrontEnd
) -> Generator[None, None, None]:
    """Around a strategy's ``setup_environment``, which starts the process group: one thread per
    fork-started rank, no group inherited from an earlier run (``front_end`` names what starts
    the run), and a default group created inside destroyed at exit (``own_default_group``)."""
    one_thread_per_forked_rank(start_method, num_processes)
    check_no_inherited_group(num_nodes * num_processes, front_end)
    with own_default_group():
        yield


def init_default_group_per_attempt(
    backend: str,
    rank: int,
    world_size: int,
    timeout: timedelta | None,
    device: torch.device,
) -> bool:
    """Under ``torchrun`` (torchelastic's agent store), start the default process group on the
    agent's store under a prefix of its own per restart attempt; return whether it did (else
    Lightning starts the group as usual).

    Why: torchelastic's workers reach the store its agent keeps for the whole job (the static
    rendezvous keeps one ``TCPStore``, the c10d rendezvous shares its own), and torch's
    ``env://`` start uses no prefix per attempt. After a restart (``--max-restarts``) a rank can
    read the address a dead rank of the previous attempt left there: gloo's ``connectFullMesh``
    is refused, or connects to a reused port and waits forever. The keys of every group made on
    the default group (``new_group``) share the prefix.

    Args:
        backend: the default group's backend.
        rank: this process's global rank.
        world_size: the number of processes.
        timeout: how long to wait for the other ranks, and the group's collective timeout
            (``None``: torch's default).
        device: the rank's device (bound to the group on CUDA, as Lightning does).

    Raises:
        RuntimeError: the group did not connect within ``timeout``: the message names the
            attempt and the settings to check.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return False
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    waits: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    kw = {**waits, "device_id": device} if device.type != "cpu" else waits
    try:
        store = dist.TCPStore(address, port, world_size, is_master=False, **waits)
        prefixed = dist.PrefixStore(f"lightning_onebit/attempt_{attempt}", store)
        dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size, **kw)
    except RuntimeError as err:  # torch's DistError and its store/network errors too
        raise RuntimeError(
            f"rank {rank}: could not start the default {backend} process group of "
            f"{world_size} ranks (torchrun attempt {attempt}, store {address}:{port}, timeout "
            f"{timeout or 'torch default'}): {' '.join(str(err).split())[:300]}. Check that "
            "every rank was started by the same torchrun job and reaches the others on the "
            "interface MASTER_ADDR names (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME); the "
            "strategy's `timeout=` bounds the wait"
        ) from err
    rank_zero_info(
        f"{'-' * 100}\ndistributed_backend={backend}\nAll distributed processes registered. "
        f"Starting with {world_size} processes (torchrun attempt {attempt})\n{'-' * 100}\n"
    )
    return True


@contextlib.contextmanager
def teardown_steps(
    optimizers: list[OneBitOptimizer], hook_state: Any = None
) -> Generator[None, None, None]:
    """Around a strategy's ``teardown``: before it, the divergence watch's last check (a
    blow-up since its last periodic check would otherwise end the run unnamed), and the overlaps
    and the hook's thread stop (``stop_overlaps``); after it, a single-process group is destroyed
    (``destroy_single_process_group``)."""
    for opt in optimizers:
        opt.watch_divergence(now=True)
    stop_overlaps(optimizers, hook_state)
    yield
    destroy_single_process_group()


def notebook_message(algorithm: str, cls_name: str) -> str:
    """Why a script-launched strategy cannot run in a notebook, and what to use instead."""
    return (
        f"strategy={algorithm!r} starts each rank by running your script again, and "
        "an interactive session (a notebook, the Python shell) has none: use "
        f"strategy='{algorithm}_notebook' (fork-started ranks), or "
        f"{cls_name}(algorithm='{algorithm}', start_method='fork')"
    )


def one_thread_per_forked_rank(start_method: str, num_processes: int) -> None:
    """GNU OpenMP cannot run a parallel region in a forked child once the parent has used its
    thread pool (the child waits forever for threads that did not survive the fork), and a
    notebook's parent process usually has. One thread per fork-started rank."""
    if start_method == "fork" and num_processes > 1:
        torch.set_num_threads(1)


def stop_overlaps(optimizers: list[OneBitOptimizer], hook_state: Any = None) -> None:
    """At teardown: stop the overlap (its thread, hooks and process groups), destroy the
    two-level exchange's groups, stop the DDP hook's thread: nothing the strategy or the
    optimizer started outlives the fit."""
    for opt in optimizers:
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
        return  # none, a parent's, or after an uncaught exception
    close_all()  # the optimizers' own groups first: Fabric never tears its strategy down
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
