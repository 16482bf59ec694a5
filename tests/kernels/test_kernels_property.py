"""Property-based tests of the kernels' Python face, on random sizes, values, strides and devices.

Each draw is a valid call (about 3 in 4: random sizes and values, rows that are strided views)
or a valid call with exactly one defect (a wrong dtype, device, contiguity, shape or size). A
valid call must run and equal the pure-torch reference; a defective one must raise a clear
TypeError/ValueError/RuntimeError (never crash, never write out of bounds). ``hypothesis``'s
statistics (``pytest --hypothesis-show-statistics``) count both kinds as events.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from lightning_onebit import kernels as K

pytestmark = pytest.mark.skipif(not K.HAS_CPP, reason="C++ extension not built")

CLEAR = (TypeError, ValueError, RuntimeError)
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _values(draw: st.DrawFn, numel: int) -> torch.Tensor:
    """``numel`` random float32 values (zeros included: sign(0) = +1 is part of the format)."""
    seed = draw(st.integers(0, 2**16))
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    if numel and draw(st.booleans()):
        x[:: max(1, numel // 3)] = 0.0
    return x


def _rows(draw: st.DrawFn, w: int, row_bytes: int, random: bool = True) -> torch.Tensor:
    """A valid ``(w, row_bytes)`` uint8 tensor: contiguous or a row-strided view."""
    pad = draw(st.sampled_from([0, 0, 1, 3]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    base = (
        torch.randint(0, 256, (w, row_bytes + pad), dtype=torch.uint8, generator=gen)
        if random
        else torch.zeros(w, row_bytes + pad, dtype=torch.uint8)
    )
    return base[:, :row_bytes]


#: one defect each, applied to a valid call's tensors (a dict: name -> tensor)
def _defects(names: dict[str, str]) -> list[tuple[str, Callable[[dict], None]]]:
    """``names``: role -> argument name. The defects that apply to those roles."""
    out: list[tuple[str, Callable[[dict], None]]] = []
    for role, name in names.items():
        if role in ("float", "bits", "scale"):
            wrong = torch.float64 if role != "bits" else torch.int8
            out.append((f"{name} dtype", lambda a, n=name, d=wrong: a.update({n: a[n].to(d)})))
            out.append((f"{name} on meta", lambda a, n=name: a.update({n: a[n].to("meta")})))
        if role == "float":
            out.append(
                (
                    f"{name} not contiguous",
                    lambda a, n=name: a.update(
                        {n: torch.stack([a[n], a[n]], 1).reshape(-1)[::2]}
                        if a[n].numel() > 1
                        else {n: torch.zeros(2, 3).t()}
                    ),
                )
            )
        if role == "bits":
            out.append((f"{name} 1-D", lambda a, n=name: a.update({n: a[n].contiguous().view(-1)})))
            out.append(
                (
                    f"{name} rows not contiguous",
                    lambda a, n=name: a.update(
                        {n: torch.zeros(a[n].size(1) + 1, a[n].size(0) + 1, dtype=torch.uint8).t()}
                    ),
                )
            )
        if role == "scale":
            out.append((f"{name} 2 values", lambda a, n=name: a.update({n: torch.zeros(2)})))
    return out


def _draw_call(draw: st.DrawFn, valid: dict, defects: list) -> tuple[dict, str | None]:
    """The valid call, or it with one defect (a quarter of the draws)."""
    if draw(st.integers(0, 3)) > 0:
        event("valid call")
        return valid, None
    what, apply = draw(st.sampled_from(defects))
    event(f"defect: {what}")
    apply(valid)
    return valid, what


def _clone(args: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


# --------------------------------------------------------------------------- worker_compress


@st.composite
def worker_calls(draw: st.DrawFn) -> tuple[dict, str | None]:
    w, rows = draw(st.integers(1, 5)), draw(st.integers(1, 40))
    n = 8 * w * rows
    args = {
        "x": _values(draw, draw(st.integers(0, n))),
        "error": _values(draw, n),
        "bits": _rows(draw, w, rows, random=False),
        "scale": torch.zeros(draw(st.sampled_from([(), (1,)]))),
    }
    defects = _defects({"float": "x", "bits": "bits", "scale": "scale"})
    defects += _defects({"float": "error"})
    defects += [
        ("error not a multiple of 8 W", lambda a: a.update({"error": torch.zeros(n + 3)})),
        ("x longer than error", lambda a: a.update({"x": torch.zeros(n + 1)})),
        (
            "bits rows of the wrong length",
            lambda a: a.update({"bits": torch.zeros(w, rows + 1, dtype=torch.uint8)}),
        ),
    ]
    if draw(st.booleans()):  # the one-sweep form, with or without the previous call's update
        args.update(deferred=True, error_out=torch.full((n,), float("nan")))
        defects.append(
            ("error_out of another size", lambda a: a.update({"error_out": torch.zeros(n + 8)}))
        )
        if draw(st.booleans()):
            bits = args["bits"]  # (prev_bits: the same rows and row stride)
            prev = torch.empty_strided(bits.shape, bits.stride(), dtype=torch.uint8)
            prev.random_(0, 256, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
            args.update(
                pending=True, prev_bits=prev, prev_scale=torch.full((1,), draw(st.floats(0, 2)))
            )
    return _draw_call(draw, args, defects)


@SETTINGS
@given(worker_calls())
def test_worker_compress_is_the_reference_or_refused(call: tuple[dict, str | None]) -> None:
    args, defect = call
    if defect is not None:
        with pytest.raises(CLEAR):
            K.worker_compress(**args)
        return
    ref = _clone(args)
    K.worker_compress(**args)
    K.reference_worker_compress(**ref)
    assert torch.equal(args["bits"], ref["bits"])
    written = "error_out" if args.get("deferred") else "error"
    torch.testing.assert_close(args[written], ref[written], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(args["scale"], ref["scale"], rtol=1e-6, atol=0)


# --------------------------------------------------------------------------- decompress


@st.composite
def decode_calls(draw: st.DrawFn) -> tuple[dict, str | None]:
    w, rows = draw(st.integers(1, 5)), draw(st.integers(1, 30))
    scales = _values(draw, w).abs()
    if draw(st.booleans()):  # a strided view of the scales is fine
        scales = torch.stack([scales, -scales], 1)[:, 0]
    args = {
        "bits": _rows(draw, w, rows),
        "scales": scales,
        "out": torch.full((draw(st.integers(1, 8 * w * rows)),), float("nan")),
    }
    defects = _defects({"bits": "bits", "float": "out"})
    defects += [
        ("scales dtype", lambda a: a.update({"scales": a["scales"].double()})),
        ("scales one short", lambda a: a.update({"scales": a["scales"][: w - 1]})),
        ("out longer than the bits", lambda a: a.update({"out": torch.zeros(8 * w * rows + 1)})),
    ]
    return _draw_call(draw, args, defects)


@SETTINGS
@given(decode_calls())
def test_decompress_is_the_reference_or_refused(call: tuple[dict, str | None]) -> None:
    args, defect = call
    if defect is not None:
        with pytest.raises(CLEAR):
            K.decompress(**args)
        return
    ref = _clone(args)
    K.decompress(**args)
    K.reference_decompress(**ref)
    assert torch.equal(args["out"], ref["out"])


# --------------------------------------------------------------------------- server_reduce


@st.composite
def server_calls(draw: st.DrawFn) -> tuple[dict, str | None]:
    w, rows = draw(st.integers(1, 5)), draw(st.integers(1, 30))
    args = {
        "bits": _rows(draw, w, rows),
        "scales": _values(draw, w).abs(),
        "error": _values(draw, 8 * rows),
        "out_bits": torch.zeros(rows, dtype=torch.uint8),
        "out_scale": torch.zeros(draw(st.sampled_from([(), (1,)]))),
    }
    defects = _defects({"bits": "bits", "float": "error", "scale": "out_scale"})
    defects += [
        ("scales one more", lambda a: a.update({"scales": torch.ones(w + 1)})),
        ("error not a multiple of 8", lambda a: a.update({"error": torch.zeros(8 * rows + 3)})),
        ("out_bits too long", lambda a: a.update({"out_bits": torch.zeros(rows + 1).byte()})),
    ]
    return _draw_call(draw, args, defects)


@SETTINGS
@given(server_calls(), st.booleans())
def test_server_reduce_is_the_reference_or_refused(
    call: tuple[dict, str | None], pending: bool
) -> None:
    args, defect = call
    if defect is not None:
        with pytest.raises(CLEAR):
            K.server_reduce(**args, pending=pending)
        return
    ref = _clone(args)
    K.server_reduce(**args, pending=pending)
    K.reference_server_reduce(**ref, pending=pending)
    assert torch.equal(args["out_bits"], ref["out_bits"])
    torch.testing.assert_close(args["out_scale"], ref["out_scale"], rtol=1e-6, atol=0)
    torch.testing.assert_close(args["error"], ref["error"], rtol=1e-6, atol=1e-6)
