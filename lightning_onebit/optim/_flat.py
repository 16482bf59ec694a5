"""The flat-buffer layer of the optimizers: every trainable parameter back to back, group after
group, in one fp32 buffer per state (``Layout``), the buffers and their per-parameter views
(``FlatState``), and the exchange over them."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from lightning_onebit.comm import BucketedAllreduce, CompressedAllreduce, NodeGroups, make_exchange

if TYPE_CHECKING:
    from lightning_onebit.optim._overlap import BackwardOverlap
    from lightning_onebit.optim._topology import Topology

__all__ = ["FlatState", "Layout"]


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
        """The parameters (layout indices) of group ``gi``."""
        return [j for j, g in enumerate(self.group_of) if g == gi]

    def name(self, j: int, param_groups: list[dict[str, Any]], names: dict[Any, str]) -> str:
        """Parameter ``j`` for messages: its name in ``names`` (else its place in the param
        groups) and its shape."""
        p = self.params[j]
        name = names.get(p)
        if name is None:
            gi = self.group_of[j]
            i = next(i for i, q in enumerate(param_groups[gi]["params"]) if q is p)
            name = f"param_groups[{gi}][{i}]"
        return f"{name} {tuple(p.shape)}"


#: one group's hyperparameters (a torch param group)
Group = dict[str, Any]


class FlatState:
    """The flat fp32 buffers of one optimizer, their per-parameter views, and the exchange over
    them: built at the first step, rebuilt when the trainable parameters change.

    Interface: ``rebuild_if_stale`` (at every step), ``layout`` (``None`` until built, and after
    ``invalidate``), ``trained`` (the last layout's parameters),
    ``states`` (flat per-parameter states, e.g. ``exp_avg``), ``scalars`` (one value per
    parameter), ``work`` (scratch), ``grad`` and ``param`` (fp32 copies of the
    gradients and parameters), ``views`` (per-parameter views of each, by name, ``"grad"``
    and ``"param"`` included), ``exchange``;
    ``build``, ``release_scratch``, ``intact``, ``fit_exchange``,
    ``release_exchange``,
    ``exchange_state``, ``load_exchange_state``; ``segments``,
    ``segments_in``, ``params_in``, ``gather_grads``, ``grads``,
    ``gather_params``, ``views_of``,
    ``add_to_params_``, ``copy_to_params_``, ``apply_mask_``, ``check_masks``.

    Args:
        owner: the optimizer's class name, for messages.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.layout: Layout | None = None
        self.states: dict[str, torch.Tensor] = {}
        self.scalars: dict[str, torch.Tensor] = {}
        #: the scratch buffers (the work buffers, ``"grad"``, ``"param"``) made so far: each is
        #: made at its first use and kept until ``release_scratch``
        self._scratch: dict[str, torch.Tensor] = {}
        self._scratch_names: tuple[str, ...] = ()
        self._scratch_lock = threading.Lock()  # first uses may come from backward's hooks
        self._scratch_layout: Layout | None = None
        self.work: Mapping[str, torch.Tensor] = _Work(self, ())
        self.views: dict[str, list[torch.Tensor]] = _Views(self)
        #: parameters whose gradients are in ``grad`` already this step
        #: (``gather_grads`` adds them; emptied when the step, or the overlap's round, ends)
        self.gathered: set[int] = set()
        self.exchange: CompressedAllreduce | BucketedAllreduce | None = None
        #: a loaded exchange state the next ``fit_exchange`` applies (``"reset"``: zeros)
        self.pending_exchange: dict[str, Any] | str | None = None
        #: the ``id`` s of the last layout's parameters (kept while ``layout`` is ``None``)
        self.trained: frozenset[int] = frozenset()

    def invalidate(self) -> None:
        """Rebuild the layout (and the buffers) at the next step."""
        self.layout = None

    # ------------------------------------------------------------------ building

    def rebuild_if_stale(
        self,
        param_groups: list[Group],
        state: dict[Any, dict[str, Any]],
        buffers: tuple[tuple[str, ...], dict[str, float], tuple[str, ...]],
        overlap: BackwardOverlap | None,
        topology: Topology,
        device_verdict: Callable[[torch.device], bool],
        check_joined: Callable[[Layout, frozenset[int]], None],
    ) -> bool:
        """(Re)build the layout, the buffers and the exchange unless ``intact``: at the first
        step and whenever the parameters, their device or a state tensor changed behind the
        optimizer's back (``load_state_dict``, ``add_param_group``, a tool that moved the state).
        Return whether it rebuilt.

        Args:
            param_groups, state: the optimizer's.
            buffers: the names of its flat states, scalar states (with their initial values) and
                work buffers (``build``).
            overlap, topology: the overlap with backward and the process and node groups the
                exchange runs on (``fit_exchange``; the node groups are collective the first
                time: every rank prepares at the same step).
            device_verdict: whether steps on a device keep their NaN/Inf verdicts there.
            check_joined: called with the new layout and ``trained`` before anything
                changes (raises for parameters that may not join now).
        """
        if self.intact(param_groups, state):
            return False
        layout = Layout(param_groups)
        check_joined(layout, self.trained)
        self.build(layout, state, *buffers)
        group, nodes = topology.process_group, topology.node_groups()
        self.fit_exchange(layout, overlap, group, nodes, device_verdict(layout.device))
        self.layout, self.trained = layout, frozenset(layout.key)
        self.check_masks(param_groups)
        return True

    def build(
        self,
        layout: Layout,
        state: dict[Any, dict[str, Any]],
        flat_states: tuple[str, ...],
        scalar_states: dict[str, float],
        work_buffers: tuple[str, ...],
    ) -> None:
        """Make the buffers of ``layout`` and point each parameter's ``state[p][name]`` at its
        view, adopting the values found there (``load_state_dict``, the last layout). The
        layout itself is set by the caller once the exchange fits it too."""
        n, kw = layout.numel, {"device": layout.device}
        flat = {name: torch.zeros(n, dtype=torch.float32, **kw) for name in flat_states}
        scalars = {
            name: torch.full((len(layout.params),), init, dtype=torch.float32, **kw)
            for name, init in scalar_states.items()
        }
        views: dict[str, list[torch.Tensor]] = {}
        for name, buf in flat.items():
            views[name] = layout.views(buf)
        for name, buf in scalars.items():
            views[name] = list(buf.unbind())
        for j, p in enumerate(layout.params):
            pstate = state[p]
            for name in (*flat, *scalars):
                old = pstate.get(name)
                if old is not None:  # adopt what load_state_dict (or the last layout) left
                    views[name][j].copy_(old.detach().reshape(views[name][j].shape))
                pstate[name] = views[name][j]
        self.states, self.scalars = flat, scalars
        self._scratch, self._scratch_layout = {}, layout
        self._scratch_names = ("grad", "param", *work_buffers)
        self.work = _Work(self, work_buffers)
        self.views = _Views(self, views)

    def add_states(self, names: tuple[str, ...], state: dict[Any, dict[str, Any]]) -> None:
        """Make the flat states ``names`` not made yet (zeros), each parameter's
        ``state[p][name]`` its view, as ``build`` makes them."""
        layout = self.layout
        for name in names:
            if name in self.states:
                continue
            buf = torch.zeros(layout.numel, dtype=torch.float32, device=layout.device)
            views = layout.views(buf)
            for p, view in zip(layout.params, views, strict=True):
                state[p][name] = view
            self.states[name] = buf
            dict.__setitem__(self.views, name, views)

    @property
    def grad(self) -> torch.Tensor:
        """The gradients' fp32 flat buffer (``gather_grads``)."""
        return self.scratch("grad")

    @property
    def param(self) -> torch.Tensor:
        """The parameters' fp32 flat buffer (``gather_params``)."""
        return self.scratch("param")

    def scratch(self, name: str) -> torch.Tensor:
        """The scratch buffer ``name`` (a work buffer, ``"grad"`` or ``"param"``), made (zeros,
        with its views) at its first use since the last ``build`` or
        ``release_scratch``: a phase holds only the buffers it uses."""
        buf = self._scratch.get(name)
        if buf is not None:
            return buf
        if name not in self._scratch_names:
            raise KeyError(name)
        with self._scratch_lock:
            buf = self._scratch.get(name)
            if buf is None:
                layout = self._scratch_layout
                buf = torch.zeros(layout.numel, dtype=torch.float32, device=layout.device)
                dict.__setitem__(self.views, name, layout.views(buf))
                self._scratch[name] = buf
        return buf

    def release_scratch(self) -> None:
        """Let go of the scratch buffers (at the switch: the compression phase makes again only
        those it uses). Their contents never carry over from one step to the next."""
        with self._scratch_lock:
            for name in self._scratch:
                dict.pop(self.views, name, None)
            self._scratch = {}
            self.gathered.clear()  # gathered into the buffer let go

    def intact(self, param_groups: list[Group], state: dict[Any, dict[str, Any]]) -> bool:
        """Whether the built layout still holds: the same trainable parameters on its device,
        each state tensor still its view (a tool may have replaced or moved it)."""
        layout = self.layout
        if layout is None:
            return False
        params = [p for g in param_groups for p in g["params"] if p.requires_grad]
        if tuple(id(p) for p in params) != layout.key:
            return False
        if any(p.device != layout.device for p in params):
            return False
        for j, p in enumerate(params):
            pstate = state.get(p)
            if pstate is None:
                return False
            for name in (*self.states, *self.scalars):
                if pstate.get(name) is not self.views[name][j]:
                    return False
        return True

    def check_masks(self, param_groups: list[Group]) -> None:
        """Raise ``ValueError`` where a group's ``exp_avg_mask`` does not broadcast to one of
        its parameters."""
        for gi, group in enumerate(param_groups):
            mask = group.get("exp_avg_mask")
            if mask is None:
                continue
            for j in self.layout.group_params(gi):
                shape = self.layout.params[j].shape
                if torch.broadcast_shapes(mask.shape, shape) != shape:
                    raise ValueError(
                        f"exp_avg_mask of shape {tuple(mask.shape)} in param group {gi} does not "
                        f"broadcast to its parameter of shape {tuple(shape)}; the mask multiplies "
                        "every parameter of its group: put the masked parameter in its own group"
                    )

    # ------------------------------------------------------------------ the exchange

    def fit_exchange(
        self,
        layout: Layout,
        overlap: BackwardOverlap | None,
        group: Any,
        nodes: NodeGroups | None,
        device_verdict: bool,
    ) -> None:
        """Keep the exchange if it fits ``layout`` (and its buckets), else build one over
        ``group`` (and ``nodes``), carrying the error buffers over where only the device changed
        (a warning where they restart); then apply a loaded state (``load_exchange_state``)
        and install the ``overlap``'s gradient hooks.

        Each param group is exchanged on its own (its own scale and error buffers, as DeepSpeed
        does): biases and norms in a group of their own are not quantised with the weights'
        scale. The ``overlap``'s buckets (``BackwardOverlap.plan``) never span two groups.
        """
        bounds = overlap.plan(layout) if overlap is not None else None
        if bounds is None and len(layout.group_bounds()) > 1:
            bounds = layout.group_bounds()
        ex, n = self.exchange, layout.numel
        same_buckets = ex is not None and ex.bounds == bounds
        if ex is not None and (ex.numel != n or ex.device != layout.device or not same_buckets):
            if ex.numel == n and same_buckets:  # only the device changed: carry the errors over
                if self.pending_exchange is None:
                    self.pending_exchange = ex.state_dict()
            elif ex.calls > 0:
                warnings.warn(
                    "the set of trainable parameters or the exchange's buckets changed: the "
                    "1-bit error buffers restart from zero",
                    RuntimeWarning,
                    stacklevel=4,
                )
            ex = None
        if ex is None and bounds is not None:
            ex = BucketedAllreduce(
                bounds, device=layout.device,
                group=overlap.group() if overlap is not None else group,
                nodes=overlap.nodes() if overlap is not None else nodes,
                device_verdict=device_verdict, recompute_error=not device_verdict,
            )  # fmt: skip
        elif ex is None:  # one set of error buffers, updated once the call goes ahead (the
            # input recomputed as read, see comm.flat); the device verdict keeps two instead
            ex = make_exchange(
                n,
                layout.device,
                group,
                nodes,
                double_buffered=device_verdict,
                device_verdict=device_verdict,
            )
        if overlap is not None:
            overlap.install(layout)
        pending, self.pending_exchange = self.pending_exchange, None
        if pending == "reset":  # loaded a checkpoint taken before the first exchange
            ex.reset_error()
        elif pending is not None:
            try:
                ex.load_state_dict(pending)
            except ValueError as err:  # another world size: the per-rank errors do not map
                warnings.warn(
                    f"{err}; the 1-bit error buffers restart from zero",
                    RuntimeWarning,
                    stacklevel=4,
                )
                ex.reset_error()
        self.exchange = ex

    def release_exchange(self) -> None:
        """Let go of the exchange (the process groups it runs on are being destroyed: a group
        an object still references keeps its threads and sockets until that object is
        collected, at the latest in the interpreter's exit, where it can abort the process).
        Its error buffers wait for the next ``fit_exchange``; the layout is rebuilt."""
        ex, self.exchange = self.exchange, None
        if ex is not None and ex.calls > 0 and self.pending_exchange is None:
            self.pending_exchange = ex.state_dict()
        self.layout = None

    def exchange_state(self) -> dict[str, Any] | None:
        """This rank's error buffers as a checkpoint keeps them (``None``: none yet)."""
        pending = self.pending_exchange  # loaded but not yet applied
        if isinstance(pending, dict):
            return pending
        if pending == "reset" or self.exchange is None:
            return None
        return self.exchange.state_dict()

    def load_exchange_state(self, state: dict[str, Any] | None) -> None:
        """Apply an ``exchange_state`` at the next ``fit_exchange`` (``None``: start
        from zeros)."""
        self.pending_exchange = state or "reset"

    # ------------------------------------------------------------------ the algorithms' helpers

    def segments(self, param_groups: list[Group]) -> Iterator[tuple[int, Group, slice]]:
        """(group index, group, slice of the flat buffers) for every non-empty group."""
        for gi, (group, seg) in enumerate(zip(param_groups, self.layout.segments, strict=True)):
            if seg.stop > seg.start:
                yield gi, group, seg

    def segments_in(
        self, param_groups: list[Group], s: slice
    ) -> Iterator[tuple[int, Group, slice]]:
        """(group index, group, sub-slice) for every group that intersects the flat slice ``s``."""
        for gi, group, seg in self.segments(param_groups):
            lo, hi = max(seg.start, s.start), min(seg.stop, s.stop)
            if lo < hi:
                yield gi, group, slice(lo, hi)

    def params_in(self, s: slice) -> list[int]:
        """The parameters (layout indices) that start in the flat slice ``s`` (an exchange's
        bucket, or the whole buffer: whole parameters)."""
        return [j for j, o in enumerate(self.layout.offsets) if s.start <= o < s.stop]

    def gather_grads(
        self,
        param_groups: list[Group],
        only: list[int] | None = None,
        into: list[torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """Copy the gradients into ``grad`` (zeros where ``.grad`` is None) and return it: those
        of the parameters ``only`` (layout indices; default all) not copied yet this step
        (``gathered``, to which they are added). One multi-tensor copy (a launch per parameter
        would cost more than the copy on a GPU), then each group's ``maximize`` and torch Adam's
        L2 term where set (``decoupled_weight_decay=False``). ``into``: tensors shaped like the
        parameters to copy all into instead (``grad`` not made; returns ``None``). Raises
        ``RuntimeError`` on a sparse gradient."""
        params, views = self.layout.params, self.views["grad"] if into is None else into
        of = self.layout.group_of
        dst, src, zero, adjust = [], [], [], []
        for j in range(len(params)) if only is None else only:
            if into is None and j in self.gathered:
                continue
            g = params[j].grad
            if g is None:
                zero.append(views[j])
                continue
            if g.is_sparse:
                raise RuntimeError(
                    f"{self.owner} does not support sparse gradients "
                    "(use a dense embedding: nn.Embedding(..., sparse=False))"
                )
            dst.append(views[j])
            src.append(g)
            group = param_groups[of[j]]
            if group.get("maximize", False) or not group.get("decoupled_weight_decay", True):
                adjust.append(j)
        if zero:
            torch._foreach_zero_(zero)
        if dst:
            torch._foreach_copy_(dst, src)
        for j in adjust:
            group, view = param_groups[of[j]], views[j]
            if group.get("maximize", False):  # as torch's Adam: before the L2 term
                view.neg_()
            if not group.get("decoupled_weight_decay", True) and group["weight_decay"] > 0:
                view.add_(params[j], alpha=group["weight_decay"])  # torch Adam's L2 term
        if into is None:
            self.gathered.update(range(len(params)) if only is None else only)
        return self.grad if into is None else None

    def grads(
        self, param_groups: list[Group], only: list[int], on_gpu: bool = False
    ) -> list[torch.Tensor | None]:
        """The gradients of the parameters ``only`` (layout indices), one per parameter, for
        the kernels that read each where it lies (
        [`momentum_source`][lightning_onebit.kernels.sources.momentum_source],
        [`adam_update`][lightning_onebit.kernels.updates.adam_update]): on the CPU the
        parameter's ``.grad`` itself (``None``, zeros, where it has none), so that no copy of the
        gradients into ``grad`` is made; its view of ``grad``, gathered there (``gather_grads``)
        unless it is already, where the values must be copied or changed (another dtype or device, a
        gradient that is not contiguous, a sparse one, which raises there; the group's ``maximize``
        or L2 term) and on a GPU unless ``on_gpu``: there the copy costs little and torch's
        ``_foreach_norm`` sums a tensor in an order that depends on its address
        (``rescale_variance``'s norms of the parameters' own gradients could differ in the last
        bit from those of the flat buffer's views). ``on_gpu``: the caller reads each value on
        its own (elementwise kernels, finiteness), where the address changes nothing: read in
        place on a GPU too."""
        params, of = self.layout.params, self.layout.group_of
        out: list[torch.Tensor | None] = []
        copy = []
        for k, j in enumerate(only):
            g = params[j].grad
            group = param_groups[of[j]]
            if j in self.gathered or not self._read_in_place(group, g, on_gpu):
                copy.append(k)
            out.append(g)
        if copy:  # only then is the flat buffer made: see scratch
            views = self.views["grad"]
            for k in copy:
                out[k] = views[only[k]]
            self.gather_grads(param_groups, [only[k] for k in copy])
        return out

    def _read_in_place(self, group: Group, g: torch.Tensor | None, on_gpu: bool) -> bool:
        """Whether ``grads`` passes ``g`` (a gradient of ``group``, or ``None``) as it is:
        the values ``gather_grads`` would copy, readable where they lie."""
        if self.layout.device.type != "cpu" and not on_gpu:
            return False
        if g is None:  # zeros: gather_grads neither negates nor decays a missing gradient
            return True
        l2 = not group.get("decoupled_weight_decay", True) and group["weight_decay"] > 0
        return (
            g.layout == torch.strided
            and g.device == self.layout.device
            and g.dtype == torch.float32
            and g.is_contiguous()
            and not g.is_neg()
            and not group.get("maximize", False)
            and not l2
        )

    def params(self, only: list[int]) -> list[torch.Tensor]:
        """The parameters ``only`` (layout indices), one per parameter, for the kernels that
        read each where it lies (the decay terms of
        [`lamb_frozen_update`][lightning_onebit.kernels.updates.lamb_frozen_update] and
        [`local_source`][lightning_onebit.kernels.sources.local_source]): the parameter itself where
        it is an fp32 contiguous tensor, so that no copy into ``param`` is made; its view of
        ``param``, copied there, otherwise (another dtype, a non-contiguous parameter)."""
        params, views = self.layout.params, self.views["param"]
        out = []
        for j in only:
            p = params[j]
            if p.dtype == torch.float32 and p.is_contiguous():
                out.append(p.detach())
            else:
                out.append(views[j].copy_(p))
        return out

    def gather_params(self, s: slice | None = None) -> torch.Tensor:
        """Copy the parameters (those starting in the flat slice ``s``, default all) into
        ``param`` (for weight decay and norms); return it."""
        views, offsets = self.views["param"], self.layout.offsets
        for j, p in enumerate(self.layout.params):
            if s is None or s.start <= offsets[j] < s.stop:
                views[j].copy_(p)
        return self.param

    def views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of a flat buffer (the cached ones for a state or work buffer)."""
        for name, buf in (*self.states.items(), *self._scratch.items()):
            if buf is flat:
                return self.views[name]
        return self.layout.views(flat)

    def add_to_params_(
        self, param_groups: list[Group], flat: torch.Tensor, alpha: float | list[float]
    ) -> None:
        """``p += alpha * flat`` for every parameter; ``alpha`` may be one value per group."""
        views = self.views_of(flat)
        for gi, _, _ in self.segments(param_groups):
            a = alpha[gi] if isinstance(alpha, list) else alpha
            idx = self.layout.group_params(gi)
            torch._foreach_add_(
                [self.layout.params[j] for j in idx], [views[j] for j in idx], alpha=a
            )

    def copy_to_params_(self, flat: torch.Tensor) -> None:
        """``p = flat`` (cast to each parameter's dtype) for every parameter."""
        torch._foreach_copy_(self.layout.params, self.views_of(flat))

    def apply_mask_(self, param_groups: list[Group], flat: torch.Tensor) -> None:
        """Multiply by each group's ``exp_avg_mask`` (1-bit signs cannot encode exact zeros)."""
        views = None
        for gi, group, _ in self.segments(param_groups):
            mask = group.get("exp_avg_mask")
            if mask is None:
                continue
            if mask.device != flat.device or mask.dtype != flat.dtype:
                mask = group["exp_avg_mask"] = mask.to(device=flat.device, dtype=flat.dtype)
            views = views if views is not None else self.layout.views(flat)
            for j in self.layout.group_params(gi):
                views[j].mul_(mask)


class _Work(Mapping[str, torch.Tensor]):
    """``FlatState.work``: the algorithm's work buffers by name, each made at its first use
    (``FlatState.scratch``)."""

    def __init__(self, flat: FlatState, names: tuple[str, ...]) -> None:
        self._flat, self._names = flat, names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._flat.scratch(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class _Views(dict):
    """``FlatState.views``: the per-parameter views by buffer name; a scratch buffer's are
    made with it, at its first use."""

    def __init__(self, flat: FlatState, views: dict[str, list[torch.Tensor]] | None = None) -> None:
        super().__init__(views or {})
        self._flat = flat

    def __missing__(self, name: str) -> list[torch.Tensor]:
        self._flat.scratch(name)
        return dict.__getitem__(self, name)
