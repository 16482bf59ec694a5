"""Argument checks of the kernels' public functions: each raises a ``TypeError`` or
``ValueError`` that says what to pass instead. The compiled kernels trust them: they receive raw
pointers."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "check_contiguous",
    "check_device",
    "check_params_fit",
    "check_per_segment",
    "check_row_bytes",
    "check_rows",
    "check_scale",
    "check_scales",
    "check_segments",
    "check_tensor",
    "check_verdict",
]


def check_tensor(name: str, t: object, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(
            f"{name} must have dtype {dtype}, got {t.dtype} (convert with .to({dtype}))"
        )
    if t.is_sparse or t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    return t


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


def check_rows(name: str, bits: torch.Tensor) -> None:
    """A (W, m/8) uint8 tensor whose rows are contiguous and do not overlap."""
    if bits.dim() != 2:
        raise ValueError(f"{name} must be 2-D (W, m // 8), got shape {tuple(bits.shape)}")
    if bits.size(0) < 1 or bits.size(1) < 1:
        raise ValueError(f"{name} must have at least one row and one byte, got {tuple(bits.shape)}")
    if bits.stride(1) != 1 and bits.size(1) > 1:
        raise ValueError(
            f"{name} rows must be contiguous (stride(1) == 1), got strides {bits.stride()}"
        )
    if bits.size(0) > 1 and bits.stride(0) < bits.size(1):
        raise ValueError(
            f"{name} rows overlap: stride(0)={bits.stride(0)} < row length {bits.size(1)}"
        )


def check_row_bytes(name: str, bits: torch.Tensor, row_bytes: int) -> None:
    """Rows (``check_rows``) of ``row_bytes`` bytes each."""
    if bits.size(1) != row_bytes:
        raise ValueError(f"{name} rows must hold {row_bytes} bytes, got {bits.size(1)}")


def check_device(
    *named: tuple[str, torch.Tensor], cuda_kernels: bool = True, other_types: bool = False
) -> torch.device:
    """The one device of the ``(name, tensor)`` pairs ``named``: the CPU or CUDA (any type
    where ``other_types``), and CUDA only where ``cuda_kernels`` (the build has the CUDA kernels
    the call needs)."""
    device = named[0][1].device
    for name, t in named[1:]:
        if t.device != device:
            raise ValueError(
                f"all tensors must be on one device: {named[0][0]} is on {device}, {name} on {t.device}"
            )
    if device.type not in ("cpu", "cuda") and not other_types:
        raise ValueError(f"only cpu and cuda tensors are supported, got device {device}")
    if device.type == "cuda" and not cuda_kernels:
        raise RuntimeError(
            "lightning_onebit was built without CUDA kernels; reinstall with a CUDA compiler on PATH "
            "(ONEBIT_CUDA=ON pip install lightning-onebit) or keep the buffers on the CPU"
        )
    return device


def check_scale(name: str, scale: torch.Tensor) -> None:
    check_tensor(name, scale, torch.float32)
    if scale.numel() != 1:
        raise ValueError(f"{name} must have exactly one element, got {scale.numel()}")


def check_scales(name: str, scales: torch.Tensor, w: int) -> None:
    check_tensor(name, scales, torch.float32)
    if scales.dim() != 1 or scales.numel() != w:
        raise ValueError(
            f"{name} must be 1-D with one scale per row ({w}), got shape {tuple(scales.shape)}"
        )


def check_verdict(ok: object, device: torch.device) -> None:
    if not isinstance(ok, torch.Tensor) or ok.dtype != torch.bool or ok.numel() != 1:
        raise TypeError("ok must be a one-element bool tensor (an exchange's verdict)")
    if ok.device != device:
        raise ValueError(f"ok is on {ok.device}, the buffers on {device}")


def check_params_fit(
    params: list[torch.Tensor], starts: list[int], n_flat: int, device: torch.device
) -> None:
    """Parameter ``j`` is on ``device`` and its values fit the flat buffers at ``starts[j]``."""
    for j, (p, lo) in enumerate(zip(params, starts, strict=True)):
        if p.device != device:
            raise ValueError(f"params[{j}] is on {p.device}, the buffers on {device}")
        if lo < 0 or lo + p.numel() > n_flat:
            raise ValueError(
                f"params[{j}] ({p.numel()} values from {lo}) does not fit the flat buffers "
                f"({n_flat} values)"
            )


def check_segments(
    named: list[tuple[str, torch.Tensor | None]],
    starts: list[int],
    per_segment: dict[str, Sequence[float]],
) -> None:
    """Raise ``ValueError`` unless every list of ``per_segment`` has one value per segment and
    each segment ``[starts[k], starts[k] + sizes[k])`` fits every tensor of ``named``."""
    n = len(starts)
    for name, vals in per_segment.items():
        if len(vals) != n:
            raise ValueError(f"{name} must have one value per segment ({n}), got {len(vals)}")
    limit = min(t.numel() for _, t in named if t is not None)
    for lo, size in zip(starts, per_segment["sizes"], strict=True):
        if lo < 0 or size < 0 or lo + size > limit:
            raise ValueError(f"segment [{lo}, {lo + size}) does not fit buffers of {limit} values")


def check_per_segment(
    name: str,
    t: torch.Tensor | Sequence[torch.Tensor | None],
    starts: list[int],
    sizes: list[int],
    device: torch.device,
    missing: bool = False,
) -> list[torch.Tensor | None]:
    """``t`` as one entry per segment: a flat buffer's slices ``starts[k]:starts[k] +
    sizes[k]`` (the buffer checked by the caller), or the sequence itself, checked here.

    Raises:
        TypeError, ValueError: unless the sequence has one entry per segment, each a float32
            contiguous tensor of its segment's size on ``device`` (or, where ``missing``,
            ``None``).
    """
    if isinstance(t, torch.Tensor):
        return [t[lo : lo + n] for lo, n in zip(starts, sizes, strict=True)]
    pieces = list(t)
    if len(pieces) != len(sizes):
        what = "one tensor (or None)" if missing else "one tensor"
        raise ValueError(f"{name} must have {what} per segment ({len(sizes)}), got {len(pieces)}")
    for k, (x, n) in enumerate(zip(pieces, sizes, strict=True)):
        if x is None:
            if missing:
                continue
            raise TypeError(f"{name}[{k}] is None: give a tensor for every segment")
        check_tensor(f"{name}[{k}]", x, torch.float32)
        check_contiguous(f"{name}[{k}]", x)
        if x.device != device:
            raise ValueError(f"{name}[{k}] is on {x.device}, the buffers on {device}")
        if x.numel() != n:
            raise ValueError(f"{name}[{k}] must have its segment's {n} values, got {x.numel()}")
    return pieces
