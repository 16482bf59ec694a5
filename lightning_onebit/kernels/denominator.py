"""The frozen variance's denominator as the update and source kernels take it:
[Denominator][lightning_onebit.kernels.Denominator], the variance and the per-segment
coefficients that ``sqrt(v) + eps`` is computed from as the kernels read ``v``, so that no buffer
of it is held. A leaf of ``kernels``: the compiled calls (``native``) and the pure-torch twins
(``reference``) both take it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_onebit.kernels.checks import check_contiguous, check_tensor

__all__ = ["Denominator", "denominator_checks"]


class Denominator:
    """``d = sqrt(exp_avg_sq) * dscale + eps`` for the segments of one kernel call, each
    operation rounded to float32 on its own: the correctly rounded square root (IEEE, as the
    CPU kernels' ``sqrt`` and CUDA's ``__fsqrt_rn``), then ``d.mul_(dscale[k])`` and
    ``d.add_(eps[k])``. The multiplication is made only where ``dscale`` is given (it would be
    by 1 otherwise, which changes no float).

    Args:
        exp_avg_sq: the flat variance, float32, one-dimensional, contiguous; read where it lies
            (segment ``k`` of a call reads its values ``starts[k]:starts[k] + sizes[k]``).
        eps: one value per segment of the call (rounded to float32).
        dscale: ``None``, or one float32 value per segment (``sqrt(r)`` of ``rescale_variance``),
            contiguous, on ``exp_avg_sq``'s device; read by the kernels where it lies (no host
            read).

    Raises:
        TypeError, ValueError: a tensor of another dtype, shape or layout, or on another device;
            a ``dscale`` of another length than ``eps``.
    """

    def __init__(
        self,
        exp_avg_sq: torch.Tensor,
        eps: Sequence[float],
        dscale: torch.Tensor | None = None,
    ) -> None:
        check_tensor("exp_avg_sq", exp_avg_sq, torch.float32)
        check_contiguous("exp_avg_sq", exp_avg_sq)
        if exp_avg_sq.dim() != 1:
            raise ValueError(f"exp_avg_sq must be flat, got shape {tuple(exp_avg_sq.shape)}")
        self.exp_avg_sq, self.eps = exp_avg_sq, [float(e) for e in eps]
        if dscale is not None:
            check_tensor("dscale", dscale, torch.float32)
            check_contiguous("dscale", dscale)
            if dscale.device != exp_avg_sq.device:
                raise ValueError(f"dscale is on {dscale.device}, exp_avg_sq on {exp_avg_sq.device}")
            if dscale.dim() != 1 or dscale.numel() != len(self.eps):
                raise ValueError(
                    f"dscale must have one value per segment ({len(self.eps)}), "
                    f"got shape {tuple(dscale.shape)}"
                )
        self.dscale = dscale

    def segment(self, k: int, lo: int, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Segment ``k``'s ``d``, its values ``lo:lo + n`` of ``exp_avg_sq``, with torch ops (the
        kernels' floats). The square root is taken in float64 and rounded once, which is the
        correctly rounded float32 one: torch's own float32 ``sqrt`` on the CPU is MKL's (VML's
        high-accuracy mode, within an ulp but not correctly rounded).

        Args:
            k: the segment's index in the call.
            lo, n: its first flat index and number of values.
            out: ``n`` float32 values to write it into (default: a new tensor).

        Returns:
            ``out`` (or the new tensor), flat.
        """
        root = torch.sqrt(self.exp_avg_sq[lo : lo + n].double())
        d = root.float() if out is None else out.copy_(root)
        if self.dscale is not None:
            d.mul_(self.dscale[k])
        return d.add_(self.eps[k])

    def write(self, out: torch.Tensor, starts: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        """Every segment's ``d`` into the same flat indices of ``out`` (a flat float32 buffer
        like ``exp_avg_sq``; its other values are left as they are), with torch ops.

        Returns:
            ``out``.
        """
        for k, (lo, n) in enumerate(zip(starts, sizes, strict=True)):
            self.segment(k, lo, n, out=out[lo : lo + n])
        return out

    def __repr__(self) -> str:
        scaled = "" if self.dscale is None else ", scaled"
        return f"Denominator(numel={self.exp_avg_sq.numel()}, segments={len(self.eps)}{scaled})"


def denominator_checks(
    denom: object, required: bool = True
) -> tuple[torch.Tensor | None, dict[str, list[float]]]:
    """What a kernel's checks take of ``denom``: its ``exp_avg_sq`` (``None`` without one), to be
    checked with the call's flat buffers, and its per-segment lists by name (``eps``), to be
    checked against the call's segments.

    Raises:
        TypeError: ``denom`` is not a [Denominator][lightning_onebit.kernels.Denominator] (or
            ``None``, where not ``required``).
    """
    if denom is None and not required:
        return None, {}
    if not isinstance(denom, Denominator):
        what = "a Denominator" if required else "a Denominator or None"
        raise TypeError(f"denom must be {what}, got {type(denom).__name__}")
    return denom.exp_avg_sq, {"eps": denom.eps}
