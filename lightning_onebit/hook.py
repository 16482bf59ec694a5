"""The DDP communication hook of ``OneBitStrategy`` and its state (shaped like torch's
``powerSGD_hook``): a full-precision average on the steps whose optimizer needs averaged
gradients (warmup; 0/1 Adam's variance steps), nothing on the others (the optimizer exchanges
its 1-bit compressed momentum itself)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_onebit.optim import OneBitOptimizer


class _HookState:
    """What the communication hook needs: the group, and the optimizer that says which kind of
    gradients its next step wants (set once the optimizer exists)."""

    def __init__(self, process_group: dist.ProcessGroup | None) -> None:
        self.process_group = process_group
        self.optimizer: OneBitOptimizer | None = None

    def __getstate__(self) -> dict[str, Any]:  # the process group cannot be pickled
        return {"optimizer": None, "process_group": None}


#: DDP's hook for the average in each ``average_dtype`` (the half ones cast, divide, sum, cast back).
_AVERAGE_HOOKS = {
    torch.float32: default_hooks.allreduce_hook,
    torch.bfloat16: default_hooks.bf16_compress_hook,
    torch.float16: default_hooks.fp16_compress_hook,
}


def _onebit_comm_hook(
    state: _HookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Full-precision average on steps that need it, nothing on the others (local gradients)."""
    if state.optimizer is None:
        return default_hooks.allreduce_hook(state.process_group, bucket)
    if state.optimizer.expects_averaged_grads:
        return _AVERAGE_HOOKS[state.optimizer.average_dtype](state.process_group, bucket)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


# DDP checks the hook's annotations as objects; `from __future__ import annotations` made them strings.
_onebit_comm_hook.__annotations__ = {
    "state": _HookState,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
