"""Where a compression step's CPU time goes: each stage of the 1-bit optimizers' step, timed
inside real multi-process steps over gloo, next to torch Adam's step and a plain copy.

    python benchmarks/step_profile.py [--params 19024896] [--world 2] [--steps 12]
        [--algorithms onebit_adam,zero_one_adam,onebit_lamb] [--pin] [--materialize]
        [--decode] [--local-interval N] [--weight-decay W [--gather-params]] [--json FILE]

Every rank builds the same synthetic model (``--tensors`` parameters of ``--params`` values in
all), random local gradients, and an optimizer that switches to its compression phase after the
first step; then ``--steps`` compression steps are timed. Each stage (the kernels, the torch
sweeps of the optimizer, the collectives, the Python around them) is wrapped for the timed steps
only and charged its *exclusive* time: wall (``perf_counter``) and this thread's CPU time
(``thread_time``, which other processes on the machine do not inflate). *rest* is the step's
time outside every wrapped stage (Python, bookkeeping, unwrapped torch ops; from the
steps' means, the stages being means too). Bytes per value: the fp32 traffic a
stage cannot avoid, so *GB/s* compares with the copy row (a copy moves 8 bytes per value).

``--materialize`` runs the exchange source of 1-bit Adam, 1-bit LAMB and 0/1 Adam's sync steps
as a build without the fused compression would (the
:class:`~lightning_onebit.kernels.ExchangeSource` computed into its buffer, then compressed from
there): the two paths side by side, the same floats. ``--decode`` decodes the exchange's
result into a buffer before 1-bit Adam's and 1-bit LAMB's update reads it (the path of masked,
CUDA and two-level runs) instead of the update reading the exchange's records
(:class:`~lightning_onebit.kernels.SignRuns`): the same floats too. ``--weight-decay`` gives
every optimizer that decoupled weight decay (torch's: AdamW); ``--gather-params`` then copies
the parameters into the flat parameter buffer for the decay terms of 1-bit LAMB's update and
0/1 Adam's sync-step source instead of the kernels reading each where it lies: the same floats.

The numbers are rank 0's (stages: means over the timed steps; steps: medians); *step (slowest rank)* is the median of
the slowest rank's step wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: stages: (where, attribute, label, fp32 bytes per value it must move or None)
_STAGES: list[tuple[str, str, str, float | None]] = [
    ("lightning_onebit.optim._flat:FlatState", "gather_grads", "gather grads", 8),
    ("lightning_onebit.optim._flat:FlatState", "params", "params for decay", None),
    ("lightning_onebit.optim.onebit_adam:OneBitAdam", "_exchange_source", "exchange source", 16),
    ("lightning_onebit.optim.zero_one_adam:ZeroOneAdam", "_exchange_source", "exchange source", 8),
    ("lightning_onebit.optim.onebit_lamb:OneBitLamb", "_exchange_source", "exchange source", 12),
    ("lightning_onebit.kernels", "momentum_source", "source kernel", 16),
    ("lightning_onebit.kernels", "local_source", "source kernel", 20),
    ("lightning_onebit.kernels", "worker_compress", "worker compress", 12),
    ("lightning_onebit.kernels.native_sources", "momentum_compress", "source + compress", 20),
    ("lightning_onebit.kernels.native_sources", "local_compress", "source + compress", 20),
    ("lightning_onebit.kernels", "worker_update_error", "worker error", 12),
    ("torch.distributed", "all_to_all_single", "all_to_all", None),
    ("lightning_onebit.kernels", "server_reduce", "server reduce", None),
    ("lightning_onebit.comm.handle:ExchangeHandle", "wait", "all_gather wait", None),
    ("lightning_onebit.comm.handle:ExchangeHandle", "runs", "all_gather wait", None),
    ("lightning_onebit.kernels", "decompress", "decompress", 4),
    ("lightning_onebit.kernels", "restore_unless", "restore_unless", None),
    ("lightning_onebit.kernels", "frozen_adam_update", "fused update", 20),
    ("lightning_onebit.kernels", "lamb_frozen_update", "fused update", None),
    ("lightning_onebit.optim._ops", "decoupled_update_", "update (torch)", 20),
    ("lightning_onebit.optim._rescale:VarianceRescale", "accumulate_", "rescale variance", None),
    ("lightning_onebit.optim.zero_one_adam:ZeroOneAdam", "_synchronize_", "sync (rest)", None),
    ("lightning_onebit.kernels", "sync_update", "sync kernel", None),
    ("lightning_onebit.kernels", "local_step", "local step kernel", 32),
    ("lightning_onebit.optim._divergence:DivergenceWatch", "check", "divergence check", None),
]


class _Clock:
    """Exclusive wall and CPU time per label, for wrapped callables that may nest."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.stack: list[list[float]] = []  # per open call: children's wall, children's cpu
        self.on = False

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            self.stack.append([0.0, 0.0])
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                w, c = time.perf_counter() - w0, time.thread_time() - c0
                child_w, child_c = self.stack.pop()
                self.wall[label] += w - child_w
                self.cpu[label] += c - child_c
                self.calls[label] += 1
                if self.stack:
                    self.stack[-1][0] += w
                    self.stack[-1][1] += c

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed


def _resolve(where: str) -> Any:
    module, _, cls = where.partition(":")
    obj = __import__(module, fromlist=["_"])
    return getattr(obj, cls) if cls else obj


def _instrument(clock: _Clock) -> None:
    """Wrap every stage where the package looks it up: on its class, and on every package
    module that imported the function by name."""
    for where, attr, label, _ in _STAGES:
        owner = _resolve(where)
        fn = getattr(owner, attr, None)
        if fn is None:
            continue
        wrapped = clock.wrap(label, fn)
        setattr(owner, attr, wrapped)
        if ":" in where:
            continue
        for name, mod in list(sys.modules.items()):
            if name.startswith("lightning_onebit") and getattr(mod, attr, None) is fn:
                setattr(mod, attr, wrapped)


def _model(n: int, tensors: int) -> list[torch.nn.Parameter]:
    """``tensors`` parameters of ``n`` values in all: a few large matrices and small vectors,
    as a transformer's (each eighth tensor a bias-sized one)."""
    small = max(1, n // (tensors * 200))
    n_small = tensors // 8
    big = (n - small * n_small) // (tensors - n_small)
    sizes = [small if j % 8 == 7 else big for j in range(tensors)]
    sizes[0] += n - sum(sizes)
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in sizes]


def _optimizer(
    name: str, params: list[torch.nn.Parameter], weight_decay: float = 0.0
) -> torch.optim.Optimizer:
    from lightning_onebit.optim import OneBitAdam, OneBitLamb, ZeroOneAdam

    wd = {"weight_decay": weight_decay}
    if name == "torch_adam":
        if weight_decay:
            return torch.optim.AdamW(params, lr=1e-4, **wd)
        return torch.optim.Adam(params, lr=1e-4)
    if name == "onebit_adam":
        return OneBitAdam(params, lr=1e-4, freeze_step=1, bias_correction=True, **wd)
    if name == "zero_one_adam":
        return ZeroOneAdam(params, lr=1e-4, var_freeze_step=1, bias_correction=True, **wd)
    if name == "onebit_lamb":
        return OneBitLamb(params, lr=1e-3, freeze_step=1, bias_correction=True, **wd)
    raise ValueError(f"unknown algorithm {name!r}")


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.pin:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if args.materialize:
        from lightning_onebit.kernels import ExchangeSource

        ExchangeSource.computed_as_read = property(lambda self: False)  # type: ignore[method-assign]
    if args.decode:
        from lightning_onebit.comm import BucketedAllreduce, CompressedAllreduce

        for cls in (CompressedAllreduce, BucketedAllreduce):
            cls.returns_runs = property(lambda self: False)  # type: ignore[method-assign,assignment]
    if args.gather_params:
        from lightning_onebit.optim._flat import FlatState

        def gathered(self: Any, only: list[int]) -> list[torch.Tensor]:
            views, params = self.views["param"], self.layout.params
            return [views[j].copy_(params[j]) for j in only]

        FlatState.params = gathered  # type: ignore[method-assign]
    clock = _Clock()
    _instrument(clock)
    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(1 + rank)
    for name in ["torch_adam", *args.algorithms]:
        params = _model(args.params, args.tensors)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        opt = _optimizer(name, params, args.weight_decay)
        if name == "zero_one_adam":
            opt.local_step_interval = args.local_interval
        for _ in range(2):  # the warmup step, the first compression step (buffers built)
            opt.step()
        clock.wall.clear(), clock.cpu.clear(), clock.calls.clear()
        walls, cpus = [], []
        for _ in range(args.steps):
            dist.barrier()
            clock.on = True
            w0, c0 = time.perf_counter(), time.thread_time()
            opt.step()
            walls.append(time.perf_counter() - w0)
            cpus.append(time.thread_time() - c0)
            clock.on = False
        out[name] = {
            "step_wall": walls,
            "step_cpu": cpus,
            "stages": {
                k: (clock.wall[k] / args.steps, clock.cpu[k] / args.steps, clock.calls[k])
                for k in clock.wall
            },
        }
        if hasattr(opt, "close"):
            opt.close()
    a, b = torch.randn(args.params), torch.empty(args.params)
    copies = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        b.copy_(a)
        copies.append(time.perf_counter() - t0)
    out["copy"] = statistics.median(copies[1:])
    q.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--params", type=int, default=19_024_896, help="values (default: `base`)")
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--algorithms", default="onebit_adam,zero_one_adam,onebit_lamb")
    p.add_argument("--pin", action="store_true", help="rank r on core r mod #cores")
    p.add_argument(
        "--materialize",
        action="store_true",
        help="compute the exchange source into its buffer, then compress it (two sweeps)",
    )
    p.add_argument(
        "--decode",
        action="store_true",
        help="decode the exchange's result into a buffer before the update reads it",
    )
    p.add_argument(
        "--local-interval",
        type=int,
        default=1,
        help="0/1 Adam's local_step_interval: 1 (default) every timed step is a sync step; "
        "larger, a sync step every that many steps (e.g. 1000000: local steps only)",
    )
    p.add_argument(
        "--weight-decay",
        type=float,
        default=0.0,
        help="decoupled weight decay for every optimizer (torch's: AdamW)",
    )
    p.add_argument(
        "--gather-params",
        action="store_true",
        help="copy the parameters into the flat buffer for the decay terms",
    )
    p.add_argument("--json", help="write the raw numbers here")
    args = p.parse_args(argv)
    args.algorithms = [a for a in args.algorithms.split(",") if a]
    if args.gather_params and not args.weight_decay:
        p.error("--gather-params needs --weight-decay (without decay no parameter is read)")

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, args.world, port, args, q)) for r in range(args.world)
    ]
    for proc in procs:
        proc.start()
    results = dict(q.get() for _ in procs)
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise SystemExit(f"a rank exited with {proc.exitcode}")

    n, r0 = args.params, results[0]
    copy_gbs = 8 * n / r0["copy"] / 1e9
    print(
        f"# step profile · {args.world} ranks (gloo) · {n:,} values in {args.tensors} tensors · "
        f"{args.threads} thread(s)/rank · {os.cpu_count()} CPUs · torch {torch.__version__} · "
        f"{'pinned' if args.pin else 'not pinned'} · {args.steps} compression steps"
        f"{' · source materialized' if args.materialize else ''}"
        f"{' · result decoded before the update' if args.decode else ''}"
        f"{f' · weight decay {args.weight_decay}' if args.weight_decay else ''}"
        f"{' · parameters copied for the decay terms' if args.gather_params else ''}"
        f"{f' · 0/1 Adam local_step_interval {args.local_interval}' if args.local_interval > 1 else ''}\n"
    )
    print(f"copy of {n:,} fp32 values: {r0['copy'] * 1e3:.1f} ms ({copy_gbs:.1f} GB/s)\n")
    bytes_of = {label: b for _, _, label, b in _STAGES}
    for name in ["torch_adam", *args.algorithms]:
        res = r0[name]
        slow = [max(results[r][name]["step_wall"][i] for r in results) for i in range(args.steps)]
        step_w, step_c = statistics.median(slow), statistics.median(res["step_cpu"])
        print(f"## {name}: step {step_w * 1e3:.1f} ms (slowest rank), CPU {step_c * 1e3:.1f} ms\n")
        print("| stage | calls/step | wall ms | CPU ms | share of CPU | GB/s |")
        print("|---|---:|---:|---:|---:|---:|")
        stages = res["stages"]
        for label, (w, c, calls) in sorted(stages.items(), key=lambda kv: -kv[1][1]):
            b = bytes_of.get(label)
            gbs = f"{b * n / w / 1e9:.1f}" if b and w > 0 else ""
            print(
                f"| {label} | {calls / args.steps:g} | {w * 1e3:.1f} | {c * 1e3:.1f} | "
                f"{c / step_c:.0%} | {gbs} |"
            )
        rest_w = statistics.mean(res["step_wall"]) - sum(v[0] for v in stages.values())
        rest_c = statistics.mean(res["step_cpu"]) - sum(v[1] for v in stages.values())
        print(f"| rest | | {rest_w * 1e3:.1f} | {rest_c * 1e3:.1f} | {rest_c / step_c:.0%} | |\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
