"""The flat layout of the optimizer state: every trainable parameter back to back, group after
group, in one fp32 buffer per state, and the buffers built (and rebuilt) from it."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from lightning_onebit.comm import BucketedAllreduce, make_exchange

__all__ = ["FlatBuffers", "Layout"]


class Layout:
    """Where each trainable parameter lives in the flat buffers (group after group)."""

    def __init__(self, param_groups: list[dict[str, Any]]) -> None:
        self.params: list[torch.Tensor] = []
        self.offsets: list[int] = []
        self.group_of: list[int] = []
        self.segments: list[slice] = []  # one contiguous slice of the flat buffers per group
        n = 0
        for gi, group in enumerate(param_groups):
            start = n
            for p in group["params"]:
                if p.requires_grad:
                    self.params.append(p)
                    self.offsets.append(n)
                    self.group_of.append(gi)
                    n += p.numel()
            self.segments.append(slice(start, n))
        if not self.params:
            raise ValueError("the optimizer has no parameters with requires_grad=True")
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(
                f"all parameters must be on one device, got {sorted(map(str, devices))}; "
                "move the model with .to(device) before the first step"
            )
        self.device = devices.pop()
        self.numel = n
        self.key = tuple(id(p) for p in self.params)
        #: each parameter's number of values, on their device (per-tensor means)
        self.sizes = torch.tensor([p.numel() for p in self.params], device=self.device)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views (shaped like the parameters) into a flat buffer."""
        return [
            flat[o : o + p.numel()].view_as(p)
            for p, o in zip(self.params, self.offsets, strict=True)
        ]

    def group_bounds(self) -> list[tuple[int, int]]:
        """The flat ``(start, stop)`` of every group with trainable parameters, in order."""
        return [(s.start, s.stop) for s in self.segments if s.stop > s.start]

    def group_params(self, gi: int) -> list[int]:
        return [j for j, g in enumerate(self.group_of) if g == gi]


class FlatBuffers:
    """``OneBitOptimizer``'s flat buffers (state, gradients, parameters, scratch) and the
    exchange over them: built at the first step, rebuilt when the parameters change."""

    def _prepare(self) -> None:
        """(Re)build the flat layout when needed, adopting any existing per-parameter state.

        Runs at the first step and again whenever the parameters, their device, or a state
        tensor changed behind our back (``load_state_dict``, ``add_param_group``, a tool that
        moved the state to another device).
        """
        layout = self._layout
        if layout is not None and self._layout_intact(layout):
            return
        layout = Layout(self.param_groups)
        self._check_joined(layout)
        device, n, kw = layout.device, layout.numel, {"device": layout.device}
        flat = {name: torch.zeros(n, dtype=torch.float32, **kw) for name in self._flat_states}
        scalars = {
            name: torch.full((len(layout.params),), init, dtype=torch.float32, **kw)
            for name, init in self._scalar_states.items()
        }
        views: dict[str, list[torch.Tensor]] = {}
        for name, buf in flat.items():
            views[name] = layout.views(buf)
        for name, buf in scalars.items():
            views[name] = list(buf.unbind())
        for j, p in enumerate(layout.params):
            state = self.state[p]
            for name in (*flat, *scalars):
                old = state.get(name)
                if old is not None:  # adopt what load_state_dict (or the last layout) left
                    views[name][j].copy_(old.detach().reshape(views[name][j].shape))
                state[name] = views[name][j]
        self._flat, self._scalars = flat, scalars
        self._grad = torch.zeros(n, dtype=torch.float32, **kw)
        self._param_flat = torch.zeros(n, dtype=torch.float32, **kw)
        self._work = {
            name: torch.zeros(n, dtype=torch.float32, **kw) for name in self._work_buffers
        }
        views["grad"] = layout.views(self._grad)
        views["param"] = layout.views(self._param_flat)
        for name, buf in self._work.items():
            views[name] = layout.views(buf)
        self._views = views

        # Each param group is exchanged on its own (its own scale and error buffers, as
        # DeepSpeed does): biases and norms in a group of their own are not quantised with the
        # weights' scale. With the overlap, its buckets never span two groups.
        bounds = self._overlap.plan(layout) if self._overlap is not None else None
        ex = self._exchange
        groups = layout.group_bounds()
        if bounds is None and len(groups) > 1:
            bounds = groups
        same_buckets = ex is not None and ex.bounds == bounds
        if ex is not None and (ex.numel != n or ex.device != device or not same_buckets):
            if ex.numel == n and same_buckets:  # only the device changed: carry the errors over
                if self._pending_exchange_state is None:
                    self._pending_exchange_state = ex.state_dict()
            elif ex.calls > 0:
                warnings.warn(
                    "the set of trainable parameters or the exchange's buckets changed: the "
                    "1-bit error buffers restart from zero",
                    RuntimeWarning,
                    stacklevel=3,
                )
            ex = None
        nodes = self.node_groups()  # (collective the first time: every rank is here)
        if ex is None and bounds is not None:
            group = self._overlap.group() if self._overlap is not None else self.process_group
            if self._overlap is not None:
                nodes = self._overlap.nodes()
            ex = BucketedAllreduce(
                bounds, device=device, group=group, nodes=nodes,
                device_verdict=self.verdict.uses_device(device),
            )  # fmt: skip
        elif ex is None:
            ex = make_exchange(
                n, device, self.process_group, nodes,
                device_verdict=self.verdict.uses_device(device),
            )  # fmt: skip
        if self._overlap is not None:
            self._overlap.install(layout)
        pending, self._pending_exchange_state = self._pending_exchange_state, None
        if pending == "reset":  # loaded a checkpoint taken before the first exchange
            ex.reset_error()
        elif pending is not None:
            try:
                ex.load_state_dict(pending)
            except ValueError as err:  # another world size: the per-rank errors do not map
                warnings.warn(
                    f"{err}; the 1-bit error buffers restart from zero",
                    RuntimeWarning,
                    stacklevel=3,
                )
                ex.reset_error()
        self._exchange = ex
        self._layout = layout
        self._trained_ids = frozenset(layout.key)
        self._denominator = None
        self._check_masks()
        self._on_layout()

    def _check_masks(self) -> None:
        for gi, group in enumerate(self.param_groups):
            mask = group.get("exp_avg_mask")
            if mask is None:
                continue
            for j in self._layout.group_params(gi):
                shape = self._layout.params[j].shape
                if torch.broadcast_shapes(mask.shape, shape) != shape:
                    raise ValueError(
                        f"exp_avg_mask of shape {tuple(mask.shape)} in param group {gi} does not "
                        f"broadcast to its parameter of shape {tuple(shape)}; the mask multiplies "
                        "every parameter of its group: put the masked parameter in its own group"
                    )

    def _on_layout(self) -> None:
        """Hook for subclasses whose own state depends on the layout (e.g. per-group lists)."""

    def _layout_intact(self, layout: Layout) -> bool:
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if tuple(id(p) for p in params) != layout.key:
            return False
        if any(p.device != layout.device for p in params):
            return False
        for j, p in enumerate(params):
            state = self.state.get(p)
            if state is None:
                return False
            for name in (*self._flat, *self._scalars):
                if state.get(name) is not self._views[name][j]:
                    return False
        return True
