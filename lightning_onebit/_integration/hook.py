"""The DDP communication hook of the 1-bit strategies and its state (shaped like torch's
``powerSGD_hook``): a full-precision average on the steps whose optimizer needs averaged
gradients (warmup; 0/1 Adam's variance steps; in two levels when the optimizer's exchange is
hierarchical), nothing on the others (the optimizer exchanges its 1-bit compressed momentum
itself)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from lightning_onebit._integration.checks import check_same_model_on_every_rank
from lightning_onebit.comm import NodeGroups, hierarchical_average
from lightning_onebit.optim import OneBitOptimizer

__all__ = ["HookState", "build_ddp", "onebit_comm_hook", "wrap_in_ddp"]


def build_ddp(
    module: torch.nn.Module, device_ids: list[int] | None, kwargs: dict[str, Any]
) -> DistributedDataParallel:
    """``DistributedDataParallel(module)`` built on the current CUDA stream, the one training runs
    on, as torch recommends. Lightning's DDP strategies build it on a fresh side stream (for
    capturing the whole step in a CUDA graph, which the 1-bit strategies do not support: the
    exchange reads its NaN/Inf verdict on the host). DDP keeps every parameter's AccumulateGrad
    node, which belongs to the stream it was made on, so with a side stream every backward
    accumulates gradients across streams (torch >= 2.10 warns once per run: "The AccumulateGrad
    node's stream does not match the stream of the node that produced the incoming gradient.
    This may incur unnecessary synchronization ...")."""
    return DistributedDataParallel(module=module, device_ids=device_ids, **kwargs)


def _ddp_averaged(ddp: DistributedDataParallel) -> frozenset[int]:
    """``id``s of the parameters whose gradients ``ddp`` averages: those that required grad
    when it was built, less the ones it was told to ignore (it never registers one later)."""
    ignored = getattr(ddp, "parameters_to_ignore", set())
    return frozenset(
        id(p)
        for name, p in ddp.module.named_parameters()
        if p.requires_grad and name not in ignored
    )


class HookState:
    """What the communication hook needs: the group, and the optimizer that says which kind of
    gradients its next step wants (set once the optimizer exists, by ``attach``)."""

    def __init__(
        self, process_group: dist.ProcessGroup | None, ddp: DistributedDataParallel
    ) -> None:
        self.process_group = process_group
        self.optimizer: OneBitOptimizer | None = None
        self.averaged: frozenset[int] | None = _ddp_averaged(ddp)
        self._pool: ThreadPoolExecutor | None = None  # the two-level averages' thread
        self._stream: Any = None  # its CUDA stream

    def __getstate__(self) -> dict[str, Any]:
        # the process group cannot be pickled, and the parameters' ids mean nothing elsewhere
        return {
            "optimizer": None,
            "process_group": None,
            "averaged": None,
            "_pool": None,
            "_stream": None,
        }

    def attach(self, optimizer: OneBitOptimizer | None) -> None:
        """The optimizer whose steps the hook serves; it averages itself the warmup gradients of
        the parameters DDP does not (made trainable after DDP was built)."""
        self.optimizer = optimizer
        if optimizer is not None:
            optimizer.caller_averaged = self.averaged

    def close(self) -> None:
        """Stop the thread of the two-level averages (at teardown)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def average_in_two_levels(
        self, nodes: NodeGroups, dtype: torch.dtype, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        """The bucket's average over the optimizer's
        [`NodeGroups`][lightning_onebit.comm.hierarchical.NodeGroups], on a thread of its own (as
        DDP's allreduce, it runs while backward goes on). Buckets come in the same order on every
        rank (DDP's), and one thread keeps that order for the groups' collectives. On CUDA the
        thread waits for the stream that produced the gradients, works on a stream of its own, and
        the future hands the result back through CUDA events."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="onebit-average")
        buf = bucket.buffer()
        cuda = buf.is_cuda
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(
            devices=[buf.device] if cuda else None
        )
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(buf.device))

        def run() -> None:
            try:
                if cuda:
                    if self._stream is None:  # only this thread uses it
                        self._stream = torch.cuda.Stream(buf.device)
                    stream = self._stream
                    with torch.cuda.device(buf.device), torch.cuda.stream(stream):
                        stream.wait_event(ready)
                        hierarchical_average(buf, dtype, nodes)
                        fut.set_result(buf)  # records an event on this stream
                else:
                    hierarchical_average(buf, dtype, nodes)
                    fut.set_result(buf)
            except BaseException as e:
                fut.set_exception(e)

        self._pool.submit(run)
        return fut


#: DDP's hook for the average in each ``average_dtype`` (the half ones cast, divide, sum, cast back).
_AVERAGE_HOOKS = {
    torch.float32: default_hooks.allreduce_hook,
    torch.bfloat16: default_hooks.bf16_compress_hook,
    torch.float16: default_hooks.fp16_compress_hook,
}


def onebit_comm_hook(
    state: HookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Full-precision average on steps that need it (unless the optimizer averages them itself:
    an integer-coded ``average_dtype``), nothing on the others (local gradients)."""
    opt = state.optimizer
    if opt is None:
        return default_hooks.allreduce_hook(state.process_group, bucket)
    if opt.expects_averaged_grads and not opt.average_warmup_grads:
        nodes = opt.node_groups()
        if nodes is not None:
            return state.average_in_two_levels(nodes, opt.average_dtype, bucket)
        return _AVERAGE_HOOKS[opt.average_dtype](state.process_group, bucket)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


# DDP checks the hook's annotations as objects; `from __future__ import annotations` made them strings.
onebit_comm_hook.__annotations__ = {
    "state": HookState,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def wrap_in_ddp(
    module: torch.nn.Module, device_ids: list[int] | None, kwargs: dict[str, Any]
) -> tuple[DistributedDataParallel, HookState]:
    """``module`` in DDP (``build_ddp``) with ``onebit_comm_hook`` registered, on every
    device (Lightning's Trainer ``DDPStrategy`` registers a hook on CUDA only, Fabric's none:
    DDP's allreduce on every step otherwise), and the hook's state (``HookState.attach``
    the optimizer to it). First checks that every rank has the same parameters: DDP's own check
    names neither the parameter nor what to do."""
    check_same_model_on_every_rank(
        [(name, tuple(p.shape)) for name, p in module.named_parameters()]
    )
    ddp = build_ddp(module, device_ids, kwargs)
    state = HookState(process_group=None, ddp=ddp)
    ddp.register_comm_hook(state, onebit_comm_hook)
    return ddp, state
