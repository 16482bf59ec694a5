"""Overlap of the compressed exchange with backward (``OneBitOptimizer.overlap_with_backward``).

Backward produces gradients from the last layer to the first. The flat buffers are cut into
buckets of about ``bucket_cap_mb`` each, from the end of the layout (the last parameters, whose
gradients come first) to its start; bucket ``b`` is exchanged by its own double-buffered
[`CompressedAllreduce`][lightning_onebit.comm.flat.CompressedAllreduce]
(``comm.BucketedAllreduce``). A post-accumulate-grad hook on every parameter notes its gradient as
ready; as soon as buckets ``0..b`` are complete, the hook runs the part of bucket ``b``'s exchange
that reads the gradients: what the algorithm exchanges for its values (e.g. the new momentum,
``_exchange_source``, which reads the gradients where autograd left them or gathers them into
the flat buffer), and where the compression computes that as it reads it
([`ExchangeSource`][lightning_onebit.kernels.sources.ExchangeSource]: the compiled kernels), the
compression too (``BucketedAllreduce.prepare_bucket``). It hands the rest to a single communication
thread, which runs the exchange's compression (if not done), all_to_all and server stage while
backward goes on (C++ kernels and collectives release the GIL). The thread never reads
``.grad``: a later backward
(one whose step never came, or gradient accumulation) writes ``.grad`` without the GIL while
the thread may still be working on the previous one. ``step()`` waits for the thread, starts
the buckets that were not complete (a parameter without a gradient), and commits all buckets or,
if any rank had a NaN/Inf anywhere, none.

Steps that average full-precision gradients (warmup; 0/1 Adam's variance steps) are overlapped
the same way, as DDP does: bucket ``b``'s gradients go into the flat gradient buffer and an
async ``all_reduce`` of that slice starts (fp32, or ``average_dtype``); ``step()`` starts the
remaining buckets' and waits for all of them (``BackwardOverlap.all_reduce``). In integer codes
(``average_dtype`` int4/int8) bucket ``b``'s gradients go into its own exchange's layout and the
thread runs that exchange's collectives (``CodedAverage.start``); ``step()`` starts the others
and commits all, or none where any rank's values were not finite. The same buckets are reduced,
in the same order, whether backward started them or ``step()`` did, so the result does not
depend on timing.

Every rank starts the buckets in index order, on a process group of their own (so that they never
interleave with collectives the training loop issues on the default group), hence the
collectives match across ranks whatever the timing.

The exchange sees the gradients as backward leaves them, and ``step()`` reads them again for
each bucket's error update (one worker error buffer, see
[`CompressedAllreduce`][lightning_onebit.comm.flat.CompressedAllreduce]'s ``recompute_error``):
gradient clipping, loss-scaler unscaling or anything else that edits ``.grad`` between backward
and ``step()`` is refused there with a ``RuntimeError``; turn the overlap off for such loops.
Pause the overlap (``optimizer.overlap_paused = True``) around backward passes whose step does
not follow directly (gradient accumulation); the strategy does this for you.

On CUDA the work crosses threads and streams, so it is ordered explicitly (a new thread's
current device is 0 and its current stream the default one, which orders nothing):

1. Each gradient hook records an event on the current stream of its parameter's device: the
   stream that produced the gradient (autograd runs a node's hooks with its stream current).
   The hook that completes a bucket makes its current stream wait on the bucket's events,
   computes the bucket's exchange source there (or, for an average, copies its gradients into
   the flat buffer) and records one event after that work.
2. The communication thread makes the parameters' device current and runs on a stream of its
   own, which first waits on that event; every kernel and collective
   it starts goes on that stream (ProcessGroupNCCL orders its work after the calling thread's
   current stream), and it records a "done" event after them.
3. ``step()`` (``BackwardOverlap.collect``) makes its own current stream wait on each
   bucket's done event before it reads what the thread wrote; the exchange's final all_gather
   and the averages are waited for in ``step()`` (``work.wait()`` orders the current stream
   after them). Buffers the thread writes are the optimizer's persistent ones; the kernels'
   scratch is allocated on the stream that uses it.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lightning_onebit.comm import (
    CODED_BITS,
    NodeGroups,
    hierarchical_average,
    new_group,
    start_average,
)
from lightning_onebit.optim._coded_average import CodedAverage
from lightning_onebit.optim._flat import FlatState, Layout
from lightning_onebit.optim._ops import SourceOf, as_source
from lightning_onebit.optim._validation import check_real

__all__ = ["BackwardOverlap", "OverlapHost", "replace_overlap"]

#: The first bucket's cap (DDP's ``first_bucket_cap``: 1 MiB).
FIRST_BUCKET_BYTES = 2**20


class OverlapHost(Protocol):
    """What ``BackwardOverlap`` uses of its optimizer (``OneBitOptimizer`` implements it;
    the overlap touches nothing else of it)."""

    #: backward passes whose step does not follow directly start nothing
    overlap_paused: bool
    #: the group the exchange's own group is made from, and the warmup average's dtype
    process_group: Any
    average_dtype: torch.dtype
    average_warmup_grads: bool
    param_groups: list[dict[str, Any]]
    #: the flat buffers (an average's gradients are copied into ``flat.grad``) and the exchange
    flat: FlatState
    #: the average in integer codes, one exchange per bucket (``coded_inputs``)
    coded_average: CodedAverage
    step_count: int

    def coded_inputs(self, step: int) -> list[torch.Tensor]: ...

    @property
    def expects_averaged_grads(self) -> bool: ...

    @property
    def world_size(self) -> int: ...


class BackwardOverlap:
    """The bucket plan, the gradient hooks and the communication thread of one optimizer.

    Args:
        optimizer: the optimizer whose step the buckets start.
        bucket_cap_bytes: the buckets' size.
        timeout: the overlap's own process group's timeout (``None``: torch's).
        source: the optimizer's exchange input for a bucket.
        overlappable: whether the next step's exchange can start from its gradients alone.
    """

    def __init__(
        self,
        optimizer: OverlapHost,
        bucket_cap_bytes: int,
        timeout: timedelta | None,
        source: SourceOf,
        overlappable: Callable[[], bool],
    ) -> None:
        self.opt = optimizer
        self.source, self.overlappable = source, overlappable
        self.cap = bucket_cap_bytes
        self.timeout = timeout
        self.bounds: list[tuple[int, int]] = []
        self.bucket_params: list[list[int]] = []
        self._bucket_of: list[int] = []
        self._hooks: list[Any] = []
        self._pool: ThreadPoolExecutor | None = None
        self._group: Any = None
        self._group_made = False
        self._nodes: NodeGroups | None = None
        self._nodes_made = False
        self._futures: list[Future] = []
        self._events: list[list[Any]] = []  # per bucket: CUDA events of its gradients
        self._stream: Any = None  # the thread's CUDA stream (made at the first CUDA bucket)
        self._device: torch.device | None = None
        self._mode: str | None = None  # what this round's hooks start: "average" / "exchange"
        self._works: list[Callable[[], None]] = []  # this round's started averages' waits
        self._ready: set[int] = set()
        self._missing: list[int] = []
        self._next = 0
        self._finalizer = weakref.finalize(self, _shut_down, None, None, None)

    # ------------------------------------------------------------------ setup

    def plan(self, layout: Layout) -> list[tuple[int, int]]:
        """Bucket bounds in exchange order: whole parameters of one param group, from the end of
        the layout; the first bucket holds at most ``FIRST_BUCKET_BYTES`` (as DDP's), so that the
        link starts working early in backward instead of idling until ``bucket_cap_mb`` of
        gradients exist."""
        bounds, params, of = [], [], [0] * len(layout.params)
        stop, members, size = layout.numel, [], 0
        for j in reversed(range(len(layout.params))):
            members.append(j)
            size += layout.params[j].numel() * 4  # fp32 in the flat buffers
            cap = min(self.cap, FIRST_BUCKET_BYTES) if not bounds else self.cap
            first_of_group = j == 0 or layout.group_of[j - 1] != layout.group_of[j]
            if size >= cap or first_of_group:  # a bucket is one group's: its own scale
                start = layout.offsets[j]
                for k in members:
                    of[k] = len(bounds)
                bounds.append((start, stop))
                params.append(members)
                stop, members, size = start, [], 0
        self.bounds, self.bucket_params, self._bucket_of = bounds, params, of
        self._reset_round()
        return bounds

    def connect(self) -> None:
        """Make the overlap's process groups now (``group``, ``nodes``): collective,
        every rank in the same order; the strategies call it at setup, so that no training
        step creates a group."""
        self.group()
        self.nodes()

    def group(self) -> Any:
        """The exchanges' own process group (made once, by every rank at the same point: at
        ``connect``, else at the first step)."""
        if not self._group_made:
            pg = self.opt.process_group
            if dist.is_available() and dist.is_initialized() and dist.get_world_size(pg) > 1:
                ranks = None if pg is None else dist.get_process_group_ranks(pg)
                self._group = new_group(
                    ranks, dist.get_backend(pg), self.timeout, "the overlapped exchange's group"
                )
                self._rearm()
            self._group_made = True
        return self._group

    def nodes(self) -> Any:
        """The exchanges' own [`NodeGroups`][lightning_onebit.comm.hierarchical.NodeGroups] when the
        optimizer's exchange is hierarchical (made once, like ``group``), else ``None``."""
        if not self._nodes_made:
            base = self.opt.node_groups()
            if base is not None:
                self._nodes = NodeGroups(self.opt.process_group, base.local_size, self.timeout)
                self._rearm()
            self._nodes_made = True
        return self._nodes

    def _rearm(self) -> None:
        """(Re)register the shutdown of the thread and the group: at ``close``, or at the
        interpreter's exit for an optimizer nobody closed."""
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _shut_down, self._pool, self._group, self._nodes)

    def install(self, layout: Layout) -> None:
        """(Re)register the gradient hooks on the layout's parameters."""
        self.remove()
        self._device = layout.device
        self._hooks = [
            p.register_post_accumulate_grad_hook(partial(self._on_grad, j))
            for j, p in enumerate(layout.params)
        ]

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ during backward

    def _on_grad(self, j: int, param: torch.Tensor) -> None:
        opt = self.opt
        if opt.overlap_paused:
            return
        mode = self.mode()
        if mode is None:
            return
        if j in self._ready:  # a second backward before step(): drop what the first started
            self.drop()
        self._mode = mode
        self._ready.add(j)
        b = self._bucket_of[j]
        self._missing[b] -= 1
        if param.device.type == "cuda":  # (1.) where this gradient was produced
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(param.device))
            self._events[b].append(event)
        while self._next < len(self.bounds) and self._missing[self._next] == 0:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="onebit-exchange")
                self._rearm()
            b = self._next
            events, source = self._read_grads(b)
            self._futures.append(self._pool.submit(self._launch, b, events, source))
            self._next += 1

    def _read_grads(self, b: int) -> tuple[list[Any], Any]:
        """Read bucket ``b``'s gradients, here, on the thread that runs backward (see the
        module docstring: the communication thread never reads ``.grad``): for an average,
        copy them into the flat gradient buffer; for an exchange, run the part of its call that
        reads them (``_bucket_input``) and return what the communication thread starts.
        Also returns what the communication thread must
        wait for: on CUDA, an event after that work, which itself follows the streams that
        produced the gradients."""
        device = self._device
        with torch.no_grad():
            if device is None or device.type != "cuda":
                return [], self._bucket_input(b)
            stream = torch.cuda.current_stream(device)
            for event in self._events[b]:
                stream.wait_event(event)
            with torch.cuda.device(device):
                source = self._bucket_input(b)
            done = torch.cuda.Event()
            done.record(stream)
        return [done], source

    def _bucket_input(self, b: int) -> Any:
        """``_read_grads``' work on the current stream: for an exchange, the part of
        bucket ``b``'s call that reads the gradients (``prepare_bucket``: the source, and
        its compression where the kernel computes it as it reads it) and what the
        communication thread then starts; ``None`` after copying its gradients for an
        average."""
        opt = self.opt
        if self._mode == "average":
            opt.flat.gather_grads(opt.param_groups, self.bucket_params[b])
            return None
        if self._mode == "coded":  # into bucket b's exchange (made for the next step's codec)
            views = opt.coded_inputs(opt.step_count + 1)
            opt.flat.gather_grads(opt.param_groups, self.bucket_params[b], into=list(views))
            return None
        source = as_source(self.source(slice(*self.bounds[b])))
        return self.opt.flat.exchange.prepare_bucket(b, source)

    def _launch(
        self, b: int, events: list[Any], source: Any
    ) -> tuple[Any, Any]:  # on the communication thread
        """Start bucket ``b`` (an exchange from ``source``, prepared by ``_read_grads``);
        return its all_reduce's ``wait`` (or None) and, on CUDA, the event recorded after
        everything it enqueued."""
        s = slice(*self.bounds[b])
        device = self._device
        if device is None or device.type != "cuda":
            with torch.no_grad():
                return self._start_bucket(b, s, source), None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        stream = self._stream
        with torch.cuda.device(device), torch.cuda.stream(stream), torch.no_grad():  # 2.
            for event in events:
                stream.wait_event(event)
            work = self._start_bucket(b, s, source)
            done = torch.cuda.Event()
            done.record(stream)
        return work, done

    def mode(self) -> str | None:
        """What backward may start for the next step: ``"average"`` (the average of the
        gradients in ``average_dtype``), ``"coded"`` (in integer codes), ``"exchange"`` (the
        compressed exchange) or ``None`` (nothing)."""
        opt = self.opt
        if opt.flat.layout is None:
            return None
        if opt.expects_averaged_grads:
            if not (opt.average_warmup_grads and opt.world_size > 1):
                return None  # (the caller averages them, or nobody needs to)
            return "coded" if opt.average_dtype in CODED_BITS else "average"
        return "exchange" if self.overlappable() else None

    def _start_bucket(self, b: int, s: slice, source: Any) -> Any:
        if self._mode == "average":
            return self._start_all_reduce(self.opt.flat.grad[s])
        if self._mode == "coded":
            self.opt.coded_average.start(b)
            return None
        self.opt.flat.exchange.start_bucket(b, source)
        return None

    def _start_all_reduce(self, grad: torch.Tensor) -> Callable[[], None]:
        nodes = self.nodes()
        if nodes is not None:  # two levels (synchronous: this thread waits, backward goes on)
            hierarchical_average(grad, self.opt.average_dtype, nodes)
            return lambda: None
        return start_average(grad, self.opt.average_dtype, self.group())

    # ------------------------------------------------------------------ in step()

    def collect(self) -> None:
        """Wait for the thread (re-raising its failure); the hooks' gathered gradients are in
        ``flat.gathered``."""
        futures, self._futures = self._futures, []
        for f in futures:
            work, done = f.result()  # re-raises a failure of the thread (e.g. a dead peer)
            if done is not None:  # (3.) this stream reads what the thread's stream wrote
                torch.cuda.current_stream(self._device).wait_event(done)
            if work is not None:
                self._works.append(work)

    def all_reduce(self) -> None:
        """Average the flat gradient buffer over the ranks, bucket by bucket: wait for the
        buckets backward started, start the others (their gradients are in the buffer by now)."""
        works, self._works = self._works, []
        works += [  # step() gathered their gradients
            self._start_all_reduce(self.opt.flat.grad[lo:hi])
            for lo, hi in self.bounds[len(works) :]
        ]
        for wait in works:
            wait()

    def drop(self) -> None:
        """Forget the current round: wait for the thread, discard the started buckets."""
        self.collect()
        self._settle()
        self.opt.flat.exchange.discard()
        self.opt.coded_average.discard()
        self._reset_round()

    def _settle(self) -> None:
        """Wait for started all_reduces nobody waited for (a dropped round, a failed step):
        they write into the gradient buffer the next round fills."""
        works, self._works = self._works, []
        for wait in works:
            with contextlib.suppress(Exception):  # the step that started it already failed
                wait()

    def _reset_round(self) -> None:
        self.opt.flat.gathered = set()  # what this round's hooks gathered: forgotten with it
        self._ready = set()
        self._missing = [len(m) for m in self.bucket_params]
        self._events = [[] for _ in self.bucket_params]
        self._next = 0
        self._mode = None
        self._works = []

    def end_step(self) -> None:
        """The step is over: discard the buckets it did not use (none normally), wait for stray
        averages, start a new round."""
        self.opt.flat.exchange.discard()
        self.opt.coded_average.discard()
        self._settle()
        self._reset_round()

    def close(self) -> None:
        """Remove the hooks, stop the thread, destroy the exchanges' process group (what this
        class started must not outlive it: a process group left to the interpreter's exit can
        abort it), and let go of the exchange built on it."""
        self.remove()
        self._finalizer()
        self._pool, self._group, self._group_made = None, None, False
        self._nodes, self._nodes_made = None, False
        self.opt.flat.release_exchange()


def _shut_down(pool: ThreadPoolExecutor | None, group: Any, nodes: NodeGroups | None) -> None:
    if pool is not None:
        pool.shutdown(wait=True)
    if dist.is_available() and dist.is_initialized():
        if group is not None:
            with contextlib.suppress(Exception):  # already gone with the default group
                dist.destroy_process_group(group)
        if nodes is not None:
            nodes.close()


def replace_overlap(
    current: BackwardOverlap | None,
    host: OverlapHost,
    bucket_cap_mb: float | None,
    timeout: timedelta | None,
    source: SourceOf,
    overlappable: Callable[[], bool],
) -> BackwardOverlap | None:
    """The overlap ``host`` has after ``overlap_with_backward(bucket_cap_mb, timeout=timeout)``
    (``None``: off): ``current`` if it has these settings, else a new one (or none), the current
    one closed and the exchange built on its groups let go; the layout is then rebuilt (new
    buckets and hooks) at the next step (``source``, ``overlappable``: see
    ``BackwardOverlap``). Raises ``ValueError`` unless ``bucket_cap_mb > 0``."""
    cap = None
    if bucket_cap_mb is not None:
        check_real("bucket_cap_mb", bucket_cap_mb, 0.0, math.inf, low_open=True)
        cap = max(4, int(bucket_cap_mb * 2**20))  # bytes: at least one fp32 value
    if current is not None:
        if cap == current.cap and timeout == current.timeout:
            return current
        current.close()
    host.flat.invalidate()
    return None if cap is None else BackwardOverlap(host, cap, timeout, source, overlappable)
