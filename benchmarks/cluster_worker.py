"""One rank of the emulated-cluster benchmark: a plain ``torch.distributed`` (gloo) training loop.

Started by ``benchmarks/cluster.py`` inside a rank's network namespace, one process per rank:

    ip netns exec NS env MASTER_ADDR=... MASTER_PORT=... RANK=r WORLD_SIZE=W \\
        GLOO_SOCKET_IFNAME=veth0 python benchmarks/cluster_worker.py --config JSON --out FILE

The default is a plain loop (a dozen lines), so the step time is the model, the optimizer and
the communication, nothing else; ``pl_<method>`` runs the same training through
``L.Trainer(strategy=...)`` as users do, to measure what Lightning adds. Every rank writes one JSON file with, per step,
its start / end-of-backward / end timestamps (``time.monotonic()``, one clock for every process
on the machine, network namespaces included), the phase, the bytes the method says it sent, and the bytes the
interface says it sent (``/sys/class/net/<if>/statistics/tx_bytes``: ``ip netns exec`` mounts
the namespace's own sysfs). The orchestrator turns these into "time until the slowest rank
finishes" per step, without a barrier inside the timed region.

Methods (``--config`` key ``method``):

* ``nocomm``: every rank steps torch Adam on its local gradient, no collective: the floor.
* ``nocomm_sync``: ``nocomm`` with a one-value all-reduce before each step: the floor with the
  wait for the slowest rank that every collective brings (not run by default).
* ``ddp_adam``: DDP (fp32 allreduce, overlapped with backward) + torch Adam.
* ``ddp_fp16``: DDP with ``default_hooks.fp16_compress_hook`` + torch Adam.
* ``powersgd_r1`` / ``powersgd_r4``: DDP with ``powerSGD_hook`` (rank 1 / 4) + torch Adam.
  One bucket larger than the model: with several buckets gloo aborts with "collective
  mismatch" at W = 4. Compression starts after the same warmup as the 1-bit methods.
* ``onebit_adam`` / ``zero_one_adam`` / ``onebit_lamb``: ``lightning_onebit.optim``
  optimizers without a DDP wrapper (they average warmup gradients themselves and exchange
  1-bit momentum / gradients afterwards), with the options ``OneBitStrategy`` gives the
  optimizer it builds from a torch Adam for the same run (``bias_correction``,
  ``rescale_variance``, ...; 0/1 Adam's ``local_step_scaler`` stays DeepSpeed's, which the
  strategy sets from the run's length), ``freeze_step`` = the warmup; with ``overlap_mb``
  (``--overlap-mb``, default 25) the exchange runs bucket by bucket during backward
  (``optimizer.overlap_with_backward``); ``<method>_sync`` (e.g. ``onebit_adam_sync``) exchanges
  in ``step()`` after backward instead, for comparison; ``<method>_hier`` (e.g.
  ``onebit_adam_hier``) exchanges in two levels (``hierarchical=True``: full precision inside a
  node of ``LOCAL_WORLD_SIZE`` ranks, 1 bit between nodes). ``average_dtype`` (``--average-dtype``)
  is the dtype of their warmup average. 0/1 Adam's ``var_freeze_step`` (``--var-freeze-step``,
  default the warmup) ends its phase 1, which averages every step in full precision (the
  strategy's default); with ``var_update_scaler`` (``--var-update-scaler``) it is the paper's
  phase 1: full-precision variance updates, their interval doubling after every
  ``var_update_scaler`` of them, and 1-bit gradients between them.
* ``pl_ddp_adam`` / ``pl_onebit_adam`` / ``pl_zero_one_adam`` / ``pl_onebit_lamb``: the same
  through ``L.Trainer``: Lightning's ``DDPStrategy`` + Adam, or ``OneBitStrategy(algorithm=...,
  freeze_step=warmup, overlap_bucket_mb=overlap_mb)`` converting ``configure_optimizers``' Adam.
* ``fabric_ddp_adam`` / ``fabric_onebit_adam`` / ``fabric_zero_one_adam`` /
  ``fabric_onebit_lamb``: the plain loop through ``L.Fabric``: Fabric's ``DDPStrategy`` + Adam,
  or ``OneBitFabricStrategy`` (the same options) converting the Adam given to ``fabric.setup``.

The model is a small GPT-style character-level LM (:class:`GPT`) trained on the Python standard
library's source text; ``--model-source examples`` (:func:`build`) trains ``examples/gpt.py``'s
model on its ``TextDataModule`` instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "build", "load_corpus", "main"]

ONEBIT_METHODS = ("onebit_adam", "zero_one_adam", "onebit_lamb")
#: torch Adam on each rank's local gradient: the floor, and the floor that synchronises per step
FLOOR_METHODS = ("nocomm", "nocomm_sync")
DDP_METHODS = ("ddp_adam", "ddp_fp16", "powersgd_r1", "powersgd_r4")
#: ``pl_<method>`` trains through ``L.Trainer`` (see :func:`_fit_lightning`)
LIGHTNING_PREFIX = "pl_"
#: ``fabric_<method>`` trains through ``L.Fabric`` (see :func:`_fit_fabric`)
FABRIC_PREFIX = "fabric_"


# --------------------------------------------------------------------------- model


class _Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(n_embd)
        # no qkv bias: the key bias has a zero gradient (softmax ignores a shift shared by all
        # keys), so v = 0 there and a 1-bit exchange, which cannot send zeros, blows it up
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.fc_out = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)  # 3 x (B, T, C)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, C/H)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A nanoGPT-style decoder: token + position embeddings, pre-LN blocks, tied output head."""

    def __init__(self, vocab: int, block: int, n_layer: int, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block, n_embd)
        self.blocks = nn.ModuleList(_Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)
        self.head.weight = self.wte.weight  # weight tying
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = (
                    0.02 / math.sqrt(2 * n_layer)
                    if name.endswith(("proj.weight", "fc_out.weight"))
                    else 0.02
                )
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))  # (B, T, C)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class _WithLoss(nn.Module):
    """``forward(idx, targets) -> loss`` around a module that returns logits (B, T, V)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(idx).flatten(0, 1), targets.flatten())


def build(cfg: dict[str, Any]) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The benchmark's model (``forward(idx, targets) -> loss``) and its train/val token ids.

    ``cfg["model_source"]``: ``"builtin"`` is :class:`GPT` on :func:`load_corpus`;
    ``"examples"`` is ``examples/gpt.py``'s ``GPT`` (a LightningModule, used here as a plain
    module: only its ``forward``) on its ``TextDataModule``'s tokens. Both use the same preset
    sizes and the same sampling of windows below.
    """
    m, seed = cfg["model"], cfg.get("seed", 0)
    max_bytes = cfg.get("corpus_bytes", 2_000_000)
    if cfg.get("model_source") == "examples":
        from examples.gpt import GPT as ExampleGPT
        from examples.gpt import TextDataModule

        dm = TextDataModule(block_size=m["block"], max_bytes=max_bytes)
        torch.manual_seed(seed)  # identical initial weights on every rank
        model = ExampleGPT(
            vocab_size=dm.vocab_size,
            block_size=m["block"],
            n_layer=m["n_layer"],
            n_head=m["n_head"],
            n_embd=m["n_embd"],
        )
        return _WithLoss(model), dm.train_tokens.long(), dm.val_tokens.long()
    tokens, vocab = load_corpus(max_bytes)
    torch.manual_seed(seed)
    model = GPT(vocab, m["block"], m["n_layer"], m["n_embd"], m["n_head"])
    n_val = max(len(tokens) // 10, 4 * (m["block"] + 1))
    return model, tokens[:-n_val], tokens[-n_val:]


# --------------------------------------------------------------------------- data


def load_corpus(max_bytes: int) -> tuple[torch.Tensor, int]:
    """Token ids and vocabulary size of the standard library's top-level ``.py`` files, in
    sorted order (deterministic for a given Python), at most ``max_bytes`` of them.

    The vocabulary is the bytes that occur (about 100): an embedding row that never sees a
    gradient has ``v = 0``, and a 1-bit exchange (which cannot send a zero) would move it by
    ``m / eps``.
    """
    stdlib = Path(os.__file__).resolve().parent
    chunks, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    raw = torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()
    vocab, ids = torch.unique(raw, return_inverse=True)
    return ids, len(vocab)


def _batch(
    tokens: torch.Tensor, offsets: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    idx = offsets[:, None] + torch.arange(block + 1)  # (B, T+1)
    w = tokens[idx]
    return w[:, :-1], w[:, 1:]


# --------------------------------------------------------------------------- methods


class _HookBytes:
    """Bytes this rank sends through a DDP comm hook: the ring-allreduce volume ``2 (W-1)/W *
    bytes`` of every tensor the hook hands to ``dist.all_reduce`` (PowerSGD: P, Q, the tensors it
    leaves uncompressed, the whole bucket on its vanilla steps; fp16: the half-precision bucket).

    Counted where the hook communicates rather than re-derived from its rules: the re-derivation
    missed PowerSGD's vanilla steps. The hooks look ``torch.distributed.all_reduce`` up at each
    call, from autograd's thread and from future callbacks, hence the wrapper and the lock.
    """

    def __init__(self, world: int) -> None:
        self.world, self._bytes, self._lock = world, 0, threading.Lock()
        all_reduce = dist.all_reduce

        def counting_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self._bytes += tensor.numel() * tensor.element_size()
            return all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = counting_all_reduce

    def sent(self) -> int:
        """Bytes sent so far (ring allreduce over the world group, which the hooks use)."""
        return 2 * (self.world - 1) * self._bytes // self.world


class _SyncedAdam(torch.optim.Adam):
    """torch Adam whose step first all-reduces one value: every rank waits for the slowest, as
    with any collective, but nothing else is sent."""

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        dist.all_reduce(torch.zeros(1))
        return super().step(closure)


def _build_method(
    name: str, model: nn.Module, cfg: dict[str, Any], world: int
) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, int] | _HookBytes]:
    """Return (module to call, optimizer, bytes per step by phase or the hook's byte counter)."""
    lr, warmup = cfg["lr"], cfg["warmup"]
    betas = tuple(cfg.get("betas", (0.9, 0.999)))
    numel = sum(p.numel() for p in model.parameters())
    fp32 = 2 * (world - 1) * 4 * numel // world
    if name in FLOOR_METHODS:
        cls = torch.optim.Adam if name == "nocomm" else _SyncedAdam
        return model, cls(model.parameters(), lr=lr, betas=betas), {"warmup": 0, "compression": 0}
    # <1-bit method>_hier: the two-level exchange (nodes of LOCAL_WORLD_SIZE ranks);
    # <1-bit method>_sync: the exchange after backward instead of during it
    hier = name.endswith("_hier") and name[:-5] in ONEBIT_METHODS
    name = name.removesuffix("_hier") if hier else name
    sync = name.endswith("_sync")
    name = name.removesuffix("_sync") if sync and name[:-5] in ONEBIT_METHODS else name
    if name in ONEBIT_METHODS:
        from lightning_onebit import OneBitStrategy
        from lightning_onebit.optim import OneBitAdam, OneBitLamb, ZeroOneAdam

        # what OneBitStrategy builds from a torch Adam (the pl_ methods, the same options),
        # averaging the warmup itself (no DDP here) and in one or two levels as asked
        lr = cfg.get("lr_lamb", lr) if name == "onebit_lamb" else lr
        options = OneBitStrategy(**_strategy_options(cfg, name)).options
        kw = options.optimizer_kwargs({"lr": lr, "betas": betas})
        kw.update(average_warmup_grads=True, hierarchical=hier)
        cls = {"onebit_adam": OneBitAdam, "zero_one_adam": ZeroOneAdam}.get(name, OneBitLamb)
        opt = cls(model.parameters(), **kw)
        opt.switch_step = options.freeze_step
        if cfg.get("overlap_mb") and not sync:  # exchange bucket by bucket during backward
            opt.overlap_with_backward(
                cfg["overlap_mb"], timeout=timedelta(seconds=cfg.get("timeout", 600))
            )
        return model, opt, {}  # the optimizer counts its own bytes
    if name not in DDP_METHODS:
        raise ValueError(f"unknown method {name!r}")
    from torch.nn.parallel import DistributedDataParallel as DDP

    if name.startswith("powersgd"):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        # one bucket larger than the model: several buckets abort on gloo at W = 4
        size_mb = 4 * numel / 2**20
        ddp = DDP(model, bucket_cap_mb=size_mb + 1)
        rank = int(name.rsplit("_r", 1)[1])
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=rank,
            # vanilla allreduce on the warmup steps: the hook's iter counts from 0, so steps
            # 1..warmup are iters 0..warmup-1 and step warmup+1 compresses, as the 1-bit methods
            start_powerSGD_iter=max(2, warmup),
            random_seed=0,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        bytes_: dict[str, int] | _HookBytes = _HookBytes(world)
    else:
        ddp = DDP(model, bucket_cap_mb=cfg.get("bucket_cap_mb"))
        # no hook: DDP's C++ reducer allreduces every fp32 gradient once, out of Python's sight
        bytes_ = {"warmup": fp32, "compression": fp32}
        if name == "ddp_fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            bytes_ = _HookBytes(world)
    return ddp, torch.optim.Adam(model.parameters(), lr=lr, betas=betas), bytes_


# --------------------------------------------------------------------------- the loop


def _tx_bytes(ifname: str | None) -> int:
    if not ifname:
        return 0
    try:
        return int(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text())
    except OSError:
        return 0


def lr_factor(cfg: dict[str, Any]) -> Callable[[int], float] | None:
    """The LR multiplier per scheduler step of ``cfg["lr_schedule"]``, or None (constant).

    ``cosine``: linear from 1/(``lr_warmup`` + 1) to 1 over the first ``lr_warmup`` steps,
    then a half cosine down to 0.1 at the last step, as GPT recipes train.
    """
    if cfg.get("lr_schedule", "constant") == "constant":
        return None
    steps, warm = cfg["steps"], cfg.get("lr_warmup", 0)

    def factor(k: int) -> float:  # k: optimizer steps taken so far
        if k < warm:
            return (k + 1) / (warm + 1)
        done = min(1.0, (k - warm) / max(1, steps - 1 - warm))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * done))

    return factor


def _scheduler(
    opt: torch.optim.Optimizer, cfg: dict[str, Any]
) -> torch.optim.lr_scheduler.LambdaLR | None:
    """A ``LambdaLR`` on ``opt`` following :func:`lr_factor`, or None for a constant LR."""
    factor = lr_factor(cfg)
    return None if factor is None else torch.optim.lr_scheduler.LambdaLR(opt, factor)


@torch.no_grad()
def evaluate(model: nn.Module, val: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    was = model.training
    model.eval()
    loss = sum(float(model(x, y)) for x, y in val) / len(val)
    model.train(was)
    return loss


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train ``cfg["steps"]`` steps of ``cfg["method"]`` on this rank; return its records."""
    torch.set_num_threads(cfg.get("threads", 1))
    if cfg.get("flush_denormal"):
        torch.set_flush_denormal(True)
    if cfg.get("materialize"):  # (benchmarks/cluster.py --materialize: the two-sweep path)
        from lightning_onebit.kernels import ExchangeSource

        ExchangeSource.computed_as_read = property(lambda self: False)  # type: ignore[method-assign]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=cfg.get("timeout", 600))
    )
    try:
        return _train(cfg, rank, world, ifname)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _Recorder:
    """Per step: timestamps, bytes sent (the method's count and the interface's) and the loss;
    between steps: rank 0's validation loss, outside the timed region (the others wait)."""

    def __init__(
        self,
        cfg: dict[str, Any],
        rank: int,
        model: nn.Module,
        val: list[tuple[torch.Tensor, torch.Tensor]],
        ifname: str | None,
        ddp_bytes: dict[str, int] | _HookBytes,
    ) -> None:
        self.cfg, self.rank, self.model, self.val = cfg, rank, model, val
        self.ifname, self.ddp_bytes = ifname, ddp_bytes
        self.records: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []

    def evaluate(self, step: int) -> None:
        # the model is identical on all ranks except for the floors and 0/1 Adam's local steps
        if self.rank == 0 and self.cfg["method"] not in FLOOR_METHODS:
            self.evals.append({"step": step, "val_loss": evaluate(self.model, self.val)})
        dist.barrier()

    #: ranks sharing this namespace (one "node"): its interface counts all of them
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    def start(self) -> None:
        self.tx0 = _tx_bytes(self.ifname)
        hook = isinstance(self.ddp_bytes, _HookBytes)
        self.sent0 = self.ddp_bytes.sent() if hook else 0
        self.t0 = self.tb = time.monotonic()
        self.cpu0, self.main0 = time.process_time(), time.thread_time()

    def backward_done(self) -> None:
        self.tb = time.monotonic()

    def end(self, step: int, opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
        t1 = time.monotonic()
        cpu, main = time.process_time() - self.cpu0, time.thread_time() - self.main0
        tx1 = _tx_bytes(self.ifname)
        phase = "warmup" if step <= self.cfg["warmup"] else "compression"
        # bytes this rank sent: the optimizer's own counter, or DDP's ring-allreduce volume
        # (counted at the hook's allreduces, or DDP's fp32 buckets where it has no hook)
        stats = getattr(opt, "comm_stats", None)
        ll, world = self.per_node, dist.get_world_size()
        if stats:
            sent = stats["bytes_last_step"]
            inter = stats["bytes_last_step_inter"]
        else:
            if isinstance(self.ddp_bytes, _HookBytes):
                sent = self.ddp_bytes.sent() - self.sent0
            else:
                sent = self.ddp_bytes[phase]
            # a ring in rank order crosses each node's link once: one rank's traffic per node
            inter = sent // ll if world > ll else 0
        self.records.append(
            {
                "step": step,
                "t0": self.t0,
                "tb": self.tb,
                "t1": t1,
                "phase": phase,
                "opt_phase": getattr(opt, "phase", None),
                "bytes": sent,
                "bytes_inter": inter,
                # this rank's share of what left the node (the namespace's one interface)
                "tx_bytes": (tx1 - self.tx0) / ll,
                "loss": float(loss),
                # CPU seconds of the step: the training thread's, and the other threads'
                # (the exchange's thread, the process group's), which share the rank's cores
                "cpu_main": main,
                "cpu_other": cpu - main,
            }
        )
        every = self.cfg.get("eval_every", 0)
        if (every and step % every == 0) or step == self.cfg["steps"]:
            self.evaluate(step)


Batches = list[tuple[torch.Tensor, torch.Tensor]]


def data(
    cfg: dict[str, Any], train_tok: torch.Tensor, val_tok: torch.Tensor, rank: int
) -> tuple[Batches, Batches]:
    """The validation batches (the same on every rank) and rank ``rank``'s ``cfg["steps"]``
    training batches of ``cfg["batch"]`` windows, all drawn from ``cfg["seed"]``."""
    block, seed = cfg["model"]["block"], cfg.get("seed", 0)
    gen = torch.Generator().manual_seed(seed * 1000 + 1)
    vb = cfg.get("val_batch", 8)
    val_off = torch.randint(
        0, len(val_tok) - block - 1, (cfg.get("val_windows", 32),), generator=gen
    )
    val = [_batch(val_tok, val_off[i : i + vb], block) for i in range(0, len(val_off), vb)]
    gen.manual_seed(seed * 1000 + 17 + rank)  # each rank its own data stream
    steps = cfg["steps"]
    train_off = torch.randint(0, len(train_tok) - block - 1, (steps, cfg["batch"]), generator=gen)
    return val, [_batch(train_tok, train_off[k], block) for k in range(steps)]


def _train(cfg: dict[str, Any], rank: int, world: int, ifname: str | None) -> dict[str, Any]:
    method = cfg["method"]
    model, train_tok, val_tok = build(cfg)
    numel = sum(p.numel() for p in model.parameters())
    val, batches = data(cfg, train_tok, val_tok, rank)

    if method.startswith(LIGHTNING_PREFIX):
        rec = _fit_lightning(cfg, model, batches, rank, world, val, ifname)
    elif method.startswith(FABRIC_PREFIX):
        rec = _fit_fabric(cfg, model, batches, rank, world, val, ifname)
    else:
        module, opt, ddp_bytes = _build_method(method, model, cfg, world)
        sched = _scheduler(opt, cfg)
        rec = _Recorder(cfg, rank, model, val, ifname, ddp_bytes)
        rec.evaluate(0)
        for step, (x, y) in enumerate(batches, start=1):
            rec.start()
            opt.zero_grad(set_to_none=True)
            loss = module(x, y)
            loss.backward()
            rec.backward_done()
            opt.step()
            if sched is not None:
                sched.step()
            rec.end(step, opt, loss)
    return {
        "rank": rank,
        "world_size": world,
        "method": method,
        "numel": numel,
        "records": rec.records,
        "evals": rec.evals,
        "ifname": ifname,
    }


def _fit_lightning(
    cfg: dict[str, Any],
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    rank: int,
    world: int,
    val: list[tuple[torch.Tensor, torch.Tensor]],
    ifname: str | None,
) -> _Recorder:
    """``pl_<method>``: the same training through ``L.Trainer(strategy=...)``, as users run it.

    ``configure_optimizers`` returns ``torch.optim.Adam``; ``OneBitStrategy`` converts it (as
    in the README), ``pl_ddp_adam`` keeps it under Lightning's ``DDPStrategy``. The process
    group is already up (Lightning reuses it); ``LOCAL_RANK``/``NODE_RANK`` tell Lightning that
    this process is local rank ``LOCAL_RANK`` of node ``NODE_RANK`` (nodes of
    ``LOCAL_WORLD_SIZE`` processes, started externally; the strategy's default
    ``hierarchical="auto"`` applies).
    Timestamps come from callbacks: batch start, ``on_before_optimizer_step`` (after backward),
    batch end; Lightning's own per-step work between batches counts in the step time.
    """
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader

    from lightning_onebit import OneBitStrategy

    algorithm = cfg["method"].removeprefix(LIGHTNING_PREFIX)
    lr = cfg.get("lr_lamb", cfg["lr"]) if algorithm == "onebit_lamb" else cfg["lr"]
    betas = tuple(cfg.get("betas", (0.9, 0.999)))
    timeout = timedelta(seconds=cfg.get("timeout", 600))
    numel = sum(p.numel() for p in model.parameters())
    fp32 = 2 * (world - 1) * 4 * numel // world
    rec = _Recorder(cfg, rank, model, val, ifname, {"warmup": fp32, "compression": fp32})

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
            return self.net(*batch)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.Adam(self.parameters(), lr=lr, betas=betas)
            sched = _scheduler(opt, cfg)
            if sched is None:
                return opt
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Timer(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            rec.evaluate(0)

        def on_train_batch_start(self, *args: Any) -> None:
            rec.start()

        def on_before_optimizer_step(self, *args: Any) -> None:
            rec.backward_done()

        def on_train_batch_end(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any
        ) -> None:
            rec.end(trainer.global_step, trainer.strategy.optimizers[0], outputs["loss"])

    if algorithm == "ddp_adam":
        strategy = DDPStrategy(timeout=timeout)
    elif algorithm in ONEBIT_METHODS:
        strategy = OneBitStrategy(**_strategy_options(cfg, algorithm))
    else:
        raise ValueError(f"unknown method {cfg['method']!r}")
    ll = _Recorder.per_node
    os.environ.update(LOCAL_RANK=str(rank % ll), NODE_RANK=str(rank // ll))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=ll,
        num_nodes=world // ll,
        strategy=strategy,
        max_steps=len(batches),
        callbacks=[Timer()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    trainer.fit(Module(), DataLoader(batches, batch_size=None))
    return rec


def _strategy_options(cfg: dict[str, Any], algorithm: str) -> dict[str, Any]:
    """The 1-bit strategies' options of the ``pl_`` and ``fabric_`` methods (the same for both)."""
    zero_one = algorithm == "zero_one_adam"
    return {
        "algorithm": algorithm,
        "freeze_step": cfg.get("var_freeze_step", cfg["warmup"]) if zero_one else cfg["warmup"],
        "overlap_bucket_mb": cfg.get("overlap_mb") or None,
        "average_dtype": cfg.get("average_dtype", "float32"),
        "timeout": timedelta(seconds=cfg.get("timeout", 600)),
        # (given, it also selects the paper's 1-bit phase 1, as in a DeepSpeed config)
        **({"var_update_scaler": vus} if (vus := cfg.get("var_update_scaler")) is not None else {}),
        **cfg.get("strategy_options", {}),
    }


def _fit_fabric(
    cfg: dict[str, Any],
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    rank: int,
    world: int,
    val: list[tuple[torch.Tensor, torch.Tensor]],
    ifname: str | None,
) -> _Recorder:
    """``fabric_<method>``: the plain loop through ``L.Fabric(strategy=...)``, as users write it.

    ``fabric.setup`` gets ``torch.optim.Adam``; ``OneBitFabricStrategy`` converts it,
    ``fabric_ddp_adam`` keeps it under Fabric's ``DDPStrategy``. The process group is already up
    and this process is local rank ``LOCAL_RANK`` of node ``NODE_RANK`` (as for ``pl_``).
    """
    import lightning as L
    from lightning.fabric.strategies import DDPStrategy

    from lightning_onebit import OneBitFabricStrategy

    algorithm = cfg["method"].removeprefix(FABRIC_PREFIX)
    lr = cfg.get("lr_lamb", cfg["lr"]) if algorithm == "onebit_lamb" else cfg["lr"]
    betas = tuple(cfg.get("betas", (0.9, 0.999)))
    numel = sum(p.numel() for p in model.parameters())
    fp32 = 2 * (world - 1) * 4 * numel // world
    rec = _Recorder(cfg, rank, model, val, ifname, {"warmup": fp32, "compression": fp32})
    if algorithm == "ddp_adam":
        strategy: Any = DDPStrategy(timeout=timedelta(seconds=cfg.get("timeout", 600)))
    elif algorithm in ONEBIT_METHODS:
        strategy = OneBitFabricStrategy(**_strategy_options(cfg, algorithm))
    else:
        raise ValueError(f"unknown method {cfg['method']!r}")
    ll = _Recorder.per_node
    os.environ.update(LOCAL_RANK=str(rank % ll), NODE_RANK=str(rank // ll))
    fabric = L.Fabric(accelerator="cpu", devices=ll, num_nodes=world // ll, strategy=strategy)
    fabric.launch()
    adam = torch.optim.Adam(model.parameters(), lr=lr, betas=betas)
    sched = _scheduler(adam, cfg)  # built before setup, as users do: the strategy re-points it
    module, opt = fabric.setup(model, adam)
    # (the optimizer the strategy trains with, for its counters and phase)
    inner = getattr(fabric.strategy, "onebit_optimizer", opt.optimizer)
    rec.evaluate(0)
    for step, (x, y) in enumerate(batches, start=1):
        rec.start()
        opt.zero_grad(set_to_none=True)
        loss = module(x, y)
        fabric.backward(loss)
        rec.backward_done()
        opt.step()
        if sched is not None:
            sched.step()
        rec.end(step, inner, loss)
    return rec


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="JSON configuration (see benchmarks/cluster.py)")
    p.add_argument("--out", required=True, help="where this rank writes its JSON result")
    args = p.parse_args(argv)
    result = run(json.loads(args.config))
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
