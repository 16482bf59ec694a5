"""What a 1-bit optimizer communicates over, and how it is set up and closed: the process group,
the node groups of the two-level exchange, the overlap with backward (``Connections``, a base of
``OneBitOptimizer``)."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from lightning_onebit.comm import NodeGroups
from lightning_onebit.optim._overlap import BackwardOverlap, replace_overlap
from lightning_onebit.optim._topology import Delegated

if TYPE_CHECKING:
    from lightning_onebit.optim._counters import CommCounters
    from lightning_onebit.optim._flat import FlatState
    from lightning_onebit.optim._topology import Topology

__all__ = ["Connections"]


class Connections:
    """The communication of ``OneBitOptimizer``: its process group (``topology``), the node
    groups, the overlap with backward (``overlap``), connecting them at once and closing them,
    and the bytes sent. It uses the optimizer's ``topology``, ``overlap``, ``flat`` and
    ``counters``."""

    topology: Topology
    overlap: BackwardOverlap | None
    flat: FlatState
    counters: CommCounters

    process_group = Delegated("topology", "The group the optimizer communicates over.")
    hierarchical = Delegated(
        "topology",
        "The two-level exchange (see [`node_groups`][lightning_onebit.optim.OneBitOptimizer.node_groups]).",
    )
    ranks_per_node = Delegated(
        "topology",
        "Ranks per node (see [`node_groups`][lightning_onebit.optim.OneBitOptimizer.node_groups]).",
    )

    def overlap_with_backward(
        self, bucket_cap_mb: float | None = 25.0, *, timeout: timedelta | None = None
    ) -> None:
        """Start the step's communication during backward, in buckets of about ``bucket_cap_mb``
        MiB (``None``: off), on a thread and process group of its own (``_overlap.py``). It
        compresses ``.grad`` as backward leaves it and ``step()`` reads it again: ``.grad`` must
        not change in between (no clipping or unscaling: ``step()`` raises ``RuntimeError``);
        set ``overlap_paused`` around backward passes not followed by ``step()``. Call it on
        every rank between steps (new buckets restart the error buffers). ``timeout``: the new
        group's (``None``: torch's)."""
        self.overlap = replace_overlap(
            self.overlap, self, bucket_cap_mb, timeout, self._exchange_source, self._overlappable
        )

    @property
    def overlaps_backward(self) -> bool:
        """Whether the exchange is started during backward (see
        [`overlap_with_backward`][lightning_onebit.optim.OneBitOptimizer.overlap_with_backward])."""
        return self.overlap is not None

    def node_groups(self) -> NodeGroups | None:
        """The two-level layout the exchange runs on (``hierarchical`` on several nodes of several
        ranks each: full precision inside a node, 1 bit between them), or ``None``: the flat one
        (``True`` on one node or one rank per node warns; ``"auto"`` decides silently).
        Collective on its first call; cached after it."""
        return self.topology.node_groups()

    def connect(self, timeout: timedelta | None = None) -> None:
        """Make every process group this optimizer will communicate over, now: the node groups
        of [`node_groups`][lightning_onebit.optim.OneBitOptimizer.node_groups] and the overlap's own
        ([`overlap_with_backward`][lightning_onebit.optim.OneBitOptimizer.overlap_with_backward];
        call this after it). Collective: every rank, in the same order. Without it each group is
        made at the first step that needs it; the strategies call it at setup, where a rank that
        cannot connect fails before training instead of inside a step.

        Args:
            timeout: how long each group waits for the other ranks, and its collectives'
                timeout (``None``: torch's default).

        Raises:
            RuntimeError: a group did not connect within ``timeout`` (the message names it).
        """
        self.topology.node_groups(timeout)
        if self.overlap is not None:
            self.overlap.connect()

    def close_node_groups(self) -> None:
        """Destroy the groups of
        [`node_groups`][lightning_onebit.optim.OneBitOptimizer.node_groups]; the next step builds
        them again."""
        if self.topology.close():
            self.flat.release_exchange()

    def close(self) -> None:
        """Stop the overlap's thread, hooks and groups, the node groups and the exchange on them
        (its error buffers are kept) until the next ``step()``; also at interpreter exit."""
        if self.overlap is not None:
            self.overlap.close()
        self.close_node_groups()

    @property
    def world_size(self) -> int:
        """Ranks in ``process_group`` (1 without an initialised process group)."""
        ex = self.flat.exchange
        return self.topology.world_size() if ex is None else ex.world_size

    @property
    def comm_stats(self) -> dict[str, int]:
        """Bytes sent: ``bytes_last_step``, ``bytes_total``, ``fp32_equiv_total`` (fp32 ring
        allreduces' bytes) and their ``_inter`` parts (what left the node)."""
        return self.counters.totals
