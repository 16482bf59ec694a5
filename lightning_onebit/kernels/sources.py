"""The exchange's sources: the values 1-bit Adam, 1-bit LAMB and 0/1 Adam send, computed by one
sweep over flat buffers ([`momentum_source`][lightning_onebit.kernels.sources.momentum_source],
[`local_source`][lightning_onebit.kernels.sources.local_source]), or described without being
computed ([`ExchangeSource`][lightning_onebit.kernels.sources.ExchangeSource]) so that the
compression computes each value as it reads it; and values already computed, as a source
([`TensorSource`][lightning_onebit.kernels.sources.TensorSource]), so that an exchange takes one
type of input."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch

from lightning_onebit.kernels import native, native_sources
from lightning_onebit.kernels.checks import check_per_segment, check_segments
from lightning_onebit.kernels.denominator import Denominator, denominator_checks
from lightning_onebit.kernels.reference import reference_local_source, reference_momentum_source

__all__ = [
    "ExchangeSource",
    "LocalSource",
    "MomentumSource",
    "TensorSource",
    "local_source",
    "momentum_source",
]


def momentum_source(
    exp_avg: torch.Tensor,
    grad: torch.Tensor | Sequence[torch.Tensor | None],
    denom: Denominator | None,
    out: torch.Tensor,
    starts: list[int],
    sizes: list[int],
    beta: list[float],
    alpha: list[float],
) -> None:
    """The momentum a compressed exchange sends, one sweep over flat buffers (``exp_avg``
    itself unchanged). Segment ``k`` holds the values ``starts[k]:starts[k] + sizes[k]``; per
    value, with its coefficients::

        out = beta * exp_avg + alpha * grad         (as torch.mul(m, beta).add_(g, alpha=alpha))
        out = out / d                               (only where denom is given)

    where ``d = sqrt(v) + eps`` (times a per-segment scale where given) is computed from the
    variance as the kernel reads it ([Denominator][lightning_onebit.kernels.Denominator]: no
    buffer of ``d``), with the floats of torch's ``sqrt``, ``mul_`` and ``add_``.

    The gradient is a flat buffer indexed like the others, or one tensor per segment: each
    parameter's ``.grad`` where autograd left it, so that nothing copies the gradients into a
    flat buffer first (the kernel reads each segment's from its own pointer; both forms are the
    same call). A segment given ``None`` reads zeros, with the floats a buffer of zeros gives.

    One sweep (reads 2-3 buffers, writes one) where the torch ops make three, writing torch's
    floats for that sequence bit for bit on the same device: on the CPU the C++ kernel (torch's
    CPU ``add`` with ``alpha`` is a fused multiply-add on x86, which the kernel does too), on
    CUDA the CUDA kernel on the current stream (no host synchronisation), with the roundings of
    torch's CUDA kernels. Without a compiled kernel for the device (no compiled module, a build
    without CUDA kernels, another device type) the torch ops themselves run
    ([`reference_momentum_source`][lightning_onebit.kernels.reference.reference_momentum_source]).

    Args:
        exp_avg, out: float32, contiguous, one device, covering every segment.
        grad: like them (a flat buffer), or a sequence with one entry per segment: ``None``
            (zeros) or a float32 contiguous tensor of ``sizes[k]`` values (any shape) on their
            device.
        denom: a [Denominator][lightning_onebit.kernels.Denominator] of the call's segments
            (its ``exp_avg_sq`` like ``exp_avg``, one ``eps`` per segment), or ``None`` (no
            division).
        starts, sizes: each segment's first flat index and number of values.
        beta, alpha: one value per segment (rounded to float32).

    Raises:
        TypeError, ValueError: a tensor of another dtype, not contiguous, on another device,
            a segment that does not fit or a per-segment gradient of another size; lists of
            other lengths.
    """
    grads = _check_momentum_source(exp_avg, grad, denom, out, starts, sizes, beta, alpha)
    _run_momentum_source(exp_avg, grads, denom, out, starts, sizes, beta, alpha)


def _run_momentum_source(
    exp_avg: torch.Tensor,
    grads: list[torch.Tensor | None],
    denom: Denominator | None,
    out: torch.Tensor,
    starts: list[int],
    sizes: list[int],
    beta: list[float],
    alpha: list[float],
) -> None:
    """[`momentum_source`][lightning_onebit.kernels.sources.momentum_source] on checked arguments,
    the gradient ``grads`` one entry per segment: the compiled kernel of the device, or the torch
    ops."""
    if not native.has_kernel(exp_avg.device) or not native.use_native():
        reference_momentum_source(exp_avg, grads, denom, out, starts, sizes, beta, alpha)
        return
    native_sources.momentum_kernels(exp_avg=exp_avg, grads=grads, denom=denom, starts=starts,
                                    sizes=sizes, beta=beta, alpha=alpha).source(out)  # fmt: skip


def _check_momentum_source(
    exp_avg: torch.Tensor,
    grad: torch.Tensor | Sequence[torch.Tensor | None],
    denom: Denominator | None,
    out: torch.Tensor | None,
    starts: list[int],
    sizes: list[int],
    beta: list[float],
    alpha: list[float],
) -> list[torch.Tensor | None]:
    """[`momentum_source`][lightning_onebit.kernels.sources.momentum_source]'s checks of its
    arguments; returns the gradient as one entry per segment."""
    variance, per_segment = denominator_checks(denom, required=False)
    device, named = native.check("momentum_source", exp_avg=exp_avg, out=out, grad=grad,
                                 exp_avg_sq=variance)  # fmt: skip
    check_segments(named, starts, {"sizes": sizes, "beta": beta, "alpha": alpha, **per_segment})
    return check_per_segment("grad", grad, starts, sizes, device, missing=True)


class ExchangeSource:
    """Values of the flat range ``[lo, hi)`` that a source kernel would write to ``out``, not
    computed yet: the input of an exchange call
    ([`worker_compress`][lightning_onebit.kernels.compression.worker_compress]), for segments that
    tile the range in order (an exchange's bucket: whole parameters). Subclasses:
    [`MomentumSource`][lightning_onebit.kernels.sources.MomentumSource],
    [`LocalSource`][lightning_onebit.kernels.sources.LocalSource], and
    [`TensorSource`][lightning_onebit.kernels.sources.TensorSource] for values already computed.

    Where a compiled kernel applies
    ([`computed_as_read`][lightning_onebit.kernels.sources.ExchangeSource.computed_as_read]),
    [`worker_compress`][lightning_onebit.kernels.compression.worker_compress] computes each value as
    it compresses it: the same floats, bits and scale, without writing ``out`` and reading it back
    (two of the four fp32 sweeps of source and compression). Elsewhere
    [`materialize`][lightning_onebit.kernels.sources.ExchangeSource.materialize] runs the source
    kernel into ``out`` first. The inputs are read when the values are computed. ``out`` may be a
    function that makes that buffer at its first need: a compression that computes the values as
    it reads them never needs it, so its caller need not hold it.
    """

    out: torch.Tensor | Callable[[], torch.Tensor]
    starts: list[int]
    sizes: list[int]
    lo: int
    hi: int

    def _tile(self) -> None:
        """Set ``lo`` and ``hi``; raise ``ValueError`` unless the segments tile a
        non-empty range in order."""
        ends = list(itertools.accumulate(self.sizes, initial=self.starts[0] if self.starts else 0))
        if not self.starts or list(self.starts) != ends[:-1] or ends[-1] == ends[0]:
            raise ValueError(
                f"a {type(self).__name__}'s segments must tile a non-empty flat range in order, "
                f"got starts {self.starts} and sizes {self.sizes}"
            )
        self.lo, self.hi = ends[0], ends[-1]

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    def like(self) -> torch.Tensor:
        """A tensor of the values' dtype, device and size, not read: what checks of the
        values' geometry take where the values are not computed yet."""
        raise NotImplementedError

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self.hi - self.lo])

    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def computed_as_read(self) -> bool:
        """Whether [`worker_compress`][lightning_onebit.kernels.compression.worker_compress]
        (``deferred=True``) computes the values as it reads them: the compiled module's kernels, on
        the CPU and (in a build with CUDA kernels) on CUDA; the pure-torch path materializes."""
        return native.has_kernel(self.device) and native.use_native()

    @property
    def updated_as_read(self) -> bool:
        """Whether [`worker_update_error`][lightning_onebit.kernels.compression.worker_update_error]
        recomputes the values as it reads them (the compiled module's CPU kernels), so that an
        exchange with one error buffer needs no buffer of them either; elsewhere it materializes
        them."""
        return False

    def materialize(self) -> torch.Tensor:
        """Run the source kernel into ``out`` (arguments checked at construction); return
        ``out[lo:hi]``."""
        raise NotImplementedError

    def compress_as_read(
        self,
        *,
        error: torch.Tensor,
        bits: torch.Tensor,
        scale: torch.Tensor,
        error_out: torch.Tensor,
        pending: bool,
        prev_bits: torch.Tensor,
        prev_scale: torch.Tensor,
    ) -> None:
        """The compiled deferred compression of these values, its arguments checked by
        [`worker_compress`][lightning_onebit.kernels.compression.worker_compress].

        Args:
            error, bits, scale, error_out: as
                [`worker_compress`][lightning_onebit.kernels.compression.worker_compress]'s
                (``error_out`` may be ``error``: in place; ``None``: not written, the error
                updated later by ``update_error_as_read``).
            pending: whether ``error`` still awaits the previous call's deferred update.
            prev_bits, prev_scale: the previous call's bits and scale (read if ``pending``).
        """
        raise NotImplementedError

    def update_error_as_read(
        self, *, error: torch.Tensor, scale: torch.Tensor, error_out: torch.Tensor, rows: int
    ) -> float:
        """The compiled error update of a compression of these values that did not write its
        error (``error_out=None`` above; the inputs unchanged since), the values recomputed as
        read: its arguments checked by
        [`worker_update_error`][lightning_onebit.kernels.compression.worker_update_error]
        (``error_out`` its ``out``). Returns the scale of the values read."""
        raise NotImplementedError


class _KernelSource(ExchangeSource):
    """A source a kernel computes from the momentum ``exp_avg`` (and more) into ``out``."""

    exp_avg: torch.Tensor
    #: the op of ``update_error_as_read`` (`native.OPS`)
    UPDATE_OP: ClassVar[str] = ""

    @property
    def device(self) -> torch.device:
        return self.exp_avg.device

    @property
    def updated_as_read(self) -> bool:
        return native.has_kernel(self.device, self.UPDATE_OP) and native.use_native()

    def like(self) -> torch.Tensor:
        return self.exp_avg[self.lo : self.hi]

    def compress_as_read(
        self,
        *,
        error: torch.Tensor,
        bits: torch.Tensor,
        scale: torch.Tensor,
        error_out: torch.Tensor,
        pending: bool,
        prev_bits: torch.Tensor,
        prev_scale: torch.Tensor,
    ) -> None:
        self._kernels().compress(error=error, bits=bits, scale=scale, error_out=error_out,
                                 pending=pending, prev_bits=prev_bits,
                                 prev_scale=prev_scale)  # fmt: skip

    def update_error_as_read(
        self, *, error: torch.Tensor, scale: torch.Tensor, error_out: torch.Tensor, rows: int
    ) -> float:
        return self._kernels().update_error(error=error, scale=scale, error_out=error_out,
                                            rows=rows)  # fmt: skip

    def _kernels(self) -> native_sources.SourceKernels:
        """The compiled launches of this source (subclasses)."""
        raise NotImplementedError

    def _out(self, kernel: str) -> torch.Tensor:
        """``out`` as a tensor (made now where it is a function), checked against ``exp_avg`` as
        ``kernel`` checks it."""
        out = self.out() if callable(self.out) else self.out
        _, named = native.check(kernel, exp_avg=self.exp_avg, out=out)
        check_segments(named, self.starts, {"sizes": self.sizes})
        return out


@dataclasses.dataclass(eq=False)
class MomentumSource(_KernelSource):
    """[`momentum_source`][lightning_onebit.kernels.sources.momentum_source]'s values as an
    [`ExchangeSource`][lightning_onebit.kernels.sources.ExchangeSource]. The arguments are
    [`momentum_source`][lightning_onebit.kernels.sources.momentum_source]'s, checked here.

    Raises:
        TypeError, ValueError: as
            [`momentum_source`][lightning_onebit.kernels.sources.momentum_source]; segments that do
            not tile a non-empty range in order.
    """

    UPDATE_OP: ClassVar[str] = "momentum_update_error"

    exp_avg: torch.Tensor
    grad: torch.Tensor | Sequence[torch.Tensor | None]
    denom: Denominator | None
    out: torch.Tensor | Callable[[], torch.Tensor]
    starts: list[int]
    sizes: list[int]
    beta: list[float]
    alpha: list[float]

    def __post_init__(self) -> None:
        out = None if callable(self.out) else self.out
        self.grad = _check_momentum_source(self.exp_avg, self.grad, self.denom, out,
                                           self.starts, self.sizes, self.beta, self.alpha)  # fmt: skip
        self._tile()

    def materialize(self) -> torch.Tensor:
        """Run [`momentum_source`][lightning_onebit.kernels.sources.momentum_source] into ``out``
        (arguments checked at construction, ``out`` made now where it is a function); return
        ``out[lo:hi]``."""
        out = self._out("momentum_source")
        _run_momentum_source(self.exp_avg, self.grad, self.denom, out, self.starts,
                             self.sizes, self.beta, self.alpha)  # fmt: skip
        return out[self.lo : self.hi]

    def _kernels(self) -> native_sources.SourceKernels:
        return native_sources.momentum_kernels(exp_avg=self.exp_avg, grads=self.grad,
                                               denom=self.denom, starts=self.starts,
                                               sizes=self.sizes, beta=self.beta,
                                               alpha=self.alpha)  # fmt: skip


def local_source(
    *,
    exp_avg: torch.Tensor,
    grad: torch.Tensor | Sequence[torch.Tensor | None],
    denom: Denominator,
    param: torch.Tensor | Sequence[torch.Tensor] | None,
    acc: torch.Tensor | None,
    out: torch.Tensor,
    starts: list[int],
    sizes: list[int],
    beta: list[float],
    alpha: list[float],
    lr: list[float],
    weight_decay: list[float],
    preconditioned: bool,
) -> None:
    """0/1 Adam's exchange source on a sync step of its local phase, one sweep over flat
    buffers (no input changes). Segment ``k`` holds the values ``starts[k]:starts[k] +
    sizes[k]`` and has the coefficients ``beta[k]``, ``alpha[k]``, ``lr[k]`` and
    ``weight_decay[k]``. Per value, as the optimizer's torch ops::

        x = beta * exp_avg + alpha * grad           (torch.mul(m, beta).add_(g, alpha=alpha))
        preconditioned: x = x / d + weight_decay * param
        otherwise:      x = x + weight_decay * param * d            (addcmul_)
        x = -lr * x
        preconditioned: out = x + acc;  otherwise: out = x + acc * d  (addcmul_)

    ``d = sqrt(v) + eps`` (times a per-segment scale where given) is computed from the variance as
    the kernel reads it ([Denominator][lightning_onebit.kernels.Denominator]: no buffer of ``d``).

    The decay term is taken where ``param`` is given and ``weight_decay > 0``, the accumulator's
    where ``acc`` is given. One sweep (reads 3-5 buffers, writes one) where the torch ops make five
    or more, writing torch's floats bit for bit on the same device: on the CPU the C++ kernel
    (torch's CPU ``add`` with ``alpha`` and ``addcmul_`` are fused multiply-adds on x86, which the
    kernel does too), on CUDA the CUDA kernel on the current stream (no host synchronisation), with
    the roundings of torch's CUDA kernels (its ``addcmul_`` rounds ``param * d`` before the
    fused multiply-add with ``weight_decay``). Both kernels read each segment's gradient and
    parameter from its own pointer: nothing is copied into a flat buffer first. Without a compiled
    kernel for the device the torch ops themselves run
    ([`reference_local_source`][lightning_onebit.kernels.reference.reference_local_source]).

    Args:
        exp_avg, out: float32, contiguous, one device, covering every segment.
        grad: like them (a flat buffer), or one entry per segment (``None``: zeros), as
            [`momentum_source`][lightning_onebit.kernels.sources.momentum_source]'s.
        denom: a [Denominator][lightning_onebit.kernels.Denominator] of the call's segments
            (its ``exp_avg_sq`` like ``exp_avg``, one ``eps`` per segment).
        param: like ``exp_avg``, or one tensor per segment (no ``None`` entries), each
            parameter where it lies; ``None``: no decay terms.
        acc: like ``exp_avg`` (the momentum accumulator), or ``None``: no accumulator term.
        starts, sizes: each segment's first flat index and number of values.
        beta, alpha, lr, weight_decay: one value per segment (rounded to float32).
        preconditioned: the formula's preconditioned form (the values divided by ``d``).

    Raises:
        TypeError, ValueError: a tensor of another dtype, not contiguous, on another device,
            a segment that does not fit or a per-segment gradient or parameter of another
            size; coefficient lists of other lengths.
    """
    grads, params = _check_local_source(exp_avg=exp_avg, grad=grad, denom=denom, param=param,
                                        acc=acc, out=out, starts=starts, sizes=sizes, beta=beta,
                                        alpha=alpha, lr=lr, weight_decay=weight_decay)  # fmt: skip
    _run_local_source(exp_avg=exp_avg, grads=grads, denom=denom, params=params, acc=acc, out=out,
                      starts=starts, sizes=sizes, beta=beta, alpha=alpha, lr=lr,
                      weight_decay=weight_decay, preconditioned=preconditioned)  # fmt: skip


def _check_local_source(
    *,
    exp_avg: torch.Tensor,
    grad: torch.Tensor | Sequence[torch.Tensor | None],
    denom: Denominator,
    param: torch.Tensor | Sequence[torch.Tensor] | None,
    acc: torch.Tensor | None,
    out: torch.Tensor | None,
    starts: list[int],
    sizes: list[int],
    beta: list[float],
    alpha: list[float],
    lr: list[float],
    weight_decay: list[float],
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None] | None]:
    """[`local_source`][lightning_onebit.kernels.sources.local_source]'s checks of its arguments;
    returns the gradient and the parameter (or ``None``) as one entry per segment."""
    variance, eps = denominator_checks(denom)
    device, named = native.check("local_source", exp_avg=exp_avg, exp_avg_sq=variance, out=out,
                                 grad=grad, param=param, acc=acc)  # fmt: skip
    per_segment = {"sizes": sizes, "beta": beta, "alpha": alpha, "lr": lr,
                   "weight_decay": weight_decay, **eps}  # fmt: skip
    check_segments(named, starts, per_segment)
    grads = check_per_segment("grad", grad, starts, sizes, device, missing=True)
    params = None if param is None else check_per_segment("param", param, starts, sizes, device)
    return grads, params


def _run_local_source(
    *,
    exp_avg: torch.Tensor,
    grads: list[torch.Tensor | None],
    denom: Denominator,
    params: list[torch.Tensor | None] | None,
    acc: torch.Tensor | None,
    out: torch.Tensor,
    starts: list[int],
    sizes: list[int],
    beta: list[float],
    alpha: list[float],
    lr: list[float],
    weight_decay: list[float],
    preconditioned: bool,
) -> None:
    """[`local_source`][lightning_onebit.kernels.sources.local_source] on checked arguments, the
    gradient ``grads`` and the parameter ``params`` one entry per segment: the compiled kernel of
    the device, or the torch ops."""
    if not native.has_kernel(exp_avg.device) or not native.use_native():
        reference_local_source(exp_avg=exp_avg, grad=grads, denom=denom, param=params, acc=acc,
                               out=out, starts=starts, sizes=sizes, beta=beta, alpha=alpha, lr=lr,
                               weight_decay=weight_decay, preconditioned=preconditioned)  # fmt: skip
        return
    native_sources.local_kernels(exp_avg=exp_avg, grads=grads, denom=denom, params=params, acc=acc,
                                 starts=starts, sizes=sizes, beta=beta, alpha=alpha, lr=lr,
                                 weight_decay=weight_decay,
                                 preconditioned=preconditioned).source(out)  # fmt: skip


@dataclasses.dataclass(eq=False, kw_only=True)
class LocalSource(_KernelSource):
    """[`local_source`][lightning_onebit.kernels.sources.local_source]'s values as an
    [`ExchangeSource`][lightning_onebit.kernels.sources.ExchangeSource]. The arguments are
    [`local_source`][lightning_onebit.kernels.sources.local_source]'s (keyword-only), checked
    here.

    Raises:
        TypeError, ValueError: as [`local_source`][lightning_onebit.kernels.sources.local_source];
            segments that do not tile a non-empty range in order.
    """

    UPDATE_OP: ClassVar[str] = "local_update_error"

    exp_avg: torch.Tensor
    grad: torch.Tensor | Sequence[torch.Tensor | None]
    denom: Denominator
    param: torch.Tensor | Sequence[torch.Tensor] | None
    acc: torch.Tensor | None
    out: torch.Tensor | Callable[[], torch.Tensor]
    starts: list[int]
    sizes: list[int]
    beta: list[float]
    alpha: list[float]
    lr: list[float]
    weight_decay: list[float]
    preconditioned: bool

    def __post_init__(self) -> None:
        self.grad, self.param = _check_local_source(
            exp_avg=self.exp_avg, grad=self.grad, denom=self.denom, param=self.param,
            acc=self.acc, out=None if callable(self.out) else self.out, starts=self.starts, sizes=self.sizes, beta=self.beta,
            alpha=self.alpha, lr=self.lr, weight_decay=self.weight_decay,
        )  # fmt: skip
        self._tile()

    def materialize(self) -> torch.Tensor:
        """Run [`local_source`][lightning_onebit.kernels.sources.local_source] into ``out``
        (arguments checked at construction, ``out`` made now where it is a function); return
        ``out[lo:hi]``."""
        out = self._out("local_source")
        _run_local_source(exp_avg=self.exp_avg, grads=self.grad, denom=self.denom,
                          params=self.param, acc=self.acc, out=out, starts=self.starts,
                          sizes=self.sizes, beta=self.beta, alpha=self.alpha, lr=self.lr,
                          weight_decay=self.weight_decay,
                          preconditioned=self.preconditioned)  # fmt: skip
        return out[self.lo : self.hi]

    def _kernels(self) -> native_sources.SourceKernels:
        return native_sources.local_kernels(exp_avg=self.exp_avg, grads=self.grad,
                                            denom=self.denom, params=self.param, acc=self.acc,
                                            starts=self.starts, sizes=self.sizes, beta=self.beta,
                                            alpha=self.alpha, lr=self.lr,
                                            weight_decay=self.weight_decay,
                                            preconditioned=self.preconditioned)  # fmt: skip


class TensorSource(ExchangeSource):
    """Values already computed, a flat float32 tensor, as an
    [`ExchangeSource`][lightning_onebit.kernels.sources.ExchangeSource]: an exchange reads them as
    it reads the tensor itself (the same floats, bits and errors). Nothing is computed as read
    ([`computed_as_read`][lightning_onebit.kernels.sources.TensorSource.computed_as_read] is
    false) and [`materialize`][lightning_onebit.kernels.sources.TensorSource.materialize] returns
    the tensor itself, no copy.

    Args:
        tensor: float32, one-dimensional, contiguous, at least one value; read when the exchange
            reads its input, not copied here.

    Raises:
        TypeError, ValueError: a tensor of another dtype, shape or layout, or an empty one.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32:
            what = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise TypeError(f"a TensorSource takes a float32 tensor, got {what}")
        if tensor.dim() != 1 or not tensor.is_contiguous() or tensor.numel() == 0:
            raise ValueError(
                "a TensorSource takes a flat, contiguous, non-empty tensor (tensor.reshape(-1)), "
                f"got shape {tuple(tensor.shape)} with stride {tuple(tensor.stride())}"
            )
        self.out, self.starts, self.sizes = tensor, [0], [tensor.numel()]
        self.lo, self.hi = 0, tensor.numel()

    @property
    def tensor(self) -> torch.Tensor:
        """The flat tensor of values."""
        return self.out

    @property
    def device(self) -> torch.device:
        return self.out.device

    def like(self) -> torch.Tensor:
        return self.out

    @property
    def computed_as_read(self) -> bool:
        """Never: the values are computed already."""
        return False

    def materialize(self) -> torch.Tensor:
        """The flat tensor itself (no copy)."""
        return self.out

    def __repr__(self) -> str:
        return f"TensorSource(numel={self.hi}, device={self.device})"
