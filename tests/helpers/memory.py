"""What an object holds in memory: every tensor storage it reaches, counted once
(``benchmarks/memory.py`` and ``tests/optim/test_memory.py``)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

__all__ = ["held"]


def held(root: Any, skip: set[int]) -> dict[str, int]:
    """Bytes of every storage reachable from ``root`` through containers and the objects of
    ``lightning_onebit`` and ``torch.optim`` (each storage once; data pointers in ``skip`` left
    out), by the path of attributes (its first three names) that first reached it."""
    seen_obj: set[int] = set()
    seen_storage: set[int] = set(skip)
    by: dict[str, int] = defaultdict(int)
    stack: list[tuple[str, Any]] = [("", root)]
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen_obj:
            continue
        seen_obj.add(id(obj))
        if isinstance(obj, torch.Tensor):
            s = obj.untyped_storage()
            if s.data_ptr() and s.data_ptr() not in seen_storage:
                seen_storage.add(s.data_ptr())
                by[".".join(path.split(".")[:3]) or "?"] += s.nbytes()
            continue
        if isinstance(obj, dict):
            items = [
                (path if isinstance(k, torch.Tensor) else f"{path}.{k}" if path else str(k), v)
                for k, v in obj.items()
            ]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = [(path, v) for v in obj]
        elif type(obj).__module__.startswith(("lightning_onebit", "torch.optim")) or isinstance(
            obj, torch.optim.Optimizer
        ):
            fields = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
            for slot in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, slot):
                    fields[slot] = getattr(obj, slot)
            items = [(f"{path}.{k}" if path else k, v) for k, v in fields.items()]
        else:
            continue
        stack.extend(items)
    return dict(by)
