"""The fused 1-bit kernels (``lightning_onebit._C``, C++ and CUDA) and their pure-torch twins.

Layers, each importing only the ones before it:

- `checks`: argument checks (dtype, device, sizes, contiguity), each raising a
  ``TypeError``/``ValueError`` that says what to pass instead; `runs`:
  [SignRuns][lightning_onebit.kernels.SignRuns], an exchange's result where it lies; and
  `denominator`: [Denominator][lightning_onebit.kernels.Denominator], the frozen variance's
  ``sqrt(v) + eps`` that the kernels compute as they read ``v``;
- `native`: the compiled module, its ops declared in one table (``native.OPS``: each entry's
  arguments and the tensors to check), one check of a call's tensors and one launcher that takes
  their pointers and adds the device and its current stream (CUDA) or the thread count (CPU);
- `reference`: the ``reference_*`` twins, pure torch, the same arguments and results; the tests
  compare every kernel with its twin, and they are the path taken when the compiled module is
  missing (with a warning);
- the public functions, each checking its arguments, then running the compiled kernel (or the
  twin): `sources` (what the exchange sends, computed as the compression reads it),
  `compression` (the exchange's worker, server and decompression kernels), `quantized` (the
  integer codec of a compressed average: 4 or 8 bits, a scale per block) and `updates` (the
  optimizers' fused steps).

The optimizers and the exchanges take what they need from this package's names alone, among
them [on_device][lightning_onebit.kernels.on_device] (a small host array in device memory
without a host synchronisation) and [use_native][lightning_onebit.kernels.use_native] (whether
the compiled module runs).

Wire format (shared by CPU and CUDA, so ranks on different hardware interoperate): a chunk of
``m`` values (``m % 8 == 0``) packs into ``m // 8`` bytes; value ``k`` is bit ``k % 8`` of byte
``k // 8``, least-significant bit first (``numpy.packbits(bitorder="little")``). The bit is 1
iff the value is ``>= 0``: +0.0 and -0.0 both encode +1, NaN encodes -1. ``W`` chunks are the
rows of a ``(W, m // 8)`` uint8 tensor whose rows may be strided (views into larger records).
"""

from __future__ import annotations

from lightning_onebit.kernels.compression import (
    decode_runs,
    decompress,
    server_reduce,
    worker_compress,
    worker_update_error,
)
from lightning_onebit.kernels.denominator import Denominator
from lightning_onebit.kernels.native import HAS_CPP, HAS_CUDA, on_device, use_native
from lightning_onebit.kernels.quantized import (
    check_codec,
    dequantize,
    quantize,
    quantized_reduce,
    row_bytes,
)
from lightning_onebit.kernels.reference import (
    finish_pending,
    reference_adam_update,
    reference_decompress,
    reference_dequantize,
    reference_frozen_adam_update,
    reference_lamb_frozen_update,
    reference_layer_step,
    reference_local_source,
    reference_local_step,
    reference_momentum_source,
    reference_quantize,
    reference_quantized_reduce,
    reference_restore_unless,
    reference_server_reduce,
    reference_sync_update,
    reference_worker_compress,
    reference_worker_update_error,
)
from lightning_onebit.kernels.runs import SignRuns
from lightning_onebit.kernels.sources import (
    ExchangeSource,
    LocalSource,
    MomentumSource,
    TensorSource,
    local_source,
    momentum_source,
)
from lightning_onebit.kernels.updates import (
    adam_update,
    frozen_adam_update,
    lamb_frozen_update,
    layer_step,
    local_step,
    reads_sign_runs,
    restore_unless,
    sync_update,
)

__all__ = [
    "HAS_CPP",
    "HAS_CUDA",
    "Denominator",
    "ExchangeSource",
    "LocalSource",
    "MomentumSource",
    "SignRuns",
    "TensorSource",
    "adam_update",
    "check_codec",
    "decode_runs",
    "decompress",
    "dequantize",
    "finish_pending",
    "frozen_adam_update",
    "lamb_frozen_update",
    "layer_step",
    "local_source",
    "local_step",
    "momentum_source",
    "on_device",
    "quantize",
    "quantized_reduce",
    "reads_sign_runs",
    "reference_adam_update",
    "reference_decompress",
    "reference_dequantize",
    "reference_frozen_adam_update",
    "reference_lamb_frozen_update",
    "reference_layer_step",
    "reference_local_source",
    "reference_local_step",
    "reference_momentum_source",
    "reference_quantize",
    "reference_quantized_reduce",
    "reference_restore_unless",
    "reference_server_reduce",
    "reference_sync_update",
    "reference_worker_compress",
    "reference_worker_update_error",
    "restore_unless",
    "row_bytes",
    "server_reduce",
    "sync_update",
    "use_native",
    "worker_compress",
    "worker_update_error",
]
