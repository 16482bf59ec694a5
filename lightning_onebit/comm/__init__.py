"""The error-compensated 1-bit exchanges over ``torch.distributed``, in layers that each import
only the ones before them:

- [`base`][lightning_onebit.comm.base]: the [`Exchange`][lightning_onebit.comm.base.Exchange] and
[`Handle`][lightning_onebit.comm.base.Handle] interfaces every
  exchange implements, the NaN/Inf error, the full-precision average, byte formulas;
- [`handle`][lightning_onebit.comm.handle]:
[`ExchangeHandle`][lightning_onebit.comm.handle.ExchangeHandle], a flat call in flight;
- [`flat`][lightning_onebit.comm.flat]:
[`CompressedAllreduce`][lightning_onebit.comm.flat.CompressedAllreduce], the exchange over one group
  (the algorithm and its wire format);
- [`hierarchical`][lightning_onebit.comm.hierarchical]:
[`HierarchicalAllreduce`][lightning_onebit.comm.hierarchical.HierarchicalAllreduce], full precision
  inside a node and 1 bit between nodes, over
  [`NodeGroups`][lightning_onebit.comm.hierarchical.NodeGroups];
- [`factory`][lightning_onebit.comm.factory]:
[`make_exchange`][lightning_onebit.comm.factory.make_exchange], which picks one of the two;
- [`quantized`][lightning_onebit.comm.quantized]:
[`QuantizedAllreduce`][lightning_onebit.comm.quantized.QuantizedAllreduce], an average in 4- or
  8-bit integer codes with both sides' errors fed back (for averages that must stay close to
  exact);
- [`bucketed`][lightning_onebit.comm.bucketed]:
[`BucketedAllreduce`][lightning_onebit.comm.bucketed.BucketedAllreduce], one exchange per bucket
  of a flat buffer (started during backward).
"""

from __future__ import annotations

from lightning_onebit.comm.base import (
    AVERAGE_DTYPES,
    CODED_BITS,
    Exchange,
    Handle,
    NonFiniteError,
    all_finite,
    as_average_dtype,
    fp32_allreduce_bytes,
    new_group,
    start_average,
)
from lightning_onebit.comm.bucketed import BucketedAllreduce
from lightning_onebit.comm.factory import make_exchange
from lightning_onebit.comm.flat import CompressedAllreduce
from lightning_onebit.comm.handle import Compressed, ExchangeHandle
from lightning_onebit.comm.hierarchical import (
    HierarchicalAllreduce,
    NodeGroups,
    average_bytes,
    hierarchical_average,
    resolve_ranks_per_node,
)
from lightning_onebit.comm.quantized import QuantizedAllreduce

# tracebacks and reprs name the public path: ``lightning_onebit.comm.NonFiniteError``
NonFiniteError.__module__ = __name__

__all__ = [
    "AVERAGE_DTYPES",
    "CODED_BITS",
    "BucketedAllreduce",
    "Compressed",
    "CompressedAllreduce",
    "Exchange",
    "ExchangeHandle",
    "Handle",
    "HierarchicalAllreduce",
    "NodeGroups",
    "NonFiniteError",
    "QuantizedAllreduce",
    "all_finite",
    "as_average_dtype",
    "average_bytes",
    "fp32_allreduce_bytes",
    "hierarchical_average",
    "make_exchange",
    "new_group",
    "resolve_ranks_per_node",
    "start_average",
]
