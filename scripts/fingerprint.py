"""Numerics fingerprint: one hash per optimizer configuration, identical before and after any
change that must not change the numbers (restructuring, renaming, moving code).

    python scripts/fingerprint.py                          # print the cases and their hashes
    python scripts/fingerprint.py --out fp.txt             # ... and write them to fp.txt
    python scripts/fingerprint.py --compare benchmarks/results/fingerprint.txt
    python scripts/fingerprint.py --cases 'zero_one_adam/*/overlap/*'   # a subset (fnmatch)

Each case trains a small MLP (fixed seed, fixed synthetic batches per rank) for ``STEPS`` steps
with one optimizer used directly on real gloo ranks (forked processes, one torch thread each,
started by the tests' launcher ``tests.helpers.dist.run_distributed``):

* algorithm: ``onebit_adam``, ``zero_one_adam``, ``onebit_lamb``, each configured so that 12 steps
  reach the compression phase (and 0/1 Adam's 1-bit gradient steps and local steps);
* options: ``default`` (the constructor's defaults), ``deepspeed`` (``variance_floor=0``,
  ``preconditioned_exchange=False``, 1-bit LAMB's ``trust_ratio="fresh_variance"``: DeepSpeed's
  arithmetic), ``groups`` (``bias_correction=True``
  and two param groups: weights with ``weight_decay``, biases without, at another ``lr``);
* ``in_step`` or ``overlap`` (``overlap_with_backward`` with buckets small enough for several);
* topology: ``w1``, ``w2`` (flat exchange) and ``2x2`` (``hierarchical=True``: 2 nodes of 2 ranks).

A case's hash is the first 16 hex digits of a sha256 over the bytes of every parameter and of
every tensor in rank 0's ``optimizer.state_dict()`` (moments, the exchange's error buffers, ...)
after the last step, each with its state-dict path, dtype and shape. Every rank must end with
bitwise the same parameters (the last step is a synchronisation for 0/1 Adam): the script fails
if not. ``--compare FILE`` exits with status 1 and lists the cases whose hash differs from FILE's.
"""

from __future__ import annotations

import os

# before torch: one OpenMP thread per rank (reductions over threads could change the bits, and
# GNU OpenMP is not fork-safe once the parent has used a thread pool)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import fnmatch
import hashlib
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests.helpers` (the rank launcher)

from lightning_onebit.optim import OneBitAdam, OneBitLamb, OneBitOptimizer, ZeroOneAdam
from tests.helpers.dist import run_distributed

STEPS = 12
LR = 1e-2
#: how long the overlap's communication thread waits for a bucket's exchange
TIMEOUT = timedelta(seconds=120)
#: overlap buckets of about 1 KiB: one per layer (and a group's last bucket may be smaller)
BUCKET_CAP_MB = 0.001

ALGORITHMS: dict[str, Callable[..., OneBitOptimizer]] = {
    "onebit_adam": lambda groups, **kw: OneBitAdam(groups, lr=LR, freeze_step=4, **kw),
    # variance steps 1, 2, 4 and a 1-bit gradient step 3; local phase from step 5, syncs every
    # step, then every 2nd, then every 4th (steps 9-11 local, 12 a sync)
    "zero_one_adam": lambda groups, **kw: ZeroOneAdam(
        groups,
        lr=LR,
        var_freeze_step=4,
        var_update_scaler=1,
        local_step_scaler=2,
        local_step_clipper=4,
        **kw,
    ),
    "onebit_lamb": lambda groups, **kw: OneBitLamb(
        groups, lr=LR, freeze_step=4, weight_decay=0.01, **kw
    ),
}
OPTION_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "deepspeed": {"variance_floor": 0.0, "preconditioned_exchange": False},
    "groups": {"bias_correction": True},  # (and two param groups: see _param_groups)
    # (1-bit Adam, 0/1 Adam) rescale_variance, all-reduced every RESCALE_INTERVAL steps
    "rescaled": {"bias_correction": True, "rescale_variance": True},
}
#: ``rescale_interval`` in the ``rescaled`` cases: several all-reduces in 8 compression steps
RESCALE_INTERVAL = 2
OVERLAP = ("in_step", "overlap")
#: topology name -> (world size, ranks per node for the two-level exchange or None: flat)
TOPOLOGIES: dict[str, tuple[int, int | None]] = {"w1": (1, None), "w2": (2, None), "2x2": (4, 2)}


def case_names(topology: str) -> Iterator[str]:
    for algo in ALGORITHMS:
        for options in OPTION_SETS:
            if options == "rescaled" and algo == "onebit_lamb":
                continue  # (not an option of 1-bit LAMB)
            for overlap in OVERLAP:
                yield f"{algo}/{options}/{overlap}/{topology}"


# --------------------------------------------------------------------------- one case


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 48),
        torch.nn.Tanh(),
        torch.nn.Linear(48, 48),
        torch.nn.Tanh(),
        torch.nn.Linear(48, 8),
    )


def _batch(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + t)
    x = torch.randn(32, 16, generator=gen)
    x[:, -2:] = 0  # dead inputs: weights with zero gradients, whose variance variance_floor raises
    return x, torch.randint(0, 8, (32,), generator=gen)


def _param_groups(model: torch.nn.Module, options: str) -> list[dict[str, Any]]:
    if options != "groups":
        return [{"params": list(model.parameters())}]
    weights = [p for p in model.parameters() if p.dim() > 1]
    biases = [p for p in model.parameters() if p.dim() == 1]
    return [
        {"params": weights, "weight_decay": 0.05},
        {"params": biases, "weight_decay": 0.0, "lr": LR / 2},
    ]


def _tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a (nested) state dict, with its path, in sorted-key order."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _tensors(obj[key], f"{path}/{key}")
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from _tensors(item, f"{path}/{i}")


def _digest(h: Any, name: str, t: torch.Tensor) -> None:
    t = t.detach().cpu().contiguous()
    h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def _run_case(rank: int, name: str, ranks_per_node: int | None) -> tuple[str, str]:
    """Train one case on this rank; return (hash of params + state, hash of params)."""
    algo, options, overlap, _ = name.split("/")
    model = _model()
    kw = dict(OPTION_SETS[options])
    if options == "deepspeed" and algo == "onebit_lamb":
        kw["trust_ratio"] = "fresh_variance"  # (DeepSpeed's; not an option of the Adams)
    if ranks_per_node is not None:
        kw.update(hierarchical=True, ranks_per_node=ranks_per_node)
    opt = ALGORITHMS[algo](_param_groups(model, options), **kw)
    if options == "rescaled":
        opt.rescale_interval = RESCALE_INTERVAL
    if overlap == "overlap":
        opt.overlap_with_backward(BUCKET_CAP_MB, timeout=TIMEOUT)
    syncs = []  # 0/1 Adam: whether each step communicated (the others: always)
    for t in range(1, STEPS + 1):
        x, y = _batch(rank, t)
        syncs.append(not isinstance(opt, ZeroOneAdam) or opt.next_step_syncs)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    if ranks_per_node is not None and opt.node_groups() is None:
        raise RuntimeError(f"{name}: the two-level exchange is not in use")
    if options == "rescaled" and opt.rescale.updates < 2:
        raise RuntimeError(f"{name}: rescale_variance all-reduced fewer than twice")
    buckets = len(getattr(opt.flat.exchange, "buckets", [None]))
    if overlap == "overlap" and buckets < 3:
        raise RuntimeError(f"{name}: the overlap made {buckets} bucket(s); lower BUCKET_CAP_MB")
    if all(syncs) != (algo != "zero_one_adam") or not syncs[-1]:
        # (0/1 Adam must take local steps, and the last step must sync so that ranks agree)
        raise RuntimeError(f"{name}: no local steps, or the last step was not a synchronisation")
    state = opt.state_dict()
    opt.overlap_with_backward(None)  # (its thread and process group go)
    params = hashlib.sha256()
    for i, p in enumerate(model.parameters()):
        _digest(params, f"param/{i}", p)
    full = params.copy()
    for path, t in _tensors(state):
        _digest(full, f"state{path}", t)
    return full.hexdigest()[:16], params.hexdigest()


def _worker(rank: int, world: int, ranks_per_node: int | None, names: list[str]) -> dict:
    with warnings.catch_warnings():  # (young-variance warnings and the like: not the numbers)
        warnings.simplefilter("ignore")
        return {name: _run_case(rank, name, ranks_per_node) for name in names}


def fingerprint(pattern: str = "*") -> list[str]:
    """Run the cases whose names match ``pattern``; return one ``name hash`` line per case."""
    lines = []
    for topology, (world, ranks_per_node) in TOPOLOGIES.items():
        names = [n for n in case_names(topology) if fnmatch.fnmatchcase(n, pattern)]
        if not names:
            continue
        results = run_distributed(_worker, world, ranks_per_node, names, timeout=600)
        for name in names:
            full, params = results[0][name]
            differ = [r for r in range(1, world) if results[r][name][1] != params]
            if differ:
                raise RuntimeError(f"{name}: rank(s) {differ} end with other parameters than 0")
            lines.append(f"{name} {full}")
    return lines


def _read(path: str) -> dict[str, str]:
    with open(path) as f:
        return dict(line.split() for line in f if line.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the lines to this file")
    parser.add_argument("--compare", help="exit 1, listing the cases whose hash differs from it")
    parser.add_argument("--cases", default="*", help="only the cases matching this fnmatch pattern")
    args = parser.parse_args(argv)
    start = time.monotonic()
    lines = fingerprint(args.cases)
    if not lines:
        parser.error(f"no case matches {args.cases!r}")
    for line in lines:
        print(line, flush=True)
    print(f"# {len(lines)} cases in {time.monotonic() - start:.0f} s", file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    if args.compare:
        want = _read(args.compare)
        got = dict(line.split() for line in lines)
        differ = [n for n in got if want.get(n) != got[n]]
        if args.cases == "*":
            differ += [n for n in want if n not in got]
        for name in differ:
            was, now = want.get(name, "missing"), got.get(name, "missing")
            print(f"differs: {name} {was} -> {now}", file=sys.stderr)
        if differ:
            print(f"{len(differ)} of {len(got)} cases differ from {args.compare}", file=sys.stderr)
            return 1
        print(f"all {len(got)} cases match {args.compare}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
