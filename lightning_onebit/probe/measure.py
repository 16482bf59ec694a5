"""The measurements on every rank: the links, the compute, each method's communication alone
and overlapped with backward, the updates and kernels, and the bytes each method sends."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_onebit import kernels
from lightning_onebit.comm import (
    CompressedAllreduce,
    HierarchicalAllreduce,
    NodeGroups,
    QuantizedAllreduce,
    fp32_allreduce_bytes,
    hierarchical_average,
    start_average,
)
from lightning_onebit.optim import OneBitAdam
from lightning_onebit.probe.launch import LaunchInfo, ProbeError
from lightning_onebit.probe.timing import (
    Link,
    buckets,
    measure_link,
    paired,
    slowest_of_free_running,
    timed,
)
from lightning_onebit.probe.workload import Compute, build_model, overlapped

__all__ = ["Measured", "probe"]


@dataclass
class Measured:
    """What every rank measured (the slowest rank's medians), the inputs of ``predict``."""

    world_size: int
    ranks_per_node: int
    backend: str
    device: str
    numel: int
    compute_s: float  # forward + backward
    compute_source: str
    links: dict[str, Link]
    comm_s: dict[str, float]  # each method's communication alone, at the model's size
    exposed_s: dict[str, float]  # what it adds to forward + backward, overlapped in buckets
    update_s: dict[str, float]  # the optimizer's update after the communication
    kernels_s: dict[str, float]
    bytes_step: dict[str, int]
    bytes_node: dict[str, int]  # per node and step, what leaves the node
    bucket_mb: float


def _comm_methods(
    numel: int, device: torch.device, nodes: Any, world: int
) -> dict[str, Callable[[slice], None]]:
    """Each method's communication of a slice of the flat fp32 buffer (persistent buffers,
    as the strategies keep them)."""
    flat = torch.randn(numel, device=device)
    methods: dict[str, Callable[[slice], None]] = {}

    def fp32(sl: slice) -> None:
        start_average(flat[sl], torch.float32)()

    def bf16(sl: slice) -> None:
        start_average(flat[sl], torch.bfloat16)()

    methods["fp32"], methods["bf16"] = fp32, bf16
    exchanges: dict[tuple[str, int, int], Any] = {}

    def coded(bits: int) -> Callable[[slice], None]:
        def run(sl: slice) -> None:  # one exchange per bucket, as the optimizers overlap it
            n = sl.stop - sl.start
            if n <= 0:
                return
            key = (f"int{bits}", sl.start, n)
            if key not in exchanges:
                exchanges[key] = QuantizedAllreduce(n, device, bits=bits)
            ex = exchanges[key]  # the gradients gathered into its layout, averaged there
            ex.segment_views()[0].copy_(flat[sl])
            ex.average_in_place()

        return run

    # int8: the int4 warmup's variance window
    methods["int4"], methods["int8"] = coded(4), coded(8)

    def exchange(kind: str) -> Callable[[slice], None]:
        def run(sl: slice) -> None:
            n = sl.stop - sl.start
            if n <= 0:
                return
            key = (kind, sl.start, n)
            if key not in exchanges:  # one per bucket, built once (collectively, in order)
                exchanges[key] = (  # error buffers as the optimizers keep them (_error_sets)
                    CompressedAllreduce(n, device=device, **_error_sets(device))
                    if kind == "flat"
                    else HierarchicalAllreduce(n, nodes, device=device, **_error_sets(device))
                )
            exchanges[key](flat[sl])

        return run

    methods["onebit"] = exchange("flat")
    if nodes is not None:
        methods["onebit_hier"] = exchange("hier")

        def fp32_hier(sl: slice) -> None:
            part = flat[sl]
            if part.numel():
                hierarchical_average(part, torch.float32, nodes)

        def bf16_hier(sl: slice) -> None:
            part = flat[sl]
            if part.numel():
                hierarchical_average(part, torch.bfloat16, nodes)

        methods["fp32_hier"], methods["bf16_hier"] = fp32_hier, bf16_hier
    return methods


def _error_sets(device: torch.device) -> dict[str, bool]:
    """The error buffers of the optimizers' exchange on ``device``: one worker error buffer on
    the CPU (updated by a second sweep after the verdict), two on a GPU (the verdict stays
    there), as ``FlatState.fit_exchange`` builds them."""
    gpu = device.type != "cpu"
    return {"double_buffered": gpu, "recompute_error": not gpu}


def _updates(numel: int, device: torch.device, repeats: int) -> tuple[dict, dict]:
    """The optimizers' own update at ``numel`` values, without communication: torch Adam
    (DDP), 1-bit Adam's warmup step and its compression step less its exchange (both run on
    a group of this rank alone, which sends nothing); and the exchange's kernels alone."""
    w, rank = dist.get_world_size(), dist.get_rank()
    alone = [dist.new_group([r]) for r in range(w)][rank]  # new_group: every rank, in order
    p = torch.nn.Parameter(torch.randn(numel, device=device))
    p.grad = torch.randn_like(p) * 1e-3
    adam = torch.optim.Adam([p], lr=1e-6)
    upd = {"torch_adam": timed(adam.step, device, repeats)}
    opt = OneBitAdam([p], lr=1e-6, freeze_step=10**9, process_group=alone, bias_correction=True)
    upd["adam_warmup"] = timed(opt.step, device, repeats)
    opt.freeze()
    step = timed(opt.step, device, repeats)
    x = CompressedAllreduce(numel, device=device, group=alone, **_error_sets(device))
    own = timed(lambda: x(p.grad), device, repeats)
    upd["frozen_adam"] = max(step - own, 0.0)

    n = -(-numel // (8 * w)) * 8 * w
    err, y = torch.zeros(n, device=device), torch.zeros(n, device=device)
    out = torch.empty(numel, device=device)
    bits = torch.zeros(w, n // (8 * w), dtype=torch.uint8, device=device)
    scale, scales = torch.zeros(1, device=device), torch.ones(w, device=device)
    g, m, v = p.grad, torch.zeros_like(p), torch.ones_like(p)
    kern = {
        "adam_update": timed(
            lambda: kernels.adam_update(
                g, m, v, [p.data], [0], [1e-6], [0.9], [0.999], [1e-8], [0.0]
            ),
            device,
            repeats,
        ),
        "worker_compress": timed(
            lambda: kernels.worker_compress(g, err, bits, scale, deferred=True, error_out=y),
            device,
            repeats,
        ),
        "decompress": timed(lambda: kernels.decompress(bits, scales, out), device, repeats),
    }
    return upd, kern


def probe(
    info: LaunchInfo,
    *,
    numel: int | None,
    model_spec: str | None = None,
    model_kwargs: dict[str, Any] | None = None,
    step_ms: float | None = None,
    bucket_mb: float = 25.0,
    repeats: int = 5,
    max_link_s: float = 0.25,
    device: torch.device | None = None,
) -> Measured:
    """Measure on this rank (the process group is up; every rank calls this); return the
    slowest rank's numbers, the same on every rank."""
    w, ll = dist.get_world_size(), info.ranks_per_node
    rank = dist.get_rank()
    nodes_n = w // ll
    device = device or torch.device("cpu")

    # ---- links: one rank per node between nodes; the ranks of a node inside it
    links: dict[str, Link] = {}
    groups_intra = [dist.new_group(list(range(k * ll, (k + 1) * ll))) for k in range(nodes_n)]
    inter = dist.new_group(list(range(0, w, ll))) if nodes_n > 1 else None
    max_bytes = 64 * 2**20
    if ll > 1:
        links["intra"] = measure_link(
            groups_intra[rank // ll], True, ll, device, max_link_s, max_bytes
        )
    if inter is not None:
        links["inter"] = measure_link(inter, rank % ll == 0, nodes_n, device, max_link_s, max_bytes)

    # ---- compute
    model, example, source = None, None, "none"
    if model_spec:
        model, example = build_model(model_spec, model_kwargs or {}, device)
        n_model = sum(p.numel() for p in model.parameters() if p.requires_grad)
        numel = numel or n_model
        source = f"{model_spec}: timed on every rank at once, the slowest rank's expected time"
    if not numel:
        raise ProbeError("pass --params N or --model module:Class (the model's size)")
    compute = Compute(device, model, example)
    if model is None and step_ms:
        source = "--step-ms"
        # what the communication overlaps with: backward, about 2/3 of forward + backward
        compute = Compute(device, seconds=step_ms / 1000 * 2 / 3)

    # ---- the methods at the model's size
    nodes = None
    if nodes_n > 1 and ll > 1:
        nodes = NodeGroups(None, ll)
    methods = _comm_methods(numel, device, nodes, w)
    sizes = buckets(4 * numel, bucket_mb)
    comm_s = {
        name: timed(lambda fn=fn: fn(slice(0, numel)), device, repeats)
        for name, fn in methods.items()
    }
    # compute alone through the same code path (thread included), without communication
    alone = overlapped(compute, lambda sl: None, sizes)
    _, exposed_s = paired(
        alone,
        {name: overlapped(compute, fn, sizes) for name, fn in methods.items()},
        device,
        repeats,
    )
    compute_s = slowest_of_free_running(alone, device, 2 * repeats)
    if model is None and step_ms:  # the stand-in is backward only; contention on shared cores
        compute_s = step_ms / 1000 + max(0.0, compute_s - step_ms / 1000 * 2 / 3)
    update_s, kernels_s = _updates(numel, device, repeats)

    flat_x = CompressedAllreduce(numel, device=device)
    coded_b = {b: QuantizedAllreduce(numel, device, bits=b).bytes_per_call for b in (4, 8)}
    bytes_step = {
        "fp32": fp32_allreduce_bytes(numel, w),
        "bf16": fp32_allreduce_bytes(numel, w) // 2,
        "onebit": flat_x.bytes_per_call,
        "int4": coded_b[4],
        "int8": coded_b[8],
    }
    # per node: a ring in rank order crosses each node's link with one rank's traffic; the
    # coded average's records to the ranks of other nodes leave it
    ring_node = fp32_allreduce_bytes(numel, w) if nodes_n > 1 else 0
    bytes_node = {
        "fp32": ring_node,
        "bf16": ring_node // 2,
        "onebit": ll * flat_x.inter_node_bytes_per_call(ll) if nodes_n > 1 else 0,
        **{f"int{b}": ll * coded_b[b] * (w - ll) // (w - 1) if nodes_n > 1 else 0 for b in (4, 8)},
    }
    if nodes is not None:
        hx = HierarchicalAllreduce(numel, nodes, device=device)
        bytes_step["onebit_hier"] = hx.bytes_per_call
        bytes_node["onebit_hier"] = ll * hx.inter.bytes_per_call
        shard = -(-numel // ll)
        for dt, name in ((4, "fp32_hier"), (2, "bf16_hier")):
            intra = 2 * (ll - 1) * shard * dt
            inter_b = fp32_allreduce_bytes(shard, nodes_n) * dt // 4
            bytes_step[name] = intra + inter_b
            bytes_node[name] = ll * inter_b
        nodes.close()
    return Measured(
        world_size=w,
        ranks_per_node=ll,
        backend=dist.get_backend(),
        device=str(device),
        numel=numel,
        compute_s=compute_s,
        compute_source=source,
        links=links,
        comm_s=comm_s,
        exposed_s=exposed_s,
        update_s=update_s,
        kernels_s=kernels_s,
        bytes_step=bytes_step,
        bytes_node=bytes_node,
        bucket_mb=bucket_mb,
    )
