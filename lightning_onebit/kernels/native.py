"""The compiled kernels (``lightning_onebit._C``): one table that declares each op, one check of
its tensors and one launcher that turns checked tensors into its raw-pointer call, on the CPU or
on CUDA (the device's current stream).

Why raw pointers: the extension needs no torch headers, so it builds in seconds with pybind11
and CMake alone and one build works with any torch. Every pointer is taken here, by `launch`,
from tensors that `check` has checked (dtype, layout, contiguity, device) with the op's
declaration in `OPS`; the public functions check the sizes that relate them."""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from lightning_onebit.kernels.checks import (
    check_contiguous,
    check_device,
    check_rows,
    check_scale,
    check_scales,
    check_tensor,
    check_verdict,
)
from lightning_onebit.kernels.denominator import Denominator
from lightning_onebit.kernels.runs import SignRuns

__all__ = [
    "HAS_CPP",
    "HAS_CUDA",
    "IMPORT_ERROR",
    "OPS",
    "Op",
    "Table",
    "check",
    "chunk_starts",
    "denominator_args",
    "denominator_coefs",
    "has_kernel",
    "launch",
    "module",
    "nthreads",
    "on_device",
    "param_table",
    "segment_table",
    "stream",
    "use_native",
    "workspace",
]

try:
    from lightning_onebit import _C as module
except ImportError as _err:  # pragma: no cover - exercised only on broken installs
    module = None
    IMPORT_ERROR: ImportError | None = _err
else:
    IMPORT_ERROR = None

#: the compiled module imported (its CPU kernels); and it was built with CUDA kernels
HAS_CPP: bool = module is not None
HAS_CUDA: bool = bool(module is not None and module.has_cuda)

_fallback_warned = False


def has_kernel(device: torch.device, op: str | None = None) -> bool:
    """Whether the compiled module has a kernel for ``device``: the CPU, or CUDA in a build
    with CUDA kernels; with ``op``, also an entry of that op (`OPS`) for it."""
    if op is not None and getattr(OPS[op], device.type, None) is None:
        return False
    return device.type == "cpu" or (device.type == "cuda" and HAS_CUDA)


def use_native() -> bool:
    """Whether the compiled module imported; warns once when it did not (the pure-torch twins
    then run, the same results, several times slower)."""
    global _fallback_warned
    if HAS_CPP:
        return True
    if not _fallback_warned:
        warnings.warn(
            f"lightning_onebit._C failed to import ({IMPORT_ERROR}); using the pure-torch kernels "
            "(same results, several times slower). Reinstall the package to build the extension.",
            RuntimeWarning,
            stacklevel=3,
        )
        _fallback_warned = True
    return False


def nthreads() -> int:
    """The CPU kernels' thread count: torch's intra-op threads."""
    return max(1, torch.get_num_threads())


def stream(device: torch.device) -> int:
    """The handle of ``device``'s current CUDA stream, which every CUDA call runs on."""
    return torch.cuda.current_stream(device).cuda_stream


def on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host array (hyperparameters, offsets, pointers) in ``device``'s memory for one call,
    copied on the device's current stream, which the call's kernel runs on, without a host
    synchronisation: from pinned memory, which torch's caching host allocator keeps until the
    copy has run (a copy from pageable memory may synchronise). The result comes from the
    caching allocator on that stream, so it is reused only after the kernel has read it."""
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def chunk_starts(sizes: list[int]) -> list[int]:
    """The CUDA optimizer updates' chunk table (``cpp/onebit.h``): parameter (layer) ``j`` owns
    chunks ``out[j]:out[j + 1]`` of ``module.cuda_update_chunk()`` values; ``out[-1]`` chunks in all."""
    chunk = module.cuda_update_chunk()
    return list(itertools.accumulate((-(-s // chunk) for s in sizes), initial=0))


def workspace(device: torch.device, nbytes: int | None = None) -> torch.Tensor:
    """Scratch for one CUDA call (default: the compressions' ``module.cuda_workspace_bytes()``),
    never shared: two exchanges in flight (buckets, param groups, threads) each get their own.
    From torch's caching allocator on the current stream, which the call's kernels run on, so it
    is reused only after they have read it."""
    nbytes = module.cuda_workspace_bytes() if nbytes is None else nbytes
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


@dataclasses.dataclass(frozen=True)
class Op:
    """One compiled op: entries ``<name>_cpu`` and ``<name>_cuda`` of the module.

    ``cpu`` and ``cuda`` name the entries' arguments in order (``None``: no such entry), leaving
    out what `launch` adds itself: on CUDA the device index first and the current stream last,
    on the CPU the thread count last (then, where ``runs``, the
    [SignRuns][lightning_onebit.kernels.SignRuns]' arrays). A name is a value given to
    `launch`: a tensor is its pointer, ``None`` the pointer 0, a `SignRuns` the pointer 0 with
    its arrays after the thread count, anything else itself; ``#t`` is ``t.numel()``,
    ``t.rows`` ``t.size(0)``, ``t.stride`` ``t.stride(0)``, ``t.bytes`` its size in bytes,
    ``t:f`` a one-element tensor read on the host (0.0 for ``None``); ``ws`` is a compression
    workspace, ``partials`` three float64 per chunk, and a `Table`'s rows, ``np`` (its
    segments), ``chunk_start`` and ``nchunks`` (CUDA) come from the call's table.

    ``tensors`` declares the tensors `check` checks, ``name:kind``, in the order of its
    messages: ``f32`` float32 and contiguous (``f32s`` or a per-segment sequence, ``f32r`` or
    `SignRuns`, both checked with their segments), ``u8`` uint8, ``u8c`` uint8 and contiguous,
    ``rows`` uint8 rows (``check_rows``), ``scale`` one float32, ``scales`` one float32 per row
    of the rows before it, ``bool`` bool and contiguous, ``any`` contiguous, ``ok`` a verdict.
    ``cuda_kernels``: CUDA tensors need the build's CUDA kernels (others fall back to torch);
    ``any_device``: tensors on other devices are accepted (the torch path takes them);
    ``skip_empty``: a CUDA call with no chunks has nothing to do and is not made.
    """

    cpu: str | None
    cuda: str | None
    tensors: str = ""
    runs: bool = False
    cuda_kernels: bool = False
    any_device: bool = False
    skip_empty: bool = False
    #: ``cpu`` and ``cuda`` parsed once: per argument ``(what, name)`` (see `_parse`)
    cpu_args: tuple[tuple[str, str], ...] = dataclasses.field(init=False)
    cuda_args: tuple[tuple[str, str], ...] = dataclasses.field(init=False)
    #: ``tensors`` parsed once: ``(name, kind)`` pairs
    kinds: tuple[tuple[str, str], ...] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cpu_args", tuple(map(_parse, (self.cpu or "").split())))
        object.__setattr__(self, "cuda_args", tuple(map(_parse, (self.cuda or "").split())))
        kinds = tuple(tuple(item.split(":")) for item in self.tensors.split())
        object.__setattr__(self, "kinds", kinds)


def _parse(token: str) -> tuple[str, str]:
    """An `Op` argument's token as ``(what, name)``: ``what`` is ``value``, ``#``, ``f``,
    ``rows``, ``stride``, ``bytes`` or ``scratch``."""
    if token in ("ws", "partials"):
        return "scratch", token
    if token.startswith("#"):
        return "#", token[1:]
    if token.endswith(":f"):
        return "f", token[:-2]
    key, _, attr = token.partition(".")
    return attr or "value", key


_COMPRESS = "error error_out #error bits bits.rows bits.stride prev_bits prev_scale{} pending scale"
_COMPRESS_CPU, _COMPRESS_CUDA = _COMPRESS.format(":f"), _COMPRESS.format("") + " ws"
_MOMENTUM = "exp_avg grads exp_avg_sq eps dscale np starts sizes beta alpha base nx "
_DENOM = "exp_avg_sq eps dscale"
_LOCAL = f"exp_avg grads {_DENOM} params acc np starts sizes beta alpha nwd nlr precond base nx "
_CHUNKS = "starts sizes chunk_start nchunks"
_ROWS = "bits bits.rows bits.stride scales scales.stride"
_ADAM = "lr beta1 ob1 beta2 ob2 eps wd update_variance"
_LAMB = "scaling beta1 ob1 beta2 ob2 eps wd"

#: every compiled op, by name
OPS: dict[str, Op] = {
    "worker_compress": Op(
        cpu="x #x " + _COMPRESS_CPU,
        cuda="x #x " + _COMPRESS_CUDA,
        tensors="x:f32 error:f32 error_out:f32 bits:rows prev_bits:u8 scale:scale prev_scale:scale",
        cuda_kernels=True,
    ),
    "worker_update_error": Op(
        cpu="x #x error out #error scale:f",
        cuda="x #x error out #error scale",
        tensors="x:f32 error:f32 scale:scale out:f32",
        cuda_kernels=True,
    ),
    "server_reduce": Op(
        cpu=f"{_ROWS} error error_out #error prev_bits prev_scale:f out_bits out_scale pending",
        cuda=f"{_ROWS} error error_out #error prev_bits prev_scale out_bits out_scale pending ws",
        tensors="bits:rows scales:scales error:f32 error_out:f32 out_bits:u8c prev_bits:u8c "
        "out_scale:scale prev_scale:scale",
        cuda_kernels=True,
    ),
    "decompress": Op(
        cpu=f"{_ROWS} m out #out",
        cuda=f"{_ROWS} m out #out",
        tensors="bits:rows scales:scales out:f32",
        cuda_kernels=True,
    ),
    # the integer codec (kernels.quantized; without a kernel for the device, its torch twins)
    "quantize": Op(
        cpu="x #x error error_out n bits block rows rows.rows rows.stride",
        cuda="x #x error error_out n bits block rows rows.rows rows.stride",
        tensors="x:f32 error:f32 error_out:f32 rows:rows",
    ),
    "quantized_reduce": Op(
        cpu="rows rows.rows rows.stride m bits block error error_out out_row",
        cuda="rows rows.rows rows.stride m bits block error error_out out_row",
        tensors="rows:rows error:f32 error_out:f32 out_row:u8c",
    ),
    "dequantize": Op(
        cpu="rows rows.rows rows.stride m bits block out #out",
        cuda="rows rows.rows rows.stride m bits block out #out",
        tensors="rows:rows out:f32",
    ),
    # their tensors are checked as their sources' and worker_compress's
    "momentum_compress": Op(cpu=_MOMENTUM + _COMPRESS_CPU, cuda=_MOMENTUM + _COMPRESS_CUDA),
    "local_compress": Op(cpu=_LOCAL + _COMPRESS_CPU, cuda=_LOCAL + _COMPRESS_CUDA),
    "momentum_update_error": Op(cpu=_MOMENTUM + "error out #error rows scale:f", cuda=None),
    "local_update_error": Op(cpu=_LOCAL + "error out #error rows scale:f", cuda=None),
    "momentum_source": Op(
        cpu=f"exp_avg grads {_DENOM} out np starts sizes beta alpha",
        cuda=f"exp_avg grads {_DENOM} out np {_CHUNKS} beta alpha",
        tensors="exp_avg:f32 out:f32 grad:f32s exp_avg_sq:f32",
        skip_empty=True,
    ),
    "local_source": Op(
        cpu=f"exp_avg grads {_DENOM} params acc out np starts sizes beta alpha nwd nlr precond",
        cuda=f"exp_avg grads {_DENOM} params acc out np {_CHUNKS} beta alpha nwd nlr precond",
        tensors="exp_avg:f32 exp_avg_sq:f32 out:f32 grad:f32s param:f32s acc:f32",
        skip_empty=True,
    ),
    "adam_update": Op(
        cpu=f"grads exp_avg exp_avg_sq params np starts sizes {_ADAM}",
        cuda=f"ok grads exp_avg exp_avg_sq params np {_CHUNKS} {_ADAM}",
        tensors="exp_avg:f32 exp_avg_sq:f32 grad:f32s ok:ok",
        any_device=True,
        skip_empty=True,
    ),
    "frozen_adam_update": Op(
        cpu=f"exchanged exp_avg {_DENOM} params np starts sizes nlr nlw precond",
        cuda=f"ok exchanged exp_avg {_DENOM} params np {_CHUNKS} nlr nlw precond",
        tensors="exchanged:f32r exp_avg:f32 exp_avg_sq:f32 ok:ok",
        runs=True,
        skip_empty=True,
    ),
    "lamb_frozen_update": Op(
        cpu="exchanged exp_avg exp_avg_sq dscale exp_avg_sq_fresh params update np offsets "
        f"{_LAMB} precond stats",
        cuda="ok exchanged exp_avg exp_avg_sq dscale exp_avg_sq_fresh params update np offsets "
        f"chunk_start nchunks {_LAMB} precond stats partials",
        tensors="exchanged:f32r exp_avg:f32 exp_avg_sq:f32 exp_avg_sq_fresh:f32 update:f32 "
        "param:f32s ok:ok",
        runs=True,
    ),
    "local_step": Op(
        cpu=f"grads exp_avg {_DENOM} acc params np starts sizes beta alpha wd nlr",
        cuda=None,
        tensors="exp_avg:f32 exp_avg_sq:f32 acc:f32 grad:f32s",
    ),
    "sync_update": Op(
        cpu=f"exchanged {_DENOM} floored exp_avg synced params acc np starts sizes nl precond",
        cuda=f"exchanged {_DENOM} floored exp_avg synced params acc np {_CHUNKS} inv precond",
        tensors="exchanged:f32r exp_avg_sq:f32 exp_avg:f32 synced:f32 acc:f32 floored:bool",
        runs=True,
        skip_empty=True,
    ),
    "layer_step": Op(
        cpu=None, cuda=f"update params np {_CHUNKS} alpha", tensors="update:f32 alpha:f32"
    ),
    "restore_unless": Op(
        cpu=None, cuda="ok dst src dst.bytes", tensors="dst:any src:any ok:ok", any_device=True
    ),
}

_F32, _U8 = torch.float32, torch.uint8
_DTYPES = {"f32": _F32, "f32s": _F32, "f32r": _F32, "u8": _U8, "u8c": _U8, "rows": _U8}
_CONTIGUOUS = ("f32", "f32s", "f32r", "u8c", "bool", "any")


def check(name: str, **tensors: object) -> tuple[torch.device, list[tuple[str, torch.Tensor]]]:
    """Check the tensors of a call of op ``name`` as `OPS` declares them.

    Args:
        name: the op.
        tensors: its declared tensors, by name (``None``: not given, not checked).

    Returns:
        The device of every tensor given, and the ``(name, tensor)`` pairs checked here (not
        the per-segment sequences, `SignRuns` or verdicts), for the checks of their sizes.

    Raises:
        TypeError, ValueError: a tensor of another type, dtype or layout, not contiguous, or
            on another device (the message says what to pass instead).
        RuntimeError: CUDA tensors for an op that needs CUDA kernels the build lacks.
    """
    op, named, verdicts, w = OPS[name], [], [], 0
    for arg, kind in op.kinds:
        t = tensors.pop(arg, None)
        if t is None or (kind == "f32s" and not isinstance(t, torch.Tensor)):
            continue  # per-segment tensors: checked with their segments
        if kind == "f32r" and isinstance(t, SignRuns):
            continue
        if kind == "ok":
            verdicts.append(t)
            continue
        if kind == "scale":
            check_scale(arg, t)
        elif kind == "scales":
            check_scales(arg, t, w)
        elif kind != "any":
            check_tensor(arg, t, _DTYPES.get(kind, torch.bool))
        if kind == "rows":
            check_rows(arg, t)
            w = t.size(0)
        elif kind in _CONTIGUOUS:
            check_contiguous(arg, t)
        named.append((arg, t))
    if tensors:
        raise TypeError(f"{name} declares no tensors {sorted(tensors)}")
    cuda_kernels = HAS_CUDA or not op.cuda_kernels
    device = check_device(*named, cuda_kernels=cuda_kernels, other_types=op.any_device)
    for ok in verdicts:
        check_verdict(ok, device)
    return device, named


@dataclasses.dataclass
class Table:
    """A call's per-segment arrays: host arrays for the CPU kernels, for the CUDA ones one
    int64 and one float32 array in the device's memory (`on_device`), the chunk table
    (`chunk_starts`) added.

    Args:
        sizes: each segment's (parameter's, layer's) number of values.
        pointers: int64 rows of pointers by name, one per segment (a tensor: its own;
            ``None``: 0); a row ``None`` is the address 0 (no such array).
        ints: int64 rows by name (starts, sizes, offsets).
        coefs: float32 rows by name (each Python float rounded once).
    """

    sizes: list[int]
    pointers: dict[str, Sequence[torch.Tensor | None] | None]
    ints: dict[str, Sequence[int]]
    coefs: dict[str, Sequence[float]]

    def addresses(
        self, device: torch.device, skip_empty: bool, kept: list[torch.Tensor]
    ) -> dict[str, int] | None:
        """The rows' addresses, ``np`` and on CUDA ``chunk_start`` and ``nchunks``, the arrays
        appended to ``kept`` (alive until the call has run); ``None`` when ``skip_empty`` and a
        CUDA call would have no chunks."""
        cuda, ints, offset, out = device.type == "cuda", [], {}, {"np": len(self.sizes)}
        for key, row in self.pointers.items():
            if row is None:
                out[key] = 0
            else:
                offset[key] = len(ints)
                ints += [0 if t is None else t.data_ptr() for t in row]
        for key, row in self.ints.items():
            offset[key] = len(ints)
            ints += row
        if cuda:
            chunk_start = chunk_starts(self.sizes)
            if skip_empty and chunk_start[-1] == 0:
                return None
            offset["chunk_start"], out["nchunks"] = len(ints), chunk_start[-1]
            ints += chunk_start
        meta = _array(ints, torch.int64, device)
        kept.append(meta)
        out.update({key: meta.data_ptr() + 8 * k for key, k in offset.items()})
        if self.coefs:
            coef = _array([c for row in self.coefs.values() for c in row], torch.float32, device)
            kept.append(coef)
            starts = itertools.accumulate((len(r) for r in self.coefs.values()), initial=0)
            # one start more than rows: the total
            out.update(
                {k: coef.data_ptr() + 4 * j for k, j in zip(self.coefs, starts, strict=False)}
            )
        return out


def _array(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a host array for the CPU kernels, or in CUDA memory (`on_device`)."""
    return (
        on_device(values, dtype, device)
        if device.type == "cuda"
        else torch.tensor(values, dtype=dtype)
    )


def denominator_args(denom: Denominator | None) -> dict[str, Any]:
    """A call's arguments for ``denom``: the values ``exp_avg_sq`` and ``dscale`` (``None``:
    the address 0) and, where there is no denominator, ``eps`` (the address 0; otherwise
    ``eps`` is a coefficient row, `denominator_coefs`)."""
    if denom is None:
        return {"exp_avg_sq": None, "eps": None, "dscale": None}
    return {"exp_avg_sq": denom.exp_avg_sq, "dscale": denom.dscale}


def denominator_coefs(denom: Denominator | None) -> dict[str, Sequence[float]]:
    """A call's per-segment coefficient row for ``denom``: ``eps`` (none without one)."""
    return {} if denom is None else {"eps": denom.eps}


def segment_table(
    starts: list[int],
    sizes: list[int],
    pointers: dict[str, Sequence[torch.Tensor | None] | None],
    coefs: dict[str, Sequence[float]],
) -> Table:
    """The `Table` of segments ``starts[k]:starts[k] + sizes[k]`` of the flat buffers (rows
    ``starts`` and ``sizes``), with ``pointers`` and ``coefs``."""
    return Table(sizes, pointers, {"starts": starts, "sizes": sizes}, coefs)


def param_table(
    params: list[torch.Tensor],
    starts: list[int],
    coefs: dict[str, Sequence[float]],
    pointers: bool = True,
) -> Table:
    """The `segment_table` of an update of ``params`` at ``starts`` of the flat buffers: row
    ``params`` their pointers (unless not ``pointers``, then the address 0), with ``coefs``."""
    sizes = [p.numel() for p in params]
    return segment_table(starts, sizes, {"params": params if pointers else None}, coefs)


def launch(name: str, device: torch.device, table: Table | None = None, **values: Any) -> Any:
    """Call op ``name`` on ``device``: its CPU entry with the thread count, or its CUDA entry
    with the device index (the entry's device guard) and the device's current stream.

    Args:
        name: the op (`OPS`).
        device: the device of its tensors.
        table: its per-segment arrays, if it takes any.
        values: the arguments its entry names, tensors checked by `check` (and per-segment
            tensors and sizes by the public function that calls).

    Returns:
        What the entry returns; ``None`` for a CUDA call with nothing to do.
    """
    op, cuda = OPS[name], device.type == "cuda"
    kept: list[torch.Tensor] = []  # every array the call reads, alive until it returns
    if table is not None:
        rows = table.addresses(device, op.skip_empty, kept)
        if rows is None:
            return None  # no values to update
        values.update(rows)
    args = [_arg(*arg, values, device, kept) for arg in (op.cuda_args if cuda else op.cpu_args)]
    entry = getattr(module, f"{name}_{device.type}")
    if cuda:
        return entry(device.index, *args, stream(device))
    if not op.runs:
        return entry(*args, nthreads())
    runs = next((v for v in values.values() if isinstance(v, SignRuns)), None)
    return entry(*args, nthreads(), *_runs_args(runs, kept))


def _arg(
    what: str, key: str, values: dict[str, Any], device: torch.device, kept: list[torch.Tensor]
) -> Any:
    """The entry's argument ``(what, key)`` (`_parse`), from ``values``; scratch it makes
    appended to ``kept``."""
    if what == "value":
        v = values[key]
        if isinstance(v, torch.Tensor):
            return v.data_ptr()
        return 0 if v is None or isinstance(v, SignRuns) else v
    if what == "scratch":
        kept.append(workspace(device, None if key == "ws" else 24 * max(values["nchunks"], 1)))
        return kept[-1].data_ptr()
    v = values[key]
    if what == "f":
        return 0.0 if v is None else float(v)
    if what == "#":
        return v.numel()
    if what == "bytes":
        return v.numel() * v.element_size()
    return v.size(0) if what == "rows" else v.stride(0)


def _runs_args(runs: SignRuns | None, kept: list[torch.Tensor]) -> tuple[int, ...]:
    """The CPU entries' trailing arguments for ``runs`` (``nruns, lo, hi, bits, scale``: host
    arrays appended to ``kept``; all 0 for ``None``)."""
    if runs is None:
        return (0, 0, 0, 0, 0)
    lo, hi, bits, scale = zip(*runs.runs, strict=True)
    arrays = [
        torch.tensor(lo, dtype=torch.int64),
        torch.tensor(hi, dtype=torch.int64),
        torch.tensor([b.data_ptr() for b in bits], dtype=torch.int64),
        torch.tensor(scale, dtype=torch.float32),
    ]
    kept += arrays
    return (len(lo), *(a.data_ptr() for a in arrays))
