"""``lightning-onebit probe``: will 1-bit compression speed up training on this cluster?

Start it the way the training job starts (the same nodes, processes per node and launcher)::

    torchrun --nnodes 2 --nproc-per-node 4 ... -m lightning_onebit.probe --model mypkg.models:LitGPT
    srun --ntasks-per-node 4 lightning-onebit probe --params 350e6 --step-ms 420
    lightning-onebit probe --devices 4 --model mypkg.models:LitGPT          # one machine
    MASTER_ADDR=... MASTER_PORT=... NODE_RANK=1 lightning-onebit probe --devices 4 --num-nodes 2 ...

With the job's backend (NCCL on GPUs, gloo on CPUs) every rank measures, at the same time:

* the links: ``all_reduce`` of growing sizes inside a node and between nodes (one rank per node),
  fitted as ``time = latency + bytes on the wire / bandwidth``;
* the compute: forward/backward of the model (``--model module:Class``, a LightningModule
  with ``example_input_array``) on every rank at once, several in a row, as the slowest rank's
  call when the ranks start each call together (as every training step's exchange starts them:
  with more ranks than free cores, or a straggler, every step waits for the slowest), or
  ``--step-ms`` as given;
* at the model's size: the fp32 ``all_reduce`` (DDP), the bf16 one (DDP's bf16 hook, the 1-bit
  strategies' default warmup average), the 1-bit exchange flat and in two levels, each
  overlapped with a backward as the strategies run it (the buckets before the last one during
  backward, the last after it), and the fused update kernels.

A method's predicted step time is that overlapped run plus its update: compute + the
communication left exposed + the update. It prints one row per method (step time, bytes per
step, the end-to-end time of ``--steps`` steps with ``--warmup-fraction`` of them in the
uncompressed warmup) and a recommendation (``OneBitStrategy`` options, or "stay with DDP").
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_onebit import kernels
from lightning_onebit.comm import (
    CompressedAllreduce,
    HierarchicalAllreduce,
    NodeGroups,
    fp32_allreduce_bytes,
    hierarchical_average,
    start_average,
)
from lightning_onebit.optim import OneBitAdam

__all__ = [
    "LaunchInfo",
    "ProbeError",
    "detect_launch",
    "expected_slowest",
    "main",
    "predict",
    "probe",
]

#: A method's 1-bit run must beat DDP by this much for the probe to recommend switching.
MIN_GAIN = 0.05
#: The first bucket's size (DDP's and the 1-bit overlap's first bucket cap).
FIRST_BUCKET_BYTES = 2**20
#: Bucket sizes (MiB) the recommendation chooses from.
BUCKET_CHOICES = (5.0, 25.0, 100.0)


class ProbeError(RuntimeError):
    """Bad input or an unusable launch: the message says what to do."""


# --------------------------------------------------------------------------- the launch


@dataclass
class LaunchInfo:
    """Where this process sits in the job: what the launcher said (or ``spawn``: the probe
    starts ``local_world_size`` processes itself)."""

    launcher: str
    world_size: int
    ranks_per_node: int
    node_rank: int = 0
    rank: int | None = None  # None: spawned (the local rank decides)
    local_rank: int | None = None
    master_addr: str = "127.0.0.1"
    master_port: int = 29500


def _env_int(env: dict[str, str], *names: str) -> int | None:
    for n in names:
        v = env.get(n, "")
        if v.strip().isdigit():
            return int(v)
    return None


def _slurm_tasks_per_node(env: dict[str, str]) -> int | None:
    """``SLURM_NTASKS_PER_NODE``, or the first count of ``SLURM_TASKS_PER_NODE`` (``4(x2)``)."""
    got = _env_int(env, "SLURM_NTASKS_PER_NODE")
    if got is None and env.get("SLURM_TASKS_PER_NODE"):
        head = env["SLURM_TASKS_PER_NODE"].split(",")[0].split("(")[0]
        got = int(head) if head.isdigit() else None
    return got


def detect_launch(
    devices: int | None,
    num_nodes: int = 1,
    ranks_per_node: int | None = None,
    env: dict[str, str] | None = None,
) -> LaunchInfo:
    """How this process was started: torchrun (or anything that sets ``RANK``/``WORLD_SIZE``),
    SLURM's ``srun``, Lightning's multi-node variables (``MASTER_ADDR``, ``NODE_RANK`` with
    ``--devices``/``--num-nodes``), or ``--devices N`` alone (one machine).

    Raises:
        ProbeError: no launcher environment and no ``--devices``; a world size of 1.
    """
    env = dict(os.environ if env is None else env)
    port = _env_int(env, "MASTER_PORT") or 29500
    rank, world = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
    if rank is not None and world is not None and "MASTER_ADDR" in env:
        info = LaunchInfo(
            "torchrun" if "TORCHELASTIC_RUN_ID" in env else "env",
            world,
            ranks_per_node or _env_int(env, "LOCAL_WORLD_SIZE") or 1,
            rank=rank,
            local_rank=_env_int(env, "LOCAL_RANK"),
            master_addr=env["MASTER_ADDR"],
            master_port=port,
        )
    elif _env_int(env, "SLURM_NTASKS") and "SLURM_PROCID" in env and devices is None:
        from lightning.fabric.plugins.environments import SLURMEnvironment

        per_node = ranks_per_node or _slurm_tasks_per_node(env) or 1
        info = LaunchInfo(
            "slurm",
            int(env["SLURM_NTASKS"]),
            per_node,
            rank=int(env["SLURM_PROCID"]),
            local_rank=_env_int(env, "SLURM_LOCALID"),
            master_addr=env.get("MASTER_ADDR")
            or SLURMEnvironment.resolve_root_node_address(env.get("SLURM_NODELIST", "127.0.0.1")),
            master_port=port,
        )
    elif devices is not None:
        if devices < 1 or num_nodes < 1:
            raise ProbeError(f"--devices and --num-nodes must be >= 1, got {devices}, {num_nodes}")
        node_rank = _env_int(env, "NODE_RANK", "GROUP_RANK") or 0
        if num_nodes > 1 and "MASTER_ADDR" not in env:
            raise ProbeError(
                f"--num-nodes {num_nodes} needs Lightning's environment on every node: "
                "MASTER_ADDR (node 0's address), MASTER_PORT and NODE_RANK (0..num_nodes-1), "
                "as for Trainer(num_nodes=...)"
            )
        info = LaunchInfo(
            "lightning" if num_nodes > 1 else "local",
            devices * num_nodes,
            devices,
            node_rank=node_rank,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=port if "MASTER_PORT" in env else _free_port(),
        )
    else:
        raise ProbeError(
            "no launcher environment found (RANK/WORLD_SIZE/MASTER_ADDR from torchrun, SLURM's "
            "SLURM_PROCID/SLURM_NTASKS, or Lightning's MASTER_ADDR/NODE_RANK with --devices): "
            "start the probe the way you start training, e.g. `torchrun --nproc-per-node 4 -m "
            "lightning_onebit.probe ...`, `srun lightning-onebit probe ...`, or on one machine "
            "`lightning-onebit probe --devices 4 ...`"
        )
    if info.world_size < 2:
        raise ProbeError(
            f"world size {info.world_size}: the probe compares ways of communicating between "
            "ranks and needs at least 2 (--devices 2 or more, or more nodes/processes)"
        )
    if info.world_size % info.ranks_per_node:
        raise ProbeError(
            f"{info.ranks_per_node} ranks per node do not divide the world size "
            f"{info.world_size}: pass --ranks-per-node"
        )
    return info


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- the model


def load_model_class(spec: str) -> type:
    """``module:Class`` (the current directory importable, as for ``python -m``).

    Raises:
        ProbeError: not of that form, the module does not import, or no such class.
    """
    mod_name, sep, cls_name = spec.partition(":")
    if not sep or not mod_name or not cls_name:
        raise ProbeError(f"--model {spec!r}: expected module:Class, e.g. mypkg.models:LitGPT")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except Exception as err:  # any error while importing the user's module
        raise ProbeError(
            f"--model {spec!r}: importing {mod_name!r} failed ({type(err).__name__}: {err}); "
            "run the probe from the directory your training script runs from, or install the "
            "package"
        ) from err
    obj = module
    for part in cls_name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ProbeError(f"--model {spec!r}: {mod_name!r} has no attribute {cls_name!r}")
    if not isinstance(obj, type) or not issubclass(obj, torch.nn.Module):
        raise ProbeError(f"--model {spec!r}: {cls_name!r} is not a LightningModule/nn.Module")
    return obj


def _as_args(example: Any) -> tuple[tuple, dict]:
    if isinstance(example, dict):
        return (), example
    if isinstance(example, (tuple, list)):
        return tuple(example), {}
    return (example,), {}


def _to(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


def _scalar(out: Any) -> torch.Tensor:
    """A scalar to call backward on from a forward's output (a loss, logits, a dict/tuple)."""
    if isinstance(out, dict):
        out = out.get("loss", next(iter(out.values()), None))
    if isinstance(out, (tuple, list)):
        out = next((o for o in out if isinstance(o, torch.Tensor) and o.requires_grad), None)
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        raise ProbeError(
            "the model's forward(*example_input_array) returned no tensor that requires grad: "
            "return the loss or the outputs, or pass --step-ms"
        )
    return out if out.numel() == 1 else out.float().sum()


def build_model(spec: str, kwargs: dict[str, Any], device: torch.device) -> Any:
    """The user's module on ``device`` and its ``example_input_array`` there.

    Raises:
        ProbeError: the class does not construct, or has no ``example_input_array``.
    """
    cls = load_model_class(spec)
    try:
        model = cls(**kwargs)
    except Exception as err:
        raise ProbeError(f"--model {spec!r}: {cls.__name__}(**{kwargs}) failed: {err}") from err
    example = getattr(model, "example_input_array", None)
    if example is None:
        raise ProbeError(
            f"--model {spec!r}: {cls.__name__} has no example_input_array; set "
            "self.example_input_array to one batch of inputs (one rank's batch) in __init__ so "
            "that the probe can time forward/backward, or pass --step-ms"
        )
    return model.to(device).train(), _to(example, device)


# --------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``fn`` until the slowest rank has finished (barriers before and after
    each call), the largest of the ranks' medians, on every rank."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        _sync(device)
        dist.barrier()  # the slowest rank's time
        times.append(time.perf_counter() - t0)
    return _max_over_ranks(statistics.median(times))


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _ring_wire_bytes(nbytes: int, group_size: int) -> int:
    return 2 * (group_size - 1) * nbytes // group_size


@dataclass
class Link:
    """One kind of link: ``time = latency + wire bytes / bandwidth`` fitted to timed
    ``all_reduce`` calls (``points``: bytes per call, seconds)."""

    ranks: int
    latency_s: float
    bandwidth_Bps: float
    points: list[tuple[int, float]] = field(default_factory=list)

    def time(self, wire_bytes: float, calls: int = 1) -> float:
        return calls * self.latency_s + wire_bytes / self.bandwidth_Bps


def fit_link(points: list[tuple[int, float]], group_size: int) -> Link:
    """Latency: the smallest call's time; bandwidth: the least-squares slope of time over
    wire bytes of the calls of >= 256 KiB (where the bytes, not the round trips, dominate)."""
    lat = min(t for _, t in points)
    big = [(_ring_wire_bytes(b, group_size), t) for b, t in points if b >= 2**18]
    if len(big) >= 2:
        mx = statistics.fmean(x for x, _ in big)
        my = statistics.fmean(y for _, y in big)
        sxx = sum((x - mx) ** 2 for x, _ in big)
        slope = sum((x - mx) * (y - my) for x, y in big) / sxx if sxx else 0.0
    else:
        slope = 0.0
    if slope <= 0:  # too few points, or noise: the largest call alone
        x, y = max((_ring_wire_bytes(b, group_size), t) for b, t in points)
        slope = max(y - lat, 1e-9) / max(x, 1)
    return Link(group_size, lat, 1.0 / slope, points)


def measure_link(
    group: Any, member: bool, group_size: int, device: torch.device, max_s: float, max_bytes: int
) -> Link:
    """Timed ``all_reduce`` on ``group`` (``member``: this rank takes part; the others wait at
    the barriers) from 4 KiB up, x4 each time, until a call takes ``max_s`` or ``max_bytes``."""
    points, nbytes = [], 4096
    while True:
        buf = torch.ones(nbytes // 4, device=device)
        reps = 5 if nbytes < 2**20 else 3

        def call(buf: torch.Tensor = buf) -> None:
            if member:
                dist.all_reduce(buf, group=group)

        t = _timed(call, device, reps)
        points.append((nbytes, t))
        if t >= max_s or nbytes * 4 > max_bytes:
            break
        nbytes *= 4
    return fit_link(points, group_size)


def _buckets(nbytes: int, cap_mb: float) -> list[int]:
    """Bucket sizes in the order backward completes them: the first (last layers) at most
    1 MiB, then ``cap_mb`` each, the remainder last (the strategies' and DDP's layout)."""
    out = [min(FIRST_BUCKET_BYTES, nbytes)]
    rest, cap = nbytes - out[0], max(int(cap_mb * 2**20), 4)
    while rest > 0:
        out.append(min(cap, rest))
        rest -= out[-1]
    return out


class _Compute:
    """One forward/backward of the user's model, or a stand-in of the given duration (a matmul
    loop calibrated alone): what the communication overlaps with."""

    def __init__(
        self, device: torch.device, model: Any = None, example: Any = None, seconds: float = 0.0
    ) -> None:
        self.device, self.model, self.example = device, model, example
        self.seconds, self.iters = seconds, 0
        if model is None and seconds > 0:
            self._a = torch.randn(256, 256, device=device)
            t0, n = time.perf_counter(), 0
            while time.perf_counter() - t0 < 0.05:
                self._mm(8)
                n += 8
            _sync(device)
            per = (time.perf_counter() - t0) / n
            self.iters = max(1, round(seconds / per))

    def _mm(self, k: int) -> None:
        for _ in range(k):
            self._a = torch.tanh(self._a @ self._a)

    def forward(self) -> torch.Tensor | None:
        if self.model is None:
            return None
        self.model.zero_grad(set_to_none=True)
        args, kwargs = _as_args(self.example)
        return _scalar(self.model(*args, **kwargs))

    def backward(self, loss: torch.Tensor | None) -> None:
        if loss is not None:
            loss.backward()
        elif self.iters:
            self._mm(self.iters)

    def step(self) -> None:
        self.backward(self.forward())


def _overlapped(
    compute: _Compute, comm: Callable[[slice], None], sizes: list[int]
) -> Callable[[], None]:
    """Forward + backward with ``comm`` of every bucket but the last started on a thread when
    backward starts (as the strategies' overlap and DDP do once a bucket is complete) and the
    last bucket after backward."""
    total = sum(sizes) // 4
    head = total - sizes[-1] // 4

    def on_thread(sl: slice) -> None:
        if compute.device.type == "cuda":  # (a new thread's current device is 0)
            torch.cuda.set_device(compute.device)
            # its own stream, after the work so far, as the strategies' communication thread
            stream = torch.cuda.Stream(compute.device)
            stream.wait_stream(torch.cuda.default_stream(compute.device))
            with torch.cuda.stream(stream):
                comm(sl)
            stream.synchronize()
            return
        comm(sl)

    def run() -> None:
        loss = compute.forward()
        worker = None
        if head:
            worker = threading.Thread(target=on_thread, args=(slice(0, head),))
            worker.start()
        compute.backward(loss)
        if worker is not None:
            worker.join()
        comm(slice(head, total))

    return run


def expected_slowest(times: torch.Tensor) -> float:
    """The expected largest of one value drawn from each row of ``times`` (ranks x samples),
    each row's uniformly and independently: the compute time of a step whose ranks start
    together and wait for the slowest, from each rank's own call times. Exact, not sampled:
    ``P(max <= t)`` is the product over the rows of the fraction of the row ``<= t``.

    Args:
        times: one row per rank, one column per timed call (seconds; any real dtype).

    Returns:
        The expectation, in the unit of ``times``.
    """
    times = times.to(torch.float64)
    values = times.flatten().unique(sorted=True)
    cdf = torch.ones_like(values)
    for row in times:
        cdf *= (row[None, :] <= values[:, None]).to(torch.float64).mean(1)
    pmf = torch.diff(cdf, prepend=cdf.new_zeros(1))
    return float((values * pmf).sum())


def _slowest_of_free_running(fn: Callable[[], None], device: torch.device, steps: int) -> float:
    """The expected time of the slowest rank's call when every call starts the ranks together,
    as the exchange of every training step does, from ``steps`` calls run freely in a row
    (:func:`expected_slowest` of every rank's call times).

    Timed in lockstep (a barrier around each call) the estimate would carry the barriers and
    whatever else the machine did in those few calls; run freely, each rank times its own calls
    and the ranks meet only before and after. The expectation charges a rank that is slower on
    average and the spread of the calls (with more ranks than free cores, or a straggler, some
    rank lags on every step)."""
    fn()
    _sync(device)
    dist.barrier()
    own = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        own.append(time.perf_counter() - t0)
    dist.barrier()
    times = torch.tensor(own, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        times = times.cuda()
    every = [torch.empty_like(times) for _ in range(dist.get_world_size())]
    dist.all_gather(every, times)
    return expected_slowest(torch.stack(every).cpu())


def _paired(
    compute: Callable[[], None],
    fns: dict[str, Callable[[], None]],
    device: torch.device,
    repeats: int,
    warmup: int = 1,
) -> tuple[float, dict[str, float]]:
    """The compute's time and each function's time beyond it: every round runs the compute
    and then each function, each right after a compute run, and a function's excess is the
    median of its differences from the compute run just before it (on a shared machine a slow
    spell lands on both of a pair; the difference is what the communication adds)."""
    base: list[float] = []
    excess: dict[str, list[float]] = {k: [] for k in fns}

    def once(fn: Callable[[], None]) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        _sync(device)
        dist.barrier()  # the slowest rank's time, as a training step's
        return _max_over_ranks(time.perf_counter() - t0)

    for r in range(warmup + repeats):
        for k, fn in fns.items():
            c = once(compute)
            t = once(fn)
            if r >= warmup:
                base.append(c)
                excess[k].append(t - c)
    return statistics.median(base), {k: statistics.median(v) for k, v in excess.items()}


# --------------------------------------------------------------------------- the probe


@dataclass
class Measured:
    """What every rank measured (the slowest rank's medians), the inputs of :func:`predict`."""

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

    def exchange(kind: str) -> Callable[[slice], None]:
        def run(sl: slice) -> None:
            n = sl.stop - sl.start
            if n <= 0:
                return
            key = (kind, sl.start, n)
            if key not in exchanges:  # one per bucket, built once (collectively, in order)
                exchanges[key] = (  # (double buffered, as the optimizers' exchanges)
                    CompressedAllreduce(n, device=device, double_buffered=True)
                    if kind == "flat"
                    else HierarchicalAllreduce(n, nodes, device=device, double_buffered=True)
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


def _updates(numel: int, device: torch.device, repeats: int) -> tuple[dict, dict]:
    """The optimizers' own update at ``numel`` values, without communication: torch Adam
    (DDP), 1-bit Adam's warmup step and its compression step less its exchange (both run on
    a group of this rank alone, which sends nothing); and the exchange's kernels alone."""
    w, rank = dist.get_world_size(), dist.get_rank()
    alone = [dist.new_group([r]) for r in range(w)][rank]  # (new_group: every rank, in order)
    p = torch.nn.Parameter(torch.randn(numel, device=device))
    p.grad = torch.randn_like(p) * 1e-3
    adam = torch.optim.Adam([p], lr=1e-6)
    upd = {"torch_adam": _timed(adam.step, device, repeats)}
    opt = OneBitAdam([p], lr=1e-6, freeze_step=10**9, process_group=alone, bias_correction=True)
    upd["adam_warmup"] = _timed(opt.step, device, repeats)
    opt.freeze()
    step = _timed(opt.step, device, repeats)
    x = CompressedAllreduce(numel, device=device, group=alone, double_buffered=True)
    own = _timed(lambda: x(p.grad), device, repeats)
    upd["frozen_adam"] = max(step - own, 0.0)

    n = -(-numel // (8 * w)) * 8 * w
    err, y = torch.zeros(n, device=device), torch.zeros(n, device=device)
    out = torch.empty(numel, device=device)
    bits = torch.zeros(w, n // (8 * w), dtype=torch.uint8, device=device)
    scale, scales = torch.zeros(1, device=device), torch.ones(w, device=device)
    g, m, v = p.grad, torch.zeros_like(p), torch.ones_like(p)
    kern = {
        "adam_update": _timed(
            lambda: kernels.adam_update(
                g, m, v, [p.data], [0], [1e-6], [0.9], [0.999], [1e-8], [0.0]
            ),
            device,
            repeats,
        ),
        "worker_compress": _timed(
            lambda: kernels.worker_compress(g, err, bits, scale, deferred=True, error_out=y),
            device,
            repeats,
        ),
        "decompress": _timed(lambda: kernels.decompress(bits, scales, out), device, repeats),
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
    compute = _Compute(device, model, example)
    if model is None and step_ms:
        source = "--step-ms"
        # what the communication overlaps with: backward, about 2/3 of forward + backward
        compute = _Compute(device, seconds=step_ms / 1000 * 2 / 3)

    # ---- the methods at the model's size
    nodes = None
    if nodes_n > 1 and ll > 1:
        nodes = NodeGroups(None, ll)
    methods = _comm_methods(numel, device, nodes, w)
    sizes = _buckets(4 * numel, bucket_mb)
    comm_s = {
        name: _timed(lambda fn=fn: fn(slice(0, numel)), device, repeats)
        for name, fn in methods.items()
    }
    # compute alone through the same code path (thread included), without communication
    alone = _overlapped(compute, lambda sl: None, sizes)
    _, exposed_s = _paired(
        alone,
        {name: _overlapped(compute, fn, sizes) for name, fn in methods.items()},
        device,
        repeats,
    )
    compute_s = _slowest_of_free_running(alone, device, 2 * repeats)
    if model is None and step_ms:  # the stand-in is backward only; contention on shared cores
        compute_s = step_ms / 1000 + max(0.0, compute_s - step_ms / 1000 * 2 / 3)
    update_s, kernels_s = _updates(numel, device, repeats)

    flat_x = CompressedAllreduce(numel, device=device)
    bytes_step = {
        "fp32": fp32_allreduce_bytes(numel, w),
        "bf16": fp32_allreduce_bytes(numel, w) // 2,
        "onebit": flat_x.bytes_per_call,
    }
    # per node: a ring in rank order crosses each node's link with one rank's traffic
    ring_node = fp32_allreduce_bytes(numel, w) if nodes_n > 1 else 0
    bytes_node = {
        "fp32": ring_node,
        "bf16": ring_node // 2,
        "onebit": ll * flat_x.inter_node_bytes_per_call(ll) if nodes_n > 1 else 0,
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


# --------------------------------------------------------------------------- the prediction


#: method -> (name shown, warmup communication, compression communication, update per phase)
_PLANS = {
    "ddp": ("DDP (fp32 allreduce)", "fp32", "fp32", ("torch_adam", "torch_adam")),
    "ddp_bf16": ("DDP + bf16 hook", "bf16", "bf16", ("torch_adam", "torch_adam")),
    "onebit": ("1-bit flat", "fp32", "onebit", ("adam_warmup", "frozen_adam")),
    "onebit_bf16": (
        "1-bit flat, bf16 warmup",
        "bf16",
        "onebit",
        ("adam_warmup", "frozen_adam"),
    ),
    "onebit_hier": (
        "1-bit two-level",
        "fp32_hier",
        "onebit_hier",
        ("adam_warmup", "frozen_adam"),
    ),
    "onebit_hier_bf16": (
        "1-bit two-level, bf16 warmup",
        "bf16_hier",
        "onebit_hier",
        ("adam_warmup", "frozen_adam"),
    ),
}


def _bucket_penalty(m: Measured, comm: str, cap_mb: float) -> float:
    """Extra seconds of ``cap_mb`` buckets over the measured ones: the round trips of more
    calls, and the last bucket, which waits for backward's end (fewer, larger buckets leave
    more exposed), as far as the measured run hid the other buckets behind backward."""
    link = m.links.get("inter") or m.links.get("intra")
    if link is None:
        return 0.0
    calls = 2 if comm.startswith("onebit") else 1  # the exchange: all_to_all + all_gather
    size = 4 * m.numel
    mine, base = _buckets(size, cap_mb), _buckets(size, m.bucket_mb)
    extra_calls = (len(mine) - len(base)) * calls * link.latency_s
    t = m.comm_s[comm]
    hideable = t * (1 - base[-1] / size)  # all buckets but the last, of the measured run
    hidden = min(max((t - m.exposed_s[comm]) / hideable, 0.0), 1.0) if hideable > 0 else 0.0
    extra_tail = hidden * t * (mine[-1] - base[-1]) / size
    return max(extra_calls + extra_tail, -t)


def predict(m: Measured, steps: int, warmup_fraction: float) -> dict[str, Any]:
    """Per method: the predicted step time of each phase (compute + exposed communication +
    update), bytes per step, the run's end-to-end time; and the recommendation."""
    warm_steps = round(steps * warmup_fraction)
    rows: dict[str, dict[str, Any]] = {}
    for key, (label, c_warm, c_comp, (u_warm, u_comp)) in _PLANS.items():
        if c_warm not in m.comm_s or c_comp not in m.comm_s:
            continue
        phase = {}
        for ph, comm, upd in (("warmup", c_warm, u_warm), ("compression", c_comp, u_comp)):
            exposed = max(0.0, m.exposed_s[comm])
            phase[ph] = {
                "step_s": m.compute_s + exposed + m.update_s[upd],
                "compute_s": m.compute_s,
                "comm_exposed_s": exposed,
                "comm_alone_s": m.comm_s[comm],
                "update_s": m.update_s[upd],
                "bytes": m.bytes_step[comm],
                "bytes_node": m.bytes_node[comm],
            }
        if key.startswith("ddp"):
            run_s = steps * phase["compression"]["step_s"]
            total_bytes = steps * phase["compression"]["bytes"]
        else:
            run_s = (
                warm_steps * phase["warmup"]["step_s"]
                + (steps - warm_steps) * phase["compression"]["step_s"]
            )
            total_bytes = (
                warm_steps * phase["warmup"]["bytes"]
                + (steps - warm_steps) * phase["compression"]["bytes"]
            )
        rows[key] = {"label": label, **phase, "run_s": run_s, "run_bytes": total_bytes}
    ddp = rows["ddp"]["run_s"]
    onebit = {k: r for k, r in rows.items() if k.startswith("onebit")}
    best = min(onebit, key=lambda k: onebit[k]["run_s"])
    rec: dict[str, Any] = {"baseline_run_s": ddp}
    if onebit[best]["run_s"] > (1 - MIN_GAIN) * ddp:
        bf16 = rows["ddp_bf16"]["run_s"]
        rec.update(
            choice="stay with DDP",
            why=(
                f"the best 1-bit option ({onebit[best]['label']}) would take "
                f"{onebit[best]['run_s'] / ddp:.2f}x DDP's time: the step is set by compute, "
                f"not the network (DDP's communication left exposed: "
                f"{rows['ddp']['compression']['comm_exposed_s'] * 1e3:.0f} ms of "
                f"{rows['ddp']['compression']['step_s'] * 1e3:.0f} ms)"
            ),
            run_s=ddp,
            speedup=1.0,
        )
        if bf16 < (1 - MIN_GAIN) * ddp:
            rec["why"] += f"; DDP's bf16 compress hook would take {bf16 / ddp:.2f}x"
        return {"methods": rows, "recommendation": rec}
    comm = _PLANS[best][2]
    bucket = min(BUCKET_CHOICES, key=lambda b: _bucket_penalty(m, comm, b))
    gain = _bucket_penalty(m, comm, bucket) - _bucket_penalty(m, comm, m.bucket_mb)
    options = {
        "algorithm": "onebit_adam",
        "hierarchical": best.startswith("onebit_hier"),
        "average_dtype": "bf16" if best.endswith("_bf16") else "float32",
        "overlap_bucket_mb": bucket if gain < 0 else m.bucket_mb,
    }
    rec.update(
        choice="OneBitStrategy",
        options=options,
        run_s=onebit[best]["run_s"],
        speedup=ddp / onebit[best]["run_s"],
        step_speedup=rows["ddp"]["compression"]["step_s"] / onebit[best]["compression"]["step_s"],
        method=best,
    )
    return {"methods": rows, "recommendation": rec}


# --------------------------------------------------------------------------- reporting


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 10 else f"{x:.1f} s"


def report(m: Measured, pred: dict[str, Any], steps: int, warmup_fraction: float) -> str:
    """The console report: what was measured, one row per method, the recommendation."""
    nodes = m.world_size // m.ranks_per_node
    out = [
        f"lightning-onebit probe: {m.world_size} ranks ({nodes} node(s) x {m.ranks_per_node}), "
        f"{m.backend} on {m.device}, {m.numel:,} parameters ({_si(4 * m.numel, 'B')} fp32)",
        "links (timed all_reduce, fit: time = latency + wire bytes / bandwidth):",
    ]
    names = {"intra": "inside a node", "inter": "between nodes (one rank per node)"}
    for k, link in m.links.items():
        out.append(
            f"  {names[k]:<34} latency {_ms(link.latency_s)}, bandwidth "
            f"{_si(link.bandwidth_Bps, 'B/s')} ({_si(8 * link.bandwidth_Bps, 'bit/s')}), "
            f"{len(link.points)} sizes up to {_si(link.points[-1][0], 'B')}"
        )
    comp = _ms(m.compute_s) if m.compute_s else "not given (pass --model or --step-ms)"
    out.append(f"compute: forward+backward {comp} ({m.compute_source})")
    out.append(
        "kernels at this size: "
        + ", ".join(f"{k} {_ms(v)}" for k, v in m.kernels_s.items())
        + f"; torch Adam {_ms(m.update_s['torch_adam'])}"
    )
    out.append(
        "communication alone at this size: "
        + ", ".join(f"{k} {_ms(v)}" for k, v in m.comm_s.items())
    )
    w = round(steps * warmup_fraction)
    out += [
        "",
        f"{'method':<30} {'warmup step':>12} {'1-bit step':>12} {'exposed comm':>13} "
        f"{'MB/step':>14} {f'run of {steps} ({w} warmup)':>24}",
    ]
    for r in pred["methods"].values():
        wu, cp = r["warmup"], r["compression"]
        mb = (
            f"{cp['bytes'] / 1e6:.3g}"
            if wu["bytes"] == cp["bytes"]
            else f"{wu['bytes'] / 1e6:.3g}/{cp['bytes'] / 1e6:.3g}"
        )
        out.append(
            f"{r['label']:<30} {_ms(wu['step_s']):>12} {_ms(cp['step_s']):>12} "
            f"{_ms(cp['comm_exposed_s']):>13} {mb:>14} {_ms(r['run_s']):>24}"
        )
    rec = pred["recommendation"]
    out.append("")
    if rec["choice"] == "stay with DDP":
        out.append(f"recommendation: stay with DDP: {rec['why']}")
    else:
        opts = ", ".join(f"{k}={v!r}" for k, v in rec["options"].items())
        out.append(
            f"recommendation: OneBitStrategy({opts}): predicted {rec['step_speedup']:.2f}x "
            f"DDP's step in the 1-bit phase, {rec['speedup']:.2f}x over the run "
            f"({_ms(rec['baseline_run_s'])} -> {_ms(rec['run_s'])})"
        )
    return "\n".join(out)


# --------------------------------------------------------------------------- entry points


def _parse(argv: list[str] | None) -> argparse.Namespace:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(
        prog="lightning-onebit probe",
        description=doc.split("\n\n")[0],
        epilog=doc.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    size = p.add_argument_group("the model (one of)")
    size.add_argument("--params", type=float, help="number of trained parameters (e.g. 350e6)")
    size.add_argument(
        "--model",
        help="module:Class of a LightningModule with example_input_array (one rank's batch)",
    )
    p.add_argument("--model-kwargs", default="{}", help="JSON keyword arguments for --model")
    p.add_argument("--step-ms", type=float, help="forward+backward milliseconds per step")
    p.add_argument("--steps", type=int, default=10000, help="the run's optimizer steps")
    p.add_argument(
        "--warmup-fraction", type=float, default=0.2, help="fraction of steps in the warmup"
    )
    p.add_argument("--bucket-mb", type=float, default=25.0, help="overlap bucket size (MiB)")
    p.add_argument("--devices", type=int, help="processes per node to start (no launcher)")
    p.add_argument("--num-nodes", type=int, default=1, help="with --devices: nodes")
    p.add_argument("--ranks-per-node", type=int, help="override the launcher's ranks per node")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per measurement")
    p.add_argument("--timeout", type=float, default=600, help="collective timeout (s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    a = p.parse_args(argv)
    if a.params is not None and a.params < 1:
        p.error("--params must be >= 1")
    if a.params is None and a.model is None:
        p.error("pass --params N or --model module:Class (the model's size)")
    if not 0 <= a.warmup_fraction < 1:
        p.error("--warmup-fraction must be in [0, 1)")
    if a.steps < 1 or a.repeats < 1 or a.bucket_mb <= 0:
        p.error("--steps, --repeats and --bucket-mb must be positive")
    if a.step_ms is not None and a.step_ms < 0:
        p.error("--step-ms must be >= 0")
    try:
        a.model_kwargs = json.loads(a.model_kwargs)
    except json.JSONDecodeError as err:
        p.error(f"--model-kwargs is not JSON: {err}")
    return a


def _rank_main(local_rank: int, a: argparse.Namespace, info: LaunchInfo) -> None:
    """One rank: join the group, probe, rank 0 prints."""
    rank = info.rank if info.rank is not None else info.node_rank * info.ranks_per_node + local_rank
    local = info.local_rank if info.local_rank is not None else rank % info.ranks_per_node
    use_cuda = a.backend == "nccl" or (a.backend == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", local % torch.cuda.device_count()) if use_cuda else None
    if device is not None:
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", info.master_addr)
    os.environ.setdefault("MASTER_PORT", str(info.master_port))
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        rank=rank,
        world_size=info.world_size,
        timeout=timedelta(seconds=a.timeout),
    )
    try:
        m = probe(
            info,
            numel=int(a.params) if a.params else None,
            model_spec=a.model,
            model_kwargs=a.model_kwargs,
            step_ms=a.step_ms,
            bucket_mb=a.bucket_mb,
            repeats=a.repeats,
            device=device,
        )
        if rank == 0:
            pred = predict(m, a.steps, a.warmup_fraction)
            if a.json:
                print(json.dumps({"measured": asdict(m), **pred}, default=float))
            else:
                print(report(m, pred, a.steps, a.warmup_fraction), flush=True)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """``python -m lightning_onebit.probe``; returns the exit status (2: bad input)."""
    a = _parse(argv)
    try:
        info = detect_launch(a.devices, a.num_nodes, a.ranks_per_node)
        if a.model:
            load_model_class(a.model)  # import errors now, before any process starts
        if info.rank is not None:
            _rank_main(0, a, info)
        else:
            import torch.multiprocessing as mp

            mp.start_processes(
                _rank_main, args=(a, info), nprocs=info.ranks_per_node, start_method="spawn"
            )
    except ProbeError as err:
        print(f"lightning-onebit probe: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # a spawned rank's failure: its message, not the traceback
        msg = str(err)
        if "ProbeError" in msg:
            tail = msg.rsplit("ProbeError:", 1)[-1].strip()
            print(f"lightning-onebit probe: error: {tail}", file=sys.stderr)
            return 2
        raise
    return 0


def cli() -> int:
    """The ``lightning-onebit`` console script: ``lightning-onebit probe ...``."""
    argv = sys.argv[1:]
    if not argv or argv[0] != "probe":
        print(
            "usage: lightning-onebit probe [--help] ...\n"
            "  probe   predict 1-bit compression's speedup on this cluster (measures the links,\n"
            "          the model's compute and every method at its size)",
            file=sys.stderr,
        )
        return 2
    return main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
