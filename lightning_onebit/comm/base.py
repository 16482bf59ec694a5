"""What every exchange shares: the [`Exchange`][lightning_onebit.comm.base.Exchange] and
[`Handle`][lightning_onebit.comm.base.Handle] interfaces, the NaN/Inf error, input checks, the
full-precision average and byte formulas."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lightning_onebit import kernels

_log = logging.getLogger(__name__)

__all__ = [
    "AVERAGE_DTYPES",
    "CODED_BITS",
    "Exchange",
    "Handle",
    "NonFiniteError",
    "all_finite",
    "all_gather_single",
    "as_average_dtype",
    "check_input",
    "explained",
    "fp32_allreduce_bytes",
    "new_group",
    "start_average",
]

#: ``dist.all_gather_single`` (torch >= 2.10, where ``all_gather_into_tensor``, the same
#: collective, warns that it is deprecated) or ``all_gather_into_tensor`` before it.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class NonFiniteError(FloatingPointError):
    """A NaN or Inf reached the compressed exchange: raised on every rank in the same call, before
    anything changed (error buffers as before the call, nothing sent after the scales)."""


def new_group(
    ranks: list[int] | None, backend: str, timeout: timedelta | None, purpose: str
) -> dist.ProcessGroup:
    """``dist.new_group(ranks, backend, timeout)``, collective over the default group (every
    rank calls it, in the same order), with an error that says which group did not connect.

    Args:
        ranks: the group's global ranks (``None``: every rank).
        backend: e.g. ``"gloo"``, ``"nccl"``.
        timeout: how long to wait for the other ranks (and the group's collectives' timeout);
            ``None``: torch's default.
        purpose: what the group is for, for the error message.

    Raises:
        RuntimeError: the group did not connect within ``timeout``; the message names it, the
            ranks, and the settings to check.
    """
    kw: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    try:
        return dist.new_group(ranks=ranks, backend=backend, **kw)
    except RuntimeError as err:  # torch's DistError and its store/network errors too
        who = "every rank" if ranks is None else f"ranks {ranks}"
        raise RuntimeError(
            f"could not create {purpose} ({backend} process group of {who}, timeout "
            f"{timeout or 'torch default'}): {' '.join(str(err).split())[:300]}. Each rank "
            "creates it while the strategy sets up, after the default group connected: check "
            "that every rank runs the same strategy and options, and that the ranks reach each "
            "other on the interface MASTER_ADDR names (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME). "
            "The strategy's `timeout=` bounds the wait"
        ) from err


def fp32_allreduce_bytes(numel: int, world_size: int) -> int:
    """Bytes one rank sends in a ring allreduce of ``numel`` fp32 values (the DDP baseline)."""
    return 0 if world_size <= 1 else 2 * (world_size - 1) * numel * 4 // world_size


#: The dtypes a gradient average may travel in, by the names a config may use: floats, or
#: integer codes with a scale per block and error feedback
#: ([`QuantizedAllreduce`][lightning_onebit.comm.quantized.QuantizedAllreduce]).
AVERAGE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "int8": torch.int8,
    "int4": torch.int4,
}

#: The integer-coded average dtypes' bits per value.
CODED_BITS: dict[torch.dtype, int] = {torch.int8: 8, torch.int4: 4}


def as_average_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.float32``/``bfloat16``/``float16``/``int8``/``int4`` from a dtype or its name
    (``"bf16"`` too)."""
    got = AVERAGE_DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if got not in AVERAGE_DTYPES.values():
        raise ValueError(
            "average_dtype must be torch.float32, torch.bfloat16, torch.float16, torch.int8 or "
            f"torch.int4 (or one of {sorted(AVERAGE_DTYPES)}), got {dtype!r}"
        )
    return got


def start_average(
    flat: torch.Tensor, dtype: torch.dtype, group: dist.ProcessGroup | None = None
) -> Callable[[], None]:
    """Start averaging the fp32 tensor ``flat`` over the group's ranks; the returned ``wait()``
    leaves the mean in ``flat``.

    ``float32`` sums exactly as DDP does, then divides. ``bfloat16``/``float16`` send half the
    bytes as DDP's ``bf16_compress_hook``/``fp16_compress_hook`` do: cast, divide by ``W``, sum
    in that dtype, cast back (float16 flushes values below ~6e-8 * W to zero; bfloat16 keeps
    fp32's range with 8 bits of mantissa).

    Raises:
        ValueError: ``dtype`` is an integer code (``CODED_BITS``): that average keeps error
            buffers from call to call, a
            [`QuantizedAllreduce`][lightning_onebit.comm.quantized.QuantizedAllreduce]'s.
    """
    if dtype in CODED_BITS:
        raise ValueError(
            f"an average in {dtype} keeps error buffers across calls: use "
            "comm.QuantizedAllreduce for it"
        )
    w = dist.get_world_size(group)
    if dtype == torch.float32:
        work = dist.all_reduce(flat, group=group, async_op=True)

        def wait() -> None:
            work.wait()
            flat.div_(w)

        return wait
    buf = flat.to(dtype).div_(w)
    work = dist.all_reduce(buf, group=group, async_op=True)

    def wait_half() -> None:
        work.wait()
        flat.copy_(buf)
        if buf.is_cuda:  # made on another thread's stream (the overlap), read on this one
            buf.record_stream(torch.cuda.current_stream(buf.device))

    return wait_half


@contextlib.contextmanager
def explained(what: str, rank: int, world_size: int) -> Iterator[None]:
    """Re-raise the failure of an exchange's collective ``what`` (on ``rank`` of
    ``world_size``) with what it most likely means and what to check.

    The message is also logged at once (``ERROR``, this module's logger): a launcher that
    stops every rank as soon as one exits (Lightning's ``popen`` launcher, torchrun's agent)
    can kill this process during the teardown, before its traceback prints."""
    try:
        yield
    except RuntimeError as e:
        message = (
            f"1-bit exchange failed in its {what} (rank {rank} of {world_size}): a "
            "peer rank died, stopped, or did not reach the same exchange within the process "
            "group's timeout (OneBitStrategy(timeout=...), init_process_group(timeout=...)). "
            f"Check the other ranks' logs for the first error. Cause: {e}"
        )
        _log.error(message)
        raise RuntimeError(message) from e


def all_finite(scales: torch.Tensor) -> bool:
    """The exchange's NaN/Inf verdict, read on the host: whether every rank's scale is finite
    (one NaN/Inf value makes its rank's scale non-finite). Every rank learns it in the same call,
    before any state is written, so a bad step is dropped exactly, on every rank. On CUDA this
    waits for the ``all_to_all``: the 1-bit optimizers' exchanges keep it on the device instead
    (``CompressedAllreduce(device_verdict=True)``)."""
    return bool(torch.isfinite(scales).all())


def check_input(
    tensor: torch.Tensor | kernels.ExchangeSource, numel: int, device: torch.device
) -> torch.Tensor | kernels.ExchangeSource:
    """``tensor`` flattened (a view when contiguous), if it is a float32 tensor of ``numel``
    values on ``device``, or an [`ExchangeSource`][lightning_onebit.kernels.sources.ExchangeSource]
    of ``numel`` values on ``device`` (as it is; a
    [`TensorSource`][lightning_onebit.kernels.sources.TensorSource] for values already computed):
    what an exchange built for that takes."""
    if isinstance(tensor, kernels.ExchangeSource):
        numel_in = tensor.numel()
    elif not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"expected a torch.Tensor or a kernels.ExchangeSource, got {type(tensor).__name__}"
        )
    elif tensor.dtype != torch.float32:
        raise TypeError(
            f"CompressedAllreduce works on float32 buffers, got {tensor.dtype}; pass tensor.float()"
        )
    else:
        numel_in = tensor.numel()
    if numel_in != numel:
        raise ValueError(f"this exchange was built for {numel} values, got a tensor of {numel_in}")
    if tensor.device != device:
        raise ValueError(
            f"this exchange's buffers are on {device}, the tensor is on {tensor.device}"
        )
    return tensor if isinstance(tensor, kernels.ExchangeSource) else tensor.reshape(-1)


class Handle(Protocol):
    """An exchange call in flight (``Exchange.start``).

    ``wait()`` finishes it and returns the average; a call started with ``commit=False``
    advances the exchange's error buffers only on ``commit()`` and leaves them as they were on
    ``discard()``. ``finite`` says whether every rank's input was finite (with a host verdict;
    ``error()`` is then the error to raise); ``ok`` is the verdict on the device, or ``None``.
    """

    finite: bool
    ok: torch.Tensor | None

    def wait(self, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def commit(self, ok: torch.Tensor | None = None) -> None: ...

    def discard(self) -> None: ...

    def error(self) -> NonFiniteError: ...

    def get_future(self) -> torch.futures.Future: ...


class Exchange(Protocol):
    """An error-compensated 1-bit average of a fp32 buffer of fixed size over the ranks: the
    flat exchange, the two-level one, and the bucketed one (several of either).

    ``finish(sources, out)`` runs one call over the whole buffer: ``sources`` holds one
    [kernels.ExchangeSource][lightning_onebit.kernels.ExchangeSource] per flat range of
    ``pending`` (those no earlier ``start`` covered; values already computed as a
    [kernels.TensorSource][lightning_onebit.kernels.TensorSource]), and ``out`` is where
    the result is decoded; ``out=None`` on an exchange that ``returns_runs`` (the flat one
    and buckets of it, on the CPU) returns the result where it lies, as
    [kernels.SignRuns][lightning_onebit.kernels.SignRuns], for the update kernels to read.
    The exchange calls nothing of its caller's. ``bytes_sent`` is what this rank sent in the
    last call (``calls``: how many so far) and ``inter_node_bytes`` the part of it that
    left the node;
    ``device_verdict`` exchanges keep their NaN/Inf verdict on the device (``verdict``).
    ``bounds`` are the buckets (``None``: one exchange). The error buffers are per rank:
    ``state_dict``/``load_state_dict``/``reset_error``, and ``error_views`` for a caller that
    keeps values out of a call.
    """

    numel: int
    world_size: int
    device: torch.device
    device_verdict: bool
    bytes_sent: int
    calls: int
    bounds: list[tuple[int, int]] | None

    @property
    def verdict(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    @property
    def bytes_per_call(self) -> int: ...

    @property
    def returns_runs(self) -> bool: ...

    def pending(self) -> list[tuple[int, int]]: ...

    def finish(
        self,
        sources: Sequence[kernels.ExchangeSource],
        out: torch.Tensor | None,
    ) -> kernels.SignRuns | None: ...

    def inter_node_bytes(self, ranks_per_node: int) -> int: ...

    def error_views(self, lo: int, hi: int) -> list[torch.Tensor]: ...

    def reset_error(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...
