"""The ranks an optimizer communicates over: its process group, the world size, and the
two-level layout (node groups) of the hierarchical exchange; and the closing of every live
optimizer's process groups at interpreter exit."""

from __future__ import annotations

import atexit
import os
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lightning_onebit.comm import NodeGroups, resolve_ranks_per_node

if TYPE_CHECKING:
    from lightning_onebit.optim._base import OneBitOptimizer

__all__ = ["Delegated", "Topology", "close_all", "register"]


class Topology:
    """The process group, the world size and the node groups of one optimizer.

    Interface: ``world_size``, ``node_groups`` (collective on its first call),
    ``nodes`` (the cached result, no collective), ``node_size`` (for byte counters),
    ``close``. ``hierarchical`` and ``ranks_per_node`` may change until the first
    ``node_groups`` (the strategies set them at setup).

    Args:
        process_group: the group to communicate over; ``None``: the default group (``W = 1``
            without an initialised process group).
        hierarchical: ``True``/``"auto"``: the two-level exchange on several nodes of several
            ranks; ``False``: the flat exchange.
        ranks_per_node: the ranks on each node (default ``LOCAL_WORLD_SIZE``).
    """

    def __init__(
        self, process_group: Any, hierarchical: bool | str, ranks_per_node: int | None
    ) -> None:
        self.process_group = process_group
        self.hierarchical = hierarchical
        self.ranks_per_node = ranks_per_node
        #: the node groups, once ``node_groups`` resolved them (``None``: flat)
        self.nodes: NodeGroups | None = None
        self._resolved = False

    @staticmethod
    def distributed() -> bool:
        """Whether a default process group is initialised."""
        return dist.is_available() and dist.is_initialized()

    def world_size(self) -> int:
        """Ranks in the process group (1 without an initialised process group)."""
        return dist.get_world_size(self.process_group) if self.distributed() else 1

    def node_groups(self, timeout: timedelta | None = None) -> NodeGroups | None:
        """The two-level layout, or ``None`` for the flat exchange (see
        ``OneBitOptimizer.node_groups``). Collective on its first call, whose ``timeout`` bounds
        the groups' creation and collectives; cached after it."""
        if not self._resolved:
            w = self.world_size()
            ll = (
                resolve_ranks_per_node(self.hierarchical, self.ranks_per_node, w) if w > 1 else None
            )
            self.nodes = None if ll is None else NodeGroups(self.process_group, ll, timeout)
            self._resolved = True
            if self.nodes is not None:  # destroyed with the optimizer, at the latest at exit
                weakref.finalize(self, self.nodes.close)
        return self.nodes

    def close(self) -> bool:
        """Destroy the node groups (the next ``node_groups`` builds them again); return
        whether there were any."""
        had = self.nodes is not None
        if had:
            self.nodes.close()
        self.nodes, self._resolved = None, False
        return had

    def node_size(self, world_size: int) -> int:
        """Ranks per node for the byte counters of ``world_size`` ranks: the node groups', else
        ``ranks_per_node`` or ``LOCAL_WORLD_SIZE`` where given, else 1 (every peer counts as
        on another node)."""
        if self.nodes is not None:
            return self.nodes.local_size
        ll = self.ranks_per_node
        env = os.environ.get("LOCAL_WORLD_SIZE", "")
        if ll is None and env.isdigit():
            ll = int(env)
        w = world_size
        return ll if ll is not None and ll <= w and w % ll == 0 else 1


class Delegated:
    """An attribute of an object that lives in one of its composed objects: ``x = Delegated(
    "topology")`` in a class body reads and writes ``self.topology.x`` (``attr``: another name
    there)."""

    def __init__(self, owner: str, doc: str = "", attr: str | None = None) -> None:
        self.owner, self.attr = owner, attr
        self.__doc__ = doc

    def __set_name__(self, cls: type, name: str) -> None:
        self.name = self.attr or name

    def __get__(self, obj: Any, cls: type | None = None) -> Any:
        return self if obj is None else getattr(getattr(obj, self.owner), self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(getattr(obj, self.owner), self.name, value)


#: every live optimizer (``register``)
_OPEN: weakref.WeakSet[OneBitOptimizer] = weakref.WeakSet()


def register(opt: OneBitOptimizer) -> None:
    """Have ``close_all`` close ``opt`` if it is still alive then: a process group left to
    the interpreter's shutdown can abort a finished run."""
    _OPEN.add(opt)


def close_all() -> None:
    """``close()`` every live optimizer (at interpreter exit, and at the end of a Fabric run)."""
    for opt in list(_OPEN):
        opt.close()


atexit.register(close_all)
