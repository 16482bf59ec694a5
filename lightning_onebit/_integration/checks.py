"""Checks that turn a later hang or a silent error into a clear error before the first step."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["check_dense_gradients", "check_same_model_on_every_rank"]


def check_same_model_on_every_rank(shapes: list[tuple[str, tuple[int, ...]]]) -> None:
    """Catch a model that differs across ranks now, with a clear error, not as a hang later.

    ``shapes``: (name, shape) of every parameter, in order. Every rank raises the same error.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, shapes)
    if all(o == everyone[0] for o in everyone):
        return

    def summary(r: int) -> str:
        o = everyone[r]
        return f"rank {r}: {len(o)} parameters, {sum(torch.Size(s).numel() for _, s in o):,} values"

    ref = everyone[0]
    r = next(r for r, o in enumerate(everyone) if o != ref)
    other = everyone[r]
    common = min(len(ref), len(other))
    i = next((i for i in range(common) if ref[i] != other[i]), common)
    if i < common:
        first = (
            f"{ref[i][0]!r} has shape {ref[i][1]} on rank 0, {other[i][0]!r} has shape "
            f"{other[i][1]} on rank {r}"
        )
    else:
        longer, q = (ref, 0) if len(ref) > len(other) else (other, r)
        first = (
            f"rank {q} has extra parameters, the first is {longer[i][0]!r} of shape {longer[i][1]}"
        )
    raise RuntimeError(
        f"the model differs across ranks ({'; '.join(summary(q) for q in range(len(everyone)))}): "
        f"{first}. Every rank must build the same model (look for rank-dependent code in "
        "__init__, setup or configure_model)"
    )


def check_dense_gradients(module: torch.nn.Module) -> None:
    """Refuse modules that produce sparse gradients before the first step."""
    for name, mod in module.named_modules():
        if (
            isinstance(mod, (torch.nn.Embedding, torch.nn.EmbeddingBag))
            and mod.sparse
            and mod.weight.requires_grad
        ):
            raise ValueError(
                f"{name or type(module).__name__} ({type(mod).__name__}) has sparse=True: its "
                "gradients are sparse, and the 1-bit optimizers need dense gradients (they average "
                "and compress every value); build it with sparse=False"
            )
