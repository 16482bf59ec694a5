"""The bytes an optimizer's steps send (``comm_stats``), and the host counters a dropped step
puts back."""

from __future__ import annotations

import copy
from typing import Any

from lightning_onebit.comm import fp32_allreduce_bytes

__all__ = ["CommCounters", "restore", "snapshot"]


class CommCounters:
    """This step's bytes and the totals since the start of training (``totals`` is the
    optimizer's ``comm_stats``; checkpointed).

    Interface: ``start_step``, ``add`` (what this rank sent, and the part of it that
    left the node), ``add_ring`` (a full-precision ring all-reduce), ``end_step``,
    ``end_between_steps`` (communication outside a step, e.g. 0/1 Adam's ``synchronize``).
    """

    def __init__(self) -> None:
        self.totals: dict[str, int] = {
            "bytes_last_step": 0,  # bytes this rank sent in the last step
            "bytes_total": 0,  # ... since the start of training
            "fp32_equiv_total": 0,  # what fp32 ring allreduces of the gradients would have sent
            # the part of those that left the node (nodes of ranks_per_node ranks; see
            # node_groups), and the fp32 ring's: one rank's ring traffic per node crosses
            "bytes_last_step_inter": 0,
            "bytes_total_inter": 0,
            "fp32_equiv_total_inter": 0,
        }
        self.step_bytes = 0  # sent in this step
        self.step_inter = 0  # ... of which left the node

    def start_step(self) -> None:
        self.step_bytes = self.step_inter = 0

    def add(self, sent: int, inter: int = 0) -> None:
        """``sent`` bytes this step, of which ``inter`` left the node."""
        self.step_bytes += sent
        self.step_inter += inter

    def add_ring(self, sent: int, world_size: int, node_size: int) -> None:
        """A ring all-reduce of ``sent`` bytes in rank order: it crosses each node's link once,
        one rank's traffic per node."""
        self.step_bytes += sent
        if node_size < world_size:
            self.step_inter += sent // node_size

    def end_step(self, numel: int, world_size: int, node_size: int) -> None:
        """Book this step, with what fp32 ring allreduces of ``numel`` gradients would send."""
        totals = self.totals
        totals["bytes_last_step"] = self.step_bytes
        totals["bytes_total"] += self.step_bytes
        fp32 = fp32_allreduce_bytes(numel, world_size)
        totals["fp32_equiv_total"] += fp32
        totals["bytes_last_step_inter"] = self.step_inter
        totals["bytes_total_inter"] += self.step_inter
        if node_size < world_size:
            totals["fp32_equiv_total_inter"] += fp32 // node_size

    def end_between_steps(self) -> None:
        """Book what was sent since ``start_step`` outside a step: in the totals and the
        last step's count."""
        self.totals["bytes_total"] += self.step_bytes
        self.totals["bytes_last_step"] += self.step_bytes


def snapshot(obj: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """The attributes ``names`` of ``obj`` (shallow copies), for ``restore``."""
    return {k: copy.copy(getattr(obj, k)) for k in names}


def restore(obj: Any, saved: dict[str, Any]) -> None:
    """Put back what ``snapshot`` took."""
    for k, v in saved.items():
        setattr(obj, k, v)
