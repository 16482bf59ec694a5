"""The two-level (hierarchical) exchange: full precision inside a node, 1 bit between nodes.

A cluster's ranks sit on ``N`` nodes of ``L`` ranks each, with fast links inside a node (NVLink,
PCIe, shared memory, loopback) and a slow network between nodes. The flat exchange
([`CompressedAllreduce`][lightning_onebit.comm.flat.CompressedAllreduce]) makes each of a node's
``L`` ranks send its own compressed values through the node's one network link; the hierarchical one
sends the node's average once (1.75x fewer bytes per node at 2 x 2 ranks, ``(L + 1) / 2`` times with
many nodes; below), and compresses that average instead of each rank's own values (a smaller 1-bit
error relative to the signal):

1. **Inside the node, full precision** (``all_to_all`` = reduce-scatter): local rank ``k`` gets
   shard ``k`` of every local rank's values and averages them (summed in local-rank order).
   Every local rank owns a shard of the node's average: none idles, unlike a single leader.
2. **Between nodes, 1 bit**: the error-compensated exchange
   ([`CompressedAllreduce`][lightning_onebit.comm.flat.CompressedAllreduce]) of shard ``k`` among
   the ``N`` ranks with local index ``k`` (one per node), with this rank's error buffers for its
   shard.
3. **Inside the node again**: an ``all_gather`` of the ``N`` compressed records of every shard
   (1 bit per value, not fp32); every rank decodes all of them. Every rank of every node ends
   with the same values, bit for bit.

A NaN/Inf anywhere reaches the owner of its shard in step 1; that inter-node exchange stops
before writing anything (as the flat one does), its ranks put NaN scales into what step 3
gathers, so every rank of every node sees it in the same call and the call is dropped
everywhere (error buffers as before).

Bytes per rank per call, with ``n' = n`` rounded up to ``8 N L``: inside the node
``(L - 1) (4 n' / L + N r)`` (``r`` = one record, about ``n' / (8 N L)`` bytes); between nodes
``2 (N - 1) r``: ``(N - 1) / N * n' / 8`` per node and direction, the least a 1-bit exchange
can send. The flat exchange sends ``L`` times that in its ``all_to_all`` and about ``n / 8``
in its ``all_gather`` (a ring in rank order crosses each node's link with ``W - 1`` records):
7n/32 vs 4n/32 per node at ``N = L = 2``, ``(L + 1) / 2`` times more with many nodes.

The full-precision average (warmup) takes the same two levels: reduce-scatter inside the node,
``all_reduce`` of the shard between nodes, ``all_gather`` inside the node.

Ranks are numbered node by node (rank ``r`` is local rank ``r % L`` of node ``r // L``), as
torchrun, SLURM and Lightning number them.
[`NodeGroups`][lightning_onebit.comm.hierarchical.NodeGroups] checks it against the ranks' host
names once.
"""

from __future__ import annotations

import contextlib
import os
import socket
import warnings
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_onebit import kernels
from lightning_onebit.comm.base import (
    Exchange,
    Handle,
    NonFiniteError,
    all_finite,
    all_gather_single,
    check_input,
    fp32_allreduce_bytes,
    new_group,
)
from lightning_onebit.comm.flat import CompressedAllreduce
from lightning_onebit.comm.handle import ExchangeHandle

__all__ = [
    "HierarchicalAllreduce",
    "NodeGroups",
    "average_bytes",
    "hierarchical_average",
    "resolve_ranks_per_node",
]


def resolve_ranks_per_node(
    hierarchical: bool | str, ranks_per_node: int | None, world_size: int
) -> int | None:
    """``L`` when the exchange should be hierarchical (``N > 1`` nodes of ``L > 1`` ranks), else
    ``None`` (the flat exchange). ``ranks_per_node`` defaults to ``LOCAL_WORLD_SIZE`` (torchrun).

    ``hierarchical=True`` with one node or one rank per node warns and runs the flat exchange
    (with one node there is no slow link to spare; with one rank per node nothing to reduce
    first); without a known ``L`` it raises. ``"auto"`` decides silently.
    """
    if hierarchical is False:
        return None
    if ranks_per_node is None and os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():
        ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    if ranks_per_node is None:
        if hierarchical is True:
            raise ValueError(
                "hierarchical=True needs the number of ranks per node: pass ranks_per_node=L "
                "(or launch with torchrun, which sets LOCAL_WORLD_SIZE)"
            )
        return None
    if world_size % ranks_per_node:
        raise ValueError(
            f"ranks_per_node={ranks_per_node} does not divide the world size {world_size}: "
            "the hierarchical exchange needs the same number of ranks on every node"
        )
    if ranks_per_node > 1 and world_size > ranks_per_node:
        return ranks_per_node
    if hierarchical is True:
        why = "one node" if world_size == ranks_per_node else "one rank per node"
        warnings.warn(
            f"hierarchical=True with {why} ({world_size} ranks, {ranks_per_node} per node): "
            "nothing to split into two levels, the flat 1-bit exchange runs",
            UserWarning,
            stacklevel=3,
        )
    return None


class NodeGroups:
    """The process groups of the two levels: this rank's node (``intra``) and the ranks with its
    local index on every node (``inter``).

    Built collectively (every rank of the default group must construct it, in the same order
    as any other group): ``group``'s ranks, numbered node by node, form ``N = W / L`` nodes of
    ``L = ranks_per_node``. One ``all_gather_object`` of the host names checks that ranks of one
    node share a host (several nodes may share one: emulation, tests).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        ranks_per_node: int,
        timeout: timedelta | None = None,
    ) -> None:
        ranks = (
            list(range(dist.get_world_size()))
            if group is None
            else dist.get_process_group_ranks(group)
        )
        w, ll = len(ranks), ranks_per_node
        if ll < 2 or w % ll or w == ll:
            raise ValueError(f"{w} ranks cannot form several nodes of {ll} > 1 ranks")
        me = dist.get_rank(group)
        self.local_size, self.nodes = ll, w // ll
        self.local_rank, self.node_rank = me % ll, me // ll
        hosts: list[Any] = [None] * w
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        for n in range(self.nodes):
            block = hosts[n * ll : (n + 1) * ll]
            if len(set(block)) > 1:
                raise ValueError(
                    f"ranks_per_node={ll}: ranks {n * ll}-{(n + 1) * ll - 1} should share a node "
                    f"but run on hosts {sorted(set(block))}; pass the number of ranks per node "
                    "(devices=... in Lightning, --nproc-per-node in torchrun)"
                )
        backend = dist.get_backend(group)
        # every rank creates every group (new_group is collective over the default group)
        for n in range(self.nodes):
            g = new_group(ranks[n * ll : (n + 1) * ll], backend, timeout, f"node {n}'s group")
            if n == self.node_rank:
                self.intra = g
        for k in range(ll):
            g = new_group(ranks[k::ll], backend, timeout, f"the group of local ranks {k}")
            if k == self.local_rank:
                self.inter = g
        self._open = True

    @property
    def world_size(self) -> int:
        return self.nodes * self.local_size

    def close(self) -> None:
        """Destroy this rank's two groups (once) and let go of them (a destroyed group keeps
        its threads while referenced)."""
        groups, self._open = (self.intra, self.inter) if self._open else (), False
        for g in groups:
            with contextlib.suppress(RuntimeError, ValueError):  # gone with the default group
                dist.destroy_process_group(g)
        self.intra = self.inter = None

    def __repr__(self) -> str:
        return f"NodeGroups(nodes={self.nodes}, ranks_per_node={self.local_size})"


def _reduce_scatter(
    x: torch.Tensor, parts: torch.Tensor, out: torch.Tensor, nodes: NodeGroups
) -> None:
    """``out`` = this local rank's shard of the sum over the node of ``x`` (``L * shard``
    values), summed in local-rank order (the same on every node and every run)."""
    dist.all_to_all_single(parts.view(-1), x, group=nodes.intra)
    torch.sum(parts, dim=0, out=out)


def hierarchical_average(flat: torch.Tensor, dtype: torch.dtype, nodes: NodeGroups) -> None:
    """Average ``flat`` (fp32) over all ranks in place, in two levels: reduce-scatter inside the
    node, ``all_reduce`` of the shard between nodes, ``all_gather`` inside the node (in
    ``dtype``; half dtypes divide by ``W`` first, as DDP's compress hooks)."""
    ll, w, n = nodes.local_size, nodes.world_size, flat.numel()
    shard = -(-n // ll)
    buf = torch.zeros(ll * shard, dtype=dtype, device=flat.device)
    buf[:n].copy_(flat)
    if dtype != torch.float32:
        buf.div_(w)
    parts = torch.empty(ll, shard, dtype=dtype, device=flat.device)
    mine = torch.empty(shard, dtype=dtype, device=flat.device)
    _reduce_scatter(buf, parts, mine, nodes)
    dist.all_reduce(mine, group=nodes.inter)
    all_gather_single(buf, mine, group=nodes.intra)
    if dtype == torch.float32:
        torch.div(buf[:n], w, out=flat)
    else:
        flat.copy_(buf[:n])


def average_bytes(numel: int, dtype: torch.dtype, nodes: NodeGroups) -> tuple[int, int]:
    """``(inside the node, between nodes)`` bytes one rank sends in
    [`hierarchical_average`][lightning_onebit.comm.hierarchical.hierarchical_average]."""
    ll, size = nodes.local_size, torch.finfo(dtype).bits // 8
    shard = -(-numel // ll)
    intra = 2 * (ll - 1) * shard * size  # all_to_all + all_gather
    return intra, fp32_allreduce_bytes(shard, nodes.nodes) * size // 4


class _Handle(Handle):
    """A finished hierarchical call: the
    [`ExchangeHandle`][lightning_onebit.comm.handle.ExchangeHandle] interface (``wait``, ``commit``,
    ``discard``, ``finite``, ``get_future``)."""

    def __init__(
        self,
        owner: HierarchicalAllreduce,
        inner: ExchangeHandle,
        out: torch.Tensor,
        shape: torch.Size,
        bad: list[int],
        ok: torch.Tensor | None = None,
    ) -> None:
        self._owner, self._inner, self._out, self._shape = owner, inner, out, shape
        self.finite = not bad
        self.bad_nodes = bad
        self.ok = ok  # device_verdict: the verdict on the device (finite is then always True)
        self._result: torch.Tensor | None = None

    def error(self) -> NonFiniteError:
        return self._owner.non_finite_error(self.bad_nodes)

    def wait(self, out: torch.Tensor | None = None) -> torch.Tensor:
        if not self.finite:
            raise self.error()
        if self._result is None:
            out = self._out if out is None else out
            self._result = self._owner.decode(out).view(self._shape)
        return self._result

    def commit(self, ok: torch.Tensor | None = None) -> None:
        if not self.finite:
            raise self.error()
        self._inner.commit(self.ok if ok is None else ok)
        self._owner.forget_call(self)

    def discard(self) -> None:
        self._inner.discard()
        self._owner.forget_call(self)

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self.wait())
        return fut


class HierarchicalAllreduce(Exchange):
    """The two-level compressed average of a fp32 buffer of fixed size (module docstring): the
    interface of [`CompressedAllreduce`][lightning_onebit.comm.flat.CompressedAllreduce]
    (``start``/``__call__``, ``commit=False`` handles, ``state_dict``, byte counters), over
    [`NodeGroups`][lightning_onebit.comm.hierarchical.NodeGroups].

    The inter-node exchange is always double buffered: whether a call goes through is known
    only once every node has answered (step 3), so its error buffers advance on commit.
    ``bytes_sent`` = ``bytes_sent_intra + bytes_sent_inter`` (this rank, last call).
    ``device_verdict``: as
    [`CompressedAllreduce`][lightning_onebit.comm.flat.CompressedAllreduce]'s. A non-finite input
    makes every server's record of its shard NaN, which step 3 brings to every rank: the verdict is
    whether every gathered scale is finite, the same on every rank of every node (it cannot name the
    node: every node's record of that shard is NaN).
    """

    def __init__(
        self,
        numel: int,
        nodes: NodeGroups,
        device: torch.device | str = "cpu",
        *,
        double_buffered: bool = False,
        device_verdict: bool = False,
        recompute_error: bool = False,
    ) -> None:
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 1:
            raise ValueError(f"numel must be a positive int, got {numel!r}")
        self.nodes = nodes
        ll, nn = nodes.local_size, nodes.nodes
        self.numel = numel
        self.world_size = nodes.world_size
        self.rank = nodes.node_rank * ll + nodes.local_rank
        # shard = a multiple of 8 N: the inter exchange pads nothing, and the L * N records
        # decode in one call straight into the output
        self.shard_numel = -(-numel // (8 * nn * ll)) * 8 * nn
        self.padded_numel = ll * self.shard_numel
        self.device_verdict = bool(device_verdict)
        self.inter = CompressedAllreduce(
            self.shard_numel,
            device=device,
            group=nodes.inter,
            double_buffered=True,
            device_verdict=self.device_verdict,
            recompute_error=recompute_error,
        )
        self.device = self.inter.device
        self._double = double_buffered
        # the scratch of a call, made at the first (``_make_buffers``)
        self._padded: torch.Tensor | None = None
        self._parts: torch.Tensor | None = None
        self._shard: torch.Tensor | None = None
        self._block: torch.Tensor | None = None  # for a failed shard
        self._gathered: torch.Tensor | None = None
        self._out: torch.Tensor | None = None  # made at the first call without an out
        self._uncommitted: _Handle | None = None
        kw: dict[str, Any] = {"device": self.device}
        # device_verdict: whether each rank's node was finite, and all of them (last call)
        self._finite_ranks = torch.ones(self.world_size, dtype=torch.bool, **kw)
        self._ok = torch.ones(1, dtype=torch.bool, **kw)
        self.bytes_sent_intra = 0
        self.bytes_sent_inter = 0
        self.total_bytes_sent = 0
        self.calls = 0

    @property
    def double_buffered(self) -> bool:
        return self._double

    def _make_buffers(self) -> None:
        """Make a call's scratch buffers, once (an optimizer's warmup never calls)."""
        if self._gathered is not None:
            return
        ll, nn, record = self.nodes.local_size, self.nodes.nodes, self.inter.record_bytes
        kw: dict[str, Any] = {"dtype": torch.float32, "device": self.device}
        if self.padded_numel != self.numel:
            self._padded = torch.zeros(self.padded_numel, **kw)
        self._parts = torch.empty(ll, self.shard_numel, **kw)
        self._shard = torch.empty(self.shard_numel, **kw)
        self._block = torch.zeros(nn, record, dtype=torch.uint8, device=self.device)
        self._gathered = torch.zeros(ll * nn, record, dtype=torch.uint8, device=self.device)

    @property
    def verdict(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``device_verdict``: the last call's verdict on the device, ``(ok, finite_ranks)``
        (a rank counts as not finite when any rank of its node was not)."""
        return self._ok, self._finite_ranks

    @property
    def bytes_sent(self) -> int:
        return self.bytes_sent_intra + self.bytes_sent_inter

    @property
    def bytes_per_call(self) -> int:
        return self._intra_bytes_per_call + self.inter.bytes_per_call

    @property
    def _intra_bytes_per_call(self) -> int:
        ll = self.nodes.local_size
        return (ll - 1) * (4 * self.shard_numel + self.inter.record_bytes * self.nodes.nodes)

    @property
    def fp32_allreduce_bytes(self) -> int:
        return fp32_allreduce_bytes(self.numel, self.world_size)

    def prepare(
        self, values: torch.Tensor | kernels.ExchangeSource, *, commit: bool = True
    ) -> torch.Tensor:
        """The part of a call that reads its input, now (see
        [`CompressedAllreduce.prepare`][lightning_onebit.comm.flat.CompressedAllreduce.prepare]): a
        [`ExchangeSource`][lightning_onebit.kernels.sources.ExchangeSource] is materialized (the
        node's full-precision reduce-scatter reads the values first)."""
        return values.materialize() if isinstance(values, kernels.ExchangeSource) else values

    def start(
        self,
        tensor: torch.Tensor | kernels.ExchangeSource,
        out: torch.Tensor | None = None,
        *,
        commit: bool = True,
    ) -> _Handle:
        """Run the three steps (all of them: the handle is finished); see
        [`CompressedAllreduce.start`][lightning_onebit.comm.flat.CompressedAllreduce.start]."""
        if not commit and not self._double:
            raise ValueError("start(commit=False) needs double_buffered=True")
        if self._uncommitted is not None:
            raise RuntimeError(
                "the previous start(commit=False) was neither committed nor discarded"
            )
        x = check_input(self.prepare(tensor), self.numel, self.device)
        self._make_buffers()
        if out is None:
            if self._out is None:
                self._out = torch.empty(self.numel, dtype=torch.float32, device=self.device)
            out = self._out
        if self._padded is not None:
            self._padded[: self.numel].copy_(x)
            x = self._padded
        nn, record = self.nodes.nodes, self.inter.record_bytes
        # 1. reduce-scatter inside the node: this rank's shard of the node's average
        _reduce_scatter(x, self._parts, self._shard, self.nodes)
        self._shard.div_(self.nodes.local_size)
        # 2. the 1-bit exchange of the shard between nodes (not committed yet)
        inner = self.inter.start(self._shard, commit=False)
        if inner.finite:
            block = inner.records()
        else:  # NaN scales where a rank's input was not finite: every node learns it in 3.
            block = self._block
            block.zero_()
            scales = block.view(nn, record).view(torch.float32)[:, 0]
            scales[inner.bad_ranks] = float("nan")
        # 3. every shard's records to every rank of the node
        all_gather_single(self._gathered.view(-1), block.reshape(-1), group=self.nodes.intra)
        self.calls += 1
        self.bytes_sent_intra = self._intra_bytes_per_call
        self.bytes_sent_inter = self.inter.bytes_sent
        self.total_bytes_sent += self.bytes_sent
        scales = self._gathered.view(torch.float32)[:, 0]
        bad = []
        if self.device_verdict:  # every rank gathered the same records: the same verdict
            per_node = torch.isfinite(scales).view(self.nodes.local_size, nn).all(dim=0)
            self._finite_ranks.copy_(per_node.repeat_interleave(self.nodes.local_size))
            torch.all(self._finite_ranks, dim=0, keepdim=True, out=self._ok)
            handle = _Handle(self, inner, out, tensor.shape, bad, ok=self._ok)
            if commit:
                handle.commit()
            else:
                self._uncommitted = handle
            return handle
        if not all_finite(scales):
            # record (k, i) is shard k from node i: the node's reduce-scatter mixed its ranks'
            # values, so the node is what can be named
            flags = (~torch.isfinite(scales)).view(self.nodes.local_size, nn).nonzero().tolist()
            bad = sorted({i for _, i in flags})
        handle = _Handle(self, inner, out, tensor.shape, bad)
        if not handle.finite:
            if inner.finite:
                inner.discard()
            if commit:
                raise handle.error()
            return handle
        if commit:
            inner.commit()
        else:
            self._uncommitted = handle
        return handle

    bounds = None  # one exchange, no buckets

    def __call__(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.start(tensor, out=out).wait()

    #: ``finish`` always decodes.
    returns_runs = False

    def pending(self) -> list[tuple[int, int]]:
        """The flat ranges
        [`finish`][lightning_onebit.comm.hierarchical.HierarchicalAllreduce.finish] takes an input
        for: the whole buffer."""
        return [(0, self.numel)]

    def finish(self, sources: Sequence[kernels.ExchangeSource], out: torch.Tensor | None) -> None:
        """One call over the whole buffer from ``sources`` (one input:
        [`pending`][lightning_onebit.comm.hierarchical.HierarchicalAllreduce.pending]), decoded into
        ``out`` (see ``CompressedAllreduce.finish``; ``None`` is refused)."""
        if out is None:
            raise ValueError("the hierarchical exchange always decodes: give finish() an out")
        (values,) = sources
        self.start(values, out=out).wait()

    def inter_node_bytes(self, ranks_per_node: int) -> int:
        """Of the bytes this rank sent in the last call, those that left its node: the
        inter-node exchange's (``ranks_per_node`` is this exchange's own)."""
        return self.bytes_sent_inter

    def decode(self, out: torch.Tensor) -> torch.Tensor:
        """Decode the last call's gathered records into ``out`` (``numel`` values)."""
        row = self.inter.chunk_numel // 8
        kernels.decompress(
            self._gathered[:, 4 : 4 + row],
            self._gathered.view(torch.float32)[:, 0],
            out.view(-1),
        )
        return out

    def forget_call(self, handle: Handle) -> None:
        """(Called by the handle's ``commit``/``discard``.) ``handle``'s call is over: none
        is left uncommitted."""
        self._uncommitted = None

    def non_finite_error(self, bad: list[int]) -> NonFiniteError:
        """The error of the last call, whose input was not finite on the nodes ``bad``."""
        ll = self.nodes.local_size
        ranks = ", ".join(f"{i * ll}-{i * ll + ll - 1}" for i in bad)
        return NonFiniteError(
            f"non-finite values (NaN/Inf) entered the 1-bit exchange on node(s) {bad} (ranks "
            f"{ranks}) of {self.nodes.nodes} nodes x {ll} ranks (hierarchical, call "
            f"{self.calls}); every rank stops in this call with its error buffers unchanged "
            "(the 1-bit optimizers skip the step on every rank)"
        )

    # ------------------------------------------------------------------ state

    @property
    def worker_error(self) -> torch.Tensor:
        """This rank's worker error (of its shard of the node's average)."""
        return self.inter.worker_error

    @property
    def server_error(self) -> torch.Tensor:
        return self.inter.server_error

    def error_views(self, lo: int, hi: int) -> list[torch.Tensor]:
        """Live views of this rank's error buffers over the values ``[lo, hi)`` (see
        [`error_views`][lightning_onebit.comm.flat.CompressedAllreduce.error_views]): those of its
        shard."""
        k0 = self.nodes.local_rank * self.shard_numel
        a, b = max(lo, k0), min(hi, k0 + self.shard_numel)
        return self.inter.error_views(a - k0, b - k0) if a < b else []

    def reset_error(self) -> None:
        self.inter.reset_error()

    def _layout(self) -> list[int]:
        return [self.nodes.nodes, self.nodes.local_size]

    def state_dict(self) -> dict[str, Any]:
        """This rank's error buffers (those of its shard) and the layout they belong to."""
        return {
            "numel": self.numel,
            "world_size": self.world_size,
            "nodes": self._layout(),
            "shard": self.inter.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what
        [`state_dict`][lightning_onebit.comm.hierarchical.HierarchicalAllreduce.state_dict] saved
        with the same size and the same layout.

        Raises:
            ValueError: saved by a flat exchange, another layout or another size (the error
                buffers belong to a rank's shard; call ``reset_error`` instead).
        """
        saved = state_dict.get("nodes")
        if saved is None or list(saved) != self._layout() or state_dict.get("numel") != self.numel:
            was = (
                f"{saved[0]} nodes x {saved[1]} ranks"
                if saved is not None
                else f"a flat exchange of {state_dict.get('world_size')} ranks"
            )
            raise ValueError(
                f"error buffers saved with {was} ({state_dict.get('numel')} values) cannot be "
                f"loaded into the hierarchical exchange of {self.nodes.nodes} nodes x "
                f"{self.nodes.local_size} ranks ({self.numel} values); use reset_error()"
            )
        self.inter.load_state_dict(state_dict["shard"])

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(numel={self.numel}, nodes={self.nodes.nodes}, "
            f"ranks_per_node={self.nodes.local_size}, device={self.device})"
        )
