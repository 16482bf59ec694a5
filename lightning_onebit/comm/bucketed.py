"""Several exchanges over the buckets of one flat buffer, so that a bucket can go out while
backward is still producing the rest (see
[`BucketedAllreduce`][lightning_onebit.comm.bucketed.BucketedAllreduce])."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_onebit.comm.base import Exchange, Handle, check_input
from lightning_onebit.comm.factory import make_exchange
from lightning_onebit.comm.handle import Compressed
from lightning_onebit.comm.hierarchical import NodeGroups
from lightning_onebit.kernels import ExchangeSource, SignRuns, TensorSource

__all__ = ["BucketedAllreduce"]


class BucketedAllreduce(Exchange):
    """The compressed average of one flat buffer, split into buckets exchanged separately.

    Each bucket (a contiguous slice) has its own
    [`CompressedAllreduce`][lightning_onebit.comm.flat.CompressedAllreduce] (its own scale and error
    buffers, the server's double buffered), so a bucket can be sent as soon as its values exist, e.g. while
    backward is still producing the rest of the gradient:
    [`start_bucket`][lightning_onebit.comm.bucketed.BucketedAllreduce.start_bucket]. A call goes
    through for all buckets or for none:
    [`finish`][lightning_onebit.comm.bucketed.BucketedAllreduce.finish] commits every bucket only
    when every rank's every bucket was finite, else drops them all (error buffers as before) and
    raises [`NonFiniteError`][lightning_onebit.comm.base.NonFiniteError] on every rank.

    Buckets are started in index order on every rank (the collectives must match).

    Args:
        bounds: the buckets as ``(start, stop)`` pairs that tile ``[0, numel)``.
        device, group, device_verdict, recompute_error: as for
            [`CompressedAllreduce`][lightning_onebit.comm.flat.CompressedAllreduce] (the verdict of
            a call is every bucket's; ``recompute_error``: each bucket keeps one worker error
            buffer, updated at ``finish`` from its input read again).
        nodes: a [`NodeGroups`][lightning_onebit.comm.hierarchical.NodeGroups] for the two-level
            exchange
            ([`HierarchicalAllreduce`][lightning_onebit.comm.hierarchical.HierarchicalAllreduce] per
            bucket; ``group`` unused), or ``None`` (flat).
    """

    def __init__(
        self,
        bounds: list[tuple[int, int]],
        device: torch.device | str = "cpu",
        group: dist.ProcessGroup | None = None,
        nodes: NodeGroups | None = None,
        *,
        device_verdict: bool = False,
        recompute_error: bool = False,
    ) -> None:
        tiles = sorted(bounds)
        if (
            not tiles
            or tiles[0][0] != 0
            or any(a >= b for a, b in tiles)
            or any(tiles[i][1] != tiles[i + 1][0] for i in range(len(tiles) - 1))
        ):
            raise ValueError(f"bounds must tile [0, numel) with non-empty buckets, got {bounds}")
        self.bounds = [(int(a), int(b)) for a, b in bounds]  # in exchange order, any layout
        self.numel = tiles[-1][1]
        self.buckets = [
            make_exchange(b - a, device, group, nodes, double_buffered=True,
                          device_verdict=device_verdict, recompute_error=recompute_error)
            for a, b in self.bounds
        ]  # fmt: skip
        self.nodes = nodes
        self.device = self.buckets[0].device
        self.device_verdict = self.buckets[0].device_verdict
        self.world_size, self.rank = self.buckets[0].world_size, self.buckets[0].rank
        self._handles: list[Handle | None] = [None] * len(self.buckets)
        self.bytes_sent = 0
        self.calls = 0
        if self.device_verdict:
            self._ok = torch.ones(1, dtype=torch.bool, device=self.device)
            self._finite_ranks = torch.ones(self.world_size, dtype=torch.bool, device=self.device)

    @property
    def verdict(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``device_verdict``: the last call's verdict over every bucket, on the device (see
        [`CompressedAllreduce.verdict`][lightning_onebit.comm.flat.CompressedAllreduce.verdict])."""
        return self._ok, self._finite_ranks

    def __len__(self) -> int:
        return len(self.buckets)

    @property
    def started(self) -> list[bool]:
        return [h is not None for h in self._handles]

    def prepare_bucket(
        self, b: int, values: torch.Tensor | ExchangeSource
    ) -> torch.Tensor | Compressed:
        """The part of bucket ``b``'s call that reads ``values`` (its ``stop - start`` values),
        now: what [`start_bucket`][lightning_onebit.comm.bucketed.BucketedAllreduce.start_bucket]
        takes (see
        [`CompressedAllreduce.prepare`][lightning_onebit.comm.flat.CompressedAllreduce.prepare])."""
        return self.buckets[b].prepare(values, commit=False)

    def start_bucket(self, b: int, values: torch.Tensor | ExchangeSource | Compressed) -> None:
        """Start bucket ``b`` (every bucket before it must have been started) from ``values``
        (its ``stop - start`` values, read now and not needed afterwards, or what
        [`prepare_bucket`][lightning_onebit.comm.bucketed.BucketedAllreduce.prepare_bucket]
        returned)."""
        if b and self._handles[b - 1] is None:
            raise RuntimeError(f"bucket {b} started before bucket {b - 1}: start them in order")
        self._handles[b] = self.buckets[b].start(values, commit=False)

    @property
    def returns_runs(self) -> bool:
        """Whether [`finish`][lightning_onebit.comm.bucketed.BucketedAllreduce.finish] can return
        its result undecoded (flat buckets on the CPU)."""
        return self.nodes is None and self.device.type == "cpu"

    def pending(self) -> list[tuple[int, int]]:
        """The buckets not started yet, whose inputs
        [`finish`][lightning_onebit.comm.bucketed.BucketedAllreduce.finish] takes, in order."""
        return [bounds for bounds, h in zip(self.bounds, self._handles, strict=True) if h is None]

    def finish(
        self, sources: Sequence[ExchangeSource], out: torch.Tensor | None
    ) -> SignRuns | None:
        """Start the buckets not started yet
        ([`pending`][lightning_onebit.comm.bucketed.BucketedAllreduce.pending]), one from each of
        ``sources``, then commit every bucket and decode into ``out`` (``numel`` values), or drop
        all and raise NonFiniteError on every rank. ``out=None``
        ([`returns_runs`][lightning_onebit.comm.bucketed.BucketedAllreduce.returns_runs]): every
        bucket's result is returned as one [kernels.SignRuns][lightning_onebit.kernels.SignRuns].
        """
        todo = [b for b, h in enumerate(self._handles) if h is None]
        if len(sources) != len(todo):
            raise ValueError(f"finish() takes {len(todo)} inputs (pending()), got {len(sources)}")
        for b, values in zip(todo, sources, strict=True):
            self.start_bucket(b, values)
        handles, self._handles = self._handles, [None] * len(self.buckets)
        self.bytes_sent = sum(ex.bytes_sent for ex in self.buckets)
        self.calls += 1
        bad = [h for h in handles if not h.finite]
        if bad:
            for h in handles:
                h.discard()
            raise bad[0].error()
        ok = None
        if self.device_verdict:  # every bucket's, on the device: all go through, or none
            finite = torch.stack([ex.verdict[1] for ex in self.buckets])
            torch.all(finite, dim=0, out=self._finite_ranks)
            ok = self._ok
            torch.all(self._finite_ranks, dim=0, keepdim=True, out=ok)
        try:
            for h in handles:
                h.commit(ok)
        except BaseException:  # (a bucket whose input changed): the others not left pending
            for h in handles:
                h.discard()
            raise
        if out is None:
            if not self.returns_runs:
                raise ValueError("finish(out=None) needs flat buckets on the CPU")
            return SignRuns(
                [r for h, (lo, _) in zip(handles, self.bounds, strict=True) for r in h.runs(lo)]
            )
        for h, (lo, hi) in zip(handles, self.bounds, strict=True):
            h.wait(out[lo:hi])
        return None

    def discard(self) -> None:
        """Drop the buckets started so far (e.g. a backward whose step never came)."""
        for h in self._handles:
            if h is not None:
                h.discard()
        self._handles = [None] * len(self.buckets)

    def __call__(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """All buckets at once: the compressed average of ``tensor`` into ``out`` (default: in
        place)."""
        out = tensor if out is None else out
        x = check_input(tensor, self.numel, self.device)
        self.finish([TensorSource(x[lo:hi]) for lo, hi in self.pending()], out.view(-1))
        return out

    # ------------------------------------------------------------------ state

    def error_views(self, lo: int, hi: int) -> list[torch.Tensor]:
        """Live views of this rank's error buffers over the values ``[lo, hi)`` (see
        [`CompressedAllreduce.error_views`][lightning_onebit.comm.flat.CompressedAllreduce.error_views]),
        bucket by bucket."""
        views: list[torch.Tensor] = []
        for ex, (a, b) in zip(self.buckets, self.bounds, strict=True):
            if max(lo, a) < min(hi, b):
                views += ex.error_views(max(lo, a) - a, min(hi, b) - a)
        return views

    def reset_error(self) -> None:
        for ex in self.buckets:
            ex.reset_error()

    def state_dict(self) -> dict[str, Any]:
        return {
            "numel": self.numel,
            "world_size": self.world_size,
            "bounds": list(self.bounds),
            "buckets": [ex.state_dict() for ex in self.buckets],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if (
            state_dict.get("bounds") != self.bounds
            or state_dict.get("world_size") != self.world_size
        ):
            raise ValueError(
                f"error buffers saved for buckets {state_dict.get('bounds', 'none (one exchange)')}"
                f", world_size={state_dict.get('world_size')} cannot be loaded into buckets "
                f"{self.bounds}, world_size={self.world_size}; use reset_error()"
            )
        for ex, sd in zip(self.buckets, state_dict["buckets"], strict=True):
            ex.load_state_dict(sd)

    @property
    def bytes_per_call(self) -> int:
        return sum(ex.bytes_per_call for ex in self.buckets)

    def inter_node_bytes(self, ranks_per_node: int) -> int:
        """Of the bytes this rank sent in the last call, those that left its node (every
        bucket's, see
        [`CompressedAllreduce.inter_node_bytes`][lightning_onebit.comm.flat.CompressedAllreduce.inter_node_bytes])."""
        return sum(ex.inter_node_bytes(ranks_per_node) for ex in self.buckets)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(numel={self.numel}, buckets={len(self.buckets)}, "
            f"world_size={self.world_size}, device={self.device})"
        )
