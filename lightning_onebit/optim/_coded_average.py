"""The gradient average in integer codes (``average_dtype=torch.int4``/``torch.int8``): a
[`QuantizedAllreduce`][lightning_onebit.comm.quantized.QuantizedAllreduce] over the optimizer's
gradients, gathered straight into its own layout (each parameter starting a block of its own),
whose error buffers carry each step's rounding into the next (error feedback) and go into the
checkpoint, so a resumed run continues exactly.

At 4 bits the rounding noise of the small values of a block (small against its largest) adds
to their squares, and the variance the switch freezes would remember it: the warmup's last
``variance_window`` steps (by default the ``1 / (1 - beta2)`` steps that variance remembers)
average in int8 instead, and their squares alone estimate the
variance that is frozen (``WindowVariance``), while the warmup's own Adam steps go on with the
variance fed from every step."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from lightning_onebit.comm import CODED_BITS, NonFiniteError, QuantizedAllreduce

if TYPE_CHECKING:
    from lightning_onebit.optim._flat import FlatState, Layout
    from lightning_onebit.optim._variance import BiasCorrection

__all__ = ["CodedAverage", "WindowVariance", "check_coded", "window_steps"]


def check_variance_window(window: float | int | None, dtype: torch.dtype | None) -> None:
    """Raise ``ValueError`` unless ``window`` is ``None``, a fraction in ``[0, 1)`` or a whole
    number of steps ``>= 0``, and ``None`` or 0 unless ``dtype`` is ``torch.int4`` (``None``:
    not known yet)."""
    ok_type = isinstance(window, (int, float)) and not isinstance(window, bool)
    if window is not None and not (
        ok_type and (0 <= window < 1 if isinstance(window, float) else window >= 0)
    ):
        raise ValueError(
            "variance_window must be a fraction of the warmup in [0, 1) (a float), a number of "
            f"steps >= 0 (an int) or None (the variance's memory, 1 / (1 - beta2) steps), got "
            f"{window!r}"
        )
    if window and dtype is not None and dtype != torch.int4:
        raise ValueError(
            f"variance_window={window!r} applies to average_dtype='int4' (its last steps "
            f"average in int8), not to average_dtype={dtype}; leave it None"
        )


def window_steps(window: float | int | None, switch_step: int, beta2: float) -> int:
    """The ``variance_window`` in steps, for a switch after step ``switch_step``: a fraction of
    it rounded, a number of steps as it is, ``None`` the steps Adam's variance remembers,
    ``1 / (1 - beta2)`` (a shorter window would estimate the frozen variance from fewer
    squares than Adam's own, a noisier estimate); at most ``switch_step``."""
    if window is None:
        steps = switch_step if beta2 >= 1 else round(1 / (1 - beta2))
    else:
        steps = round(window * switch_step) if isinstance(window, float) else int(window)
    return min(steps, switch_step)


def check_coded(
    dtype: torch.dtype,
    average_warmup_grads: bool,
    two_levels: bool,
    variance_window: float | int | None = None,
) -> None:
    """Raise ``ValueError`` where an integer-coded ``dtype`` cannot be averaged: by a caller
    (``average_warmup_grads=False``: DDP's hooks keep no error buffers) or in two levels; or
    where ``variance_window`` is not one (``check_variance_window``)."""
    check_variance_window(variance_window, dtype)
    if dtype in CODED_BITS and (two_levels or not average_warmup_grads):
        raise ValueError(
            f"average_dtype={dtype} is averaged by the optimizer itself, over one level: it "
            "needs average_warmup_grads=True and no two-level exchange (hierarchical=False); "
            "use average_dtype='bf16' otherwise"
        )


class CodedAverage:
    """The integer-coded average of one optimizer (``OneBitOptimizer.coded_average``): one
    exchange per bucket of the overlap with backward (one for the whole layout without it),
    made at the first average and remade when the layout, the buckets or the codec change, and
    the error buffers a checkpoint loaded until then.

    The buckets of one step's average start one by one (``start``: during backward, as their
    gradients are ready) and go through together or, when any rank's values in any bucket are
    not finite, not at all (``average_``). Each parameter starts a block of its own, and a
    block's arithmetic does not depend on its bucket, so the buckets average to the same bits
    as one exchange of the whole layout."""

    def __init__(self) -> None:
        self.exchanges: list[QuantizedAllreduce] = []
        #: each exchange's parameters (layout indices, in layout order)
        self.members: list[list[int]] = []
        #: a loaded state the next exchange takes (``"reset"``: zeros)
        self.pending: dict[str, Any] | str | None = None
        self._views: list[torch.Tensor] = []  # per parameter of the layout
        self._failures: list[NonFiniteError | bool | None] = []  # per exchange; False: not started

    def inputs(
        self, layout: Layout, group: Any, bits: int, buckets: list[list[int]] | None = None
    ) -> list[torch.Tensor]:
        """Where the next average reads each parameter's gradient (shaped like it) and leaves
        its average: the exchanges' own layouts
        ([`segment_views`][lightning_onebit.comm.quantized.QuantizedAllreduce.segment_views]), so
        no flat copy of the gradients is made. The exchanges are (re)made here for ``layout``,
        over ``group``, in ``bits``-bit codes, one per bucket of ``buckets`` (layout indices;
        ``None``: one for the whole layout), a loaded state applied; as they are, if they are
        these already."""
        members = [sorted(m) for m in buckets] if buckets else [list(range(len(layout.params)))]
        sizes = [[layout.params[j].numel() for j in m] for m in members]
        old = self.exchanges
        if [ex.sizes for ex in old] != sizes or any(
            ex.bits != bits or ex.device != layout.device or ex.group is not group for ex in old
        ):
            new = [
                QuantizedAllreduce(sum(k), layout.device, group, bits=bits, segments=k)
                for k in sizes
            ]
            same_blocks = [ex.sizes for ex in old] == sizes and all(
                a.block == b.block and a.world_size == b.world_size
                for a, b in zip(old, new, strict=True)
            )
            if same_blocks and old[0].device == layout.device:
                # another codec (int4 -> int8 in the variance window) or group over the same
                # blocks: each value's error is where it was, so the rounding carried is not lost
                for a, b in zip(old, new, strict=True):
                    b.worker_error.copy_(a.worker_error)
                    b.server_error.copy_(a.server_error)
            elif any(ex.calls > 0 for ex in old) and self.pending is None:
                warnings.warn(
                    "the trainable parameters, the overlap's buckets or the average's codec "
                    "changed: the coded average's error buffers restart from zero",
                    RuntimeWarning,
                    stacklevel=5,
                )
            self.exchanges, self.members = new, members
            self._failures = [False] * len(new)
            self._views = [torch.empty(0)] * len(layout.params)
            for ex, m in zip(new, members, strict=True):
                for j, v in zip(m, ex.segment_views(), strict=True):
                    self._views[j] = v.view_as(layout.params[j])
        self._apply_pending()
        return list(self._views)

    def _apply_pending(self) -> None:
        pending, self.pending = self.pending, None
        if isinstance(pending, dict):
            states = pending.get("buckets", [pending])
            try:
                if len(states) != len(self.exchanges):
                    raise ValueError(
                        f"error buffers saved for {len(states)} buckets cannot be loaded into "
                        f"{len(self.exchanges)}"
                    )
                for ex, state in zip(self.exchanges, states, strict=True):
                    ex.load_state_dict(state)
            except ValueError as err:  # another world size, layout or overlap: they do not map
                warnings.warn(f"{err}; they restart from zero", RuntimeWarning, stacklevel=6)
                for ex in self.exchanges:
                    ex.reset_error()
        elif pending == "reset":
            for ex in self.exchanges:
                ex.reset_error()

    def start(self, k: int) -> None:
        """Start exchange ``k``'s average (its gradients are in its ``inputs`` by now): its
        collectives, nothing written yet (every rank starts the same exchanges in order)."""
        self._failures[k] = self.exchanges[k].start_in_place()

    @property
    def unstarted(self) -> list[int]:
        """The layout indices of the parameters whose exchange this step has not started."""
        return [j for k, m in enumerate(self.members) if self._failures[k] is False for j in m]

    def average_(self) -> int:
        """Replace the values at ``inputs`` by their average over the group's ranks (the
        exchanges not started yet start here); return the bytes this rank sent.

        Raises:
            NonFiniteError: on every rank, when any rank's gradients have a NaN/Inf; the error
                buffers are as they were.
        """
        assert self.exchanges, "inputs() first"
        for k, failure in enumerate(self._failures):
            if failure is False:
                self.start(k)
        failures, self._failures = self._failures, [False] * len(self.exchanges)
        first = next((f for f in failures if isinstance(f, NonFiniteError)), None)
        for ex in self.exchanges:
            if first is None:
                ex.commit()
            else:
                ex.discard()
        if first is not None:
            raise first
        return sum(ex.bytes_sent for ex in self.exchanges)

    def discard(self) -> None:
        """Forget the averages started for a step that will not come (a dropped backward)."""
        for ex in self.exchanges:
            ex.discard()
        self._failures = [False] * len(self.exchanges)

    def inter_node_bytes(self, node_size: int) -> int:
        """Of the last average's bytes, those that left the node (``node_size`` ranks per node):
        the records to the ranks of other nodes."""
        out = 0
        for ex in self.exchanges:
            w = ex.world_size
            if w > node_size:
                out += ex.bytes_sent * (w - node_size) // (w - 1)
        return out

    def release(self) -> None:
        """Let go of the exchanges and their buffers (at the switch: the compression phase
        averages no gradients, or averages them rarely enough to start its errors afresh)."""
        self.exchanges, self.members, self._views, self._failures = [], [], [], []
        self.pending = None

    def state(self) -> dict[str, Any] | None:
        """This rank's error buffers as a checkpoint keeps them (``None``: none): one
        exchange's state, or ``{"buckets": [...]}``."""
        if isinstance(self.pending, dict):
            return self.pending
        if self.pending == "reset" or all(ex.calls == 0 for ex in self.exchanges):
            return None
        states = [ex.state_dict() for ex in self.exchanges]
        return states[0] if len(states) == 1 else {"buckets": states}

    def load(self, state: dict[str, Any] | None) -> None:
        """Apply a ``state`` at the next average (``None``: start from zeros)."""
        self.pending = state or "reset"


class WindowVariance:
    """The variance the switch freezes, estimated from the warmup's last ``variance_window``
    steps alone (``OneBitOptimizer.window_variance``): per parameter Adam's moving average of
    the squared averaged gradients, ``w = beta2 * w + (1 - beta2) * g**2``, from zero at the
    window's first step, with its own weight ``c = beta2 * c + (1 - beta2)`` (``1 - beta2**k``
    after k steps) so that ``w / c`` is the steps' bias-corrected mean square; a parameter
    without a gradient, or a step dropped for NaN/Inf, leaves both as they were. Made at the
    window's first step, used and let go at the switch."""

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None  # flat, the layout's
        self.weights: torch.Tensor | None = None  # one per parameter
        self.key: tuple[int, ...] | None = None  # the layout it belongs to
        #: a loaded state the next ``feed_`` takes
        self.pending: dict[str, Any] | None = None

    def feed_(
        self,
        layout: Layout,
        betas2: list[float],
        grads: list[torch.Tensor | None],
        ok: torch.Tensor | None,
    ) -> None:
        """Add one step's averaged ``grads`` (one per parameter of ``layout``, ``None``: none)
        with each parameter's ``betas2``; ``ok``: the step's device verdict (``None``: it goes
        ahead)."""
        if self.pending is not None:
            self._adopt(layout)
        if self.sums is None or self.key != layout.key:
            if self.sums is not None:
                warnings.warn(
                    "the trainable parameters changed inside the variance window: its estimate "
                    "restarts from this step",
                    RuntimeWarning,
                    stacklevel=4,
                )
            self.sums = torch.zeros(layout.numel, device=layout.device)
            self.weights = torch.zeros(len(layout.params), device=layout.device)
            self.key = layout.key
        assert self.weights is not None
        for j, (w, g) in enumerate(zip(layout.views(self.sums), grads, strict=True)):
            if g is None:
                continue
            b2 = betas2[j]
            new_w = w * b2 + g * g * (1.0 - b2)
            new_c = self.weights[j] * b2 + (1.0 - b2)
            if ok is None:
                w.copy_(new_w)
                self.weights[j] = new_c
            else:
                w.copy_(torch.where(ok, new_w, w))
                self.weights[j] = torch.where(ok, new_c, self.weights[j])

    def freeze_into_(self, flat: FlatState, bias: BiasCorrection) -> None:
        """At the switch: each parameter's flat variance becomes its window mean square (where
        the window saw a gradient of it) times ``1 - beta2**k`` from ``bias``, the scale of
        Adam's uncorrected variance, which the switch then corrects as it would have; the
        estimate is let go."""
        layout = flat.layout
        if self.pending is not None:
            self._adopt(layout)
        if self.sums is not None and self.weights is not None and self.key == layout.key:
            variance = flat.states["exp_avg_sq"]
            pairs = zip(layout.views(variance), layout.views(self.sums), strict=True)
            for j, (v, w) in enumerate(pairs):
                c, bc2 = self.weights[j], bias.of(layout.group_of[j], j)[1]
                v.copy_(torch.where(c > 0, w * (bc2 / c.clamp_min(1e-30)), v))
        self.release()

    def release(self) -> None:
        """Let go of the estimate (at the switch)."""
        self.sums = self.weights = self.key = self.pending = None

    def state(self) -> dict[str, Any] | None:
        """The estimate as a checkpoint keeps it (``None``: none): the same on every rank."""
        if self.pending is not None:
            return self.pending
        if self.sums is None or self.weights is None:
            return None
        return {"sums": self.sums.detach().cpu().clone(), "weights": self.weights.cpu().clone()}

    def load(self, state: dict[str, Any] | None) -> None:
        """Take a ``state`` at the next ``feed_`` or ``freeze_into_`` (``None``: none)."""
        self.release()
        self.pending = state

    def _adopt(self, layout: Layout) -> None:
        pending, self.pending = self.pending, None
        assert pending is not None
        sums, weights = pending["sums"], pending["weights"]
        if sums.numel() != layout.numel or weights.numel() != len(layout.params):
            warnings.warn(
                "the checkpoint's variance window was saved for other parameters: its estimate "
                "restarts from the next step",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        self.sums = sums.to(layout.device, torch.float32).clone()
        self.weights = weights.to(layout.device, torch.float32).clone()
        self.key = layout.key
