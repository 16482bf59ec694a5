"""The one place that picks an exchange: the flat one or the two-level one."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_onebit.comm.flat import CompressedAllreduce
from lightning_onebit.comm.hierarchical import HierarchicalAllreduce, NodeGroups

__all__ = ["make_exchange"]


def make_exchange(
    numel: int,
    device: torch.device | str,
    group: dist.ProcessGroup | None,
    nodes: NodeGroups | None,
    *,
    double_buffered: bool = False,
    device_verdict: bool = False,
    recompute_error: bool = False,
) -> CompressedAllreduce | HierarchicalAllreduce:
    """The flat exchange over ``group``, or the hierarchical one over ``nodes`` when given."""
    if nodes is None:
        return CompressedAllreduce(
            numel,
            device=device,
            group=group,
            double_buffered=double_buffered,
            device_verdict=device_verdict,
            recompute_error=recompute_error,
        )
    return HierarchicalAllreduce(
        numel,
        nodes,
        device=device,
        double_buffered=double_buffered,
        device_verdict=device_verdict,
        recompute_error=recompute_error,
    )
