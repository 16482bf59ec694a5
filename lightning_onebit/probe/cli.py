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
  strategies' warmup average in two levels and on CUDA), the int4 warmup (their default on
  one level on the CPU), the 1-bit exchange flat and in two levels, each
  overlapped with a backward as the strategies run it (the buckets before the last one during
  backward, the last after it), and the fused update kernels.

A method's predicted step time is that overlapped run plus its update: compute + the
communication left exposed + the update. It prints one row per method (step time, bytes per
step, the end-to-end time of ``--steps`` steps with ``--warmup-fraction`` of them in the
uncompressed warmup) and a recommendation (``OneBitStrategy`` options, or "stay with DDP").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_onebit.probe.launch import LaunchInfo, ProbeError, detect_launch
from lightning_onebit.probe.measure import probe
from lightning_onebit.probe.recommend import predict
from lightning_onebit.probe.report import report
from lightning_onebit.probe.workload import load_model_class

__all__ = ["cli", "main"]


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
