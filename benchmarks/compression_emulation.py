"""1-bit Adam's loss with other compression scales, emulated in one process.

The end-to-end benchmark's model and data (``benchmarks/cluster.py --model small --workloads
finetune``: W ranks x batch 4, the same seeds, batches and validation windows) trained by W
virtual ranks in one process: Adam on the averaged gradient for the warmup, then 1-bit Adam's
compression phase written out in torch (the preconditioned exchange of
``lightning_onebit.optim.OneBitAdam`` with ``variance_floor=0, rescale_variance=False``):

    u_r = beta1 * m + (1 - beta1) * g_r            (each rank's local gradient g_r)
    y_r = u_r / d + e_r;  c_r = C(y_r);  e_r = y_r - c_r     (worker compression, its error)
    z = mean_r c_r + e_s;  x = C(z);  e_s = z - x  (server compression, its error)
    m = x * d;  p -= lr * x                         (d = sqrt(v / (1 - beta2**t0)) + eps)

``C(y) = s_k * sign(y)`` with ``s_k = ||y_k|| / sqrt(n_k)`` on each segment ``k``: ``--scale
chunk`` cuts the flat vector into the W chunks the exchange sends (the library's records);
``tensor`` also at every parameter's boundary; ``block:N`` also every N values. The loss it
reaches says what a finer scale would buy before any kernel is written. ``--rescale`` sizes
the frozen variance per tensor (:class:`Rescale`): ``adam`` is ``rescale_variance``'s rule,
``fast`` one that follows the last ~10 steps' gradient scale upwards only.

``--warmup-codec`` is the warmup's exchange of the gradient average (:class:`WarmupCodec`):
``fp32`` the exact mean (the default), ``bf16`` torch DDP's ``bf16_compress_hook`` (each
rank's gradient cast to bf16 and divided by W, summed in bf16, cast back), ``int8``/``int4``
integers with one fp32 scale per ``--warmup-block`` values (ZeRO++ qgZ's layout), with error
feedback on both sides as the 1-bit exchange has it unless ``--warmup-error-feedback off``.
At the switch a shadow Adam variance fed the exact mean through the warmup measures, per
tensor, ``||v_codec - v_exact|| / ||v_exact||`` of the frozen (bias-corrected) variance.
``--no-compression`` is the DDP baseline: Adam on the exact mean for all the steps.

    python benchmarks/compression_emulation.py --scale tensor --seed 0 --json out.json
    python benchmarks/compression_emulation.py --warmup-codec int4 --warmup 30 --json out.json

One rank's forward/backward after another, 1 thread: ~1.1 s per step of the ``small`` model on
the development VM (300 steps in ~6 minutes).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the cluster benchmark's worker
import cluster_worker as w


def segments(sizes: list[int], world: int, scale: str) -> torch.Tensor:
    """The segment index of each of the ``sum(sizes)`` flat values (see the module docstring)."""
    n = sum(sizes)
    chunk = -(-n // world)
    cuts = set(range(0, n, chunk)) | {n}
    if scale == "tensor":
        offset = 0
        for size in sizes:
            cuts.add(offset)
            offset += size
    elif scale.startswith("block:"):
        cuts |= set(range(0, n, int(scale.split(":", 1)[1])))
    elif scale != "chunk":
        raise ValueError(f"--scale {scale!r}: chunk, tensor or block:N")
    ordered = sorted(cuts)
    seg = torch.empty(n, dtype=torch.long)
    for k, (a, b) in enumerate(itertools.pairwise(ordered)):
        seg[a:b] = k
    return seg


def compress(y: torch.Tensor, seg: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``s_k * sign(y)`` per segment, ``s_k = ||y_k|| / sqrt(n_k)`` (sign(0) = +1)."""
    sq = torch.zeros(len(lengths), dtype=torch.float64).index_add_(0, seg, y.double().square())
    s = (sq.sqrt() / lengths.sqrt()).float()
    return torch.where(y >= 0, 1.0, -1.0) * s[seg]


def quantize(y: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """``s * q`` per block of ``block`` flat values: ``s = max|y| / qmax``, ``q = round(y / s)``
    clamped to ``[-qmax, qmax]``, ``qmax = 2**(bits - 1) - 1`` (127 for int8, 7 for int4)."""
    qmax = 2 ** (bits - 1) - 1
    n = y.numel()
    pad = -n % block
    blocks = torch.nn.functional.pad(y, (0, pad)).view(-1, block)
    s = blocks.abs().amax(dim=1, keepdim=True) / qmax
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(blocks / safe).clamp_(-qmax, qmax)
    return (q * s).view(-1)[:n]


INT_BITS = {"int8": 8, "int4": 4}


class WarmupCodec:
    """``--warmup-codec``: the averaged gradient the warmup's Adam steps on (see the docstring).

    ``int8``/``int4`` with error feedback: ``y_r = g_r + e_r``, ``c_r = Q(y_r)``, ``e_r = y_r -
    c_r`` on each rank, ``z = mean_r c_r + e_s``, ``x = Q(z)``, ``e_s = z - x`` on the server;
    every rank steps on ``x``. Without it, ``x = Q(mean_r Q(g_r))``.
    """

    def __init__(self, kind: str, world: int, n: int, block: int, feedback: bool) -> None:
        self.kind, self.world, self.block, self.feedback = kind, world, block, feedback
        if kind in INT_BITS and feedback:
            self.worker_err = [torch.zeros(n) for _ in range(world)]
            self.server_err = torch.zeros(n)

    def bytes_factor(self) -> float:
        """``c``: how many times fewer bytes than fp32 the warmup exchange sends."""
        if self.kind in INT_BITS:
            return 32 / (INT_BITS[self.kind] + 32 / self.block)
        return {"fp32": 1.0, "bf16": 2.0}[self.kind]

    def __call__(self, grads: list[torch.Tensor]) -> torch.Tensor:
        if self.kind == "fp32":
            return sum(grads) / self.world
        if self.kind == "bf16":  # bf16_compress_hook: cast, divide, all-reduce (sum), cast back
            acc = grads[0].bfloat16().div_(self.world)
            for g in grads[1:]:
                acc += g.bfloat16().div_(self.world)
            return acc.float()
        bits = INT_BITS[self.kind]
        acc = torch.zeros_like(grads[0])
        for r, g in enumerate(grads):
            y = g + self.worker_err[r] if self.feedback else g
            c = quantize(y, bits, self.block)
            if self.feedback:
                self.worker_err[r] = y - c
            acc += c
        z = acc / self.world
        if self.feedback:
            z += self.server_err
        x = quantize(z, bits, self.block)
        if self.feedback:
            self.server_err = z - x
        return x


class Rescale:
    """``--rescale``: the per-tensor factor ``r_j`` that multiplies the frozen variance.

    ``fast``: ``G_j``, a running mean (0.9 per step, bias-corrected) of the ranks' mean square
    of tensor ``j``'s local gradients, ``G_ref`` its value after the first 10 frozen steps,
    ``r = max(1, G / G_ref)`` every 10th step. ``adam`` continues what Adam's variance would
    do, per tensor: ``A_j``, a ``beta2`` average of the mean square, fed the averaged
    gradients through the warmup and the local ones, divided by ``c_j`` = (their mean square
    over the first 10 frozen steps) / (the averaged gradients' over the last 10 warmup steps),
    after it; ``r = A(t) / A(switch)``, both bias-corrected, every 10th step. It is the rule of
    ``rescale_variance``, which feeds ``A_j`` ten steps at a time and takes the warmup's recent
    mean square as a running mean (0.9 per step). ``off``: ``r = 1``.
    """

    def __init__(self, kind: str, sizes: list[int], beta2: float = 0.999) -> None:
        if kind not in ("off", "fast", "adam"):
            raise ValueError(f"--rescale {kind!r}: off, fast or adam")
        self.kind, self.beta2 = kind, beta2
        self.tensor = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
        self.numel = torch.tensor(sizes, dtype=torch.float64)
        self.r = torch.ones(len(sizes), dtype=torch.float64)
        self.fast = torch.zeros(len(sizes), dtype=torch.float64)
        self.adam = torch.zeros(len(sizes), dtype=torch.float64)
        self.steps = self.frozen = 0
        self.last_warmup: list[torch.Tensor] = []
        self.first_frozen: list[torch.Tensor] = []
        self.at_switch = self.ref = self.c = None

    def _mean_sq(self, g: torch.Tensor) -> torch.Tensor:
        sums = torch.zeros(len(self.numel), dtype=torch.float64)
        return sums.index_add_(0, self.tensor, g.double().square()) / self.numel

    def _adam(self, ms: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        self.adam.mul_(self.beta2).add_(ms, alpha=1 - self.beta2)
        return self.adam / (1 - self.beta2**self.steps)

    def warmup(self, g: torch.Tensor) -> None:
        """A warmup step's averaged gradient ``g`` (flat)."""
        ms = self._mean_sq(g)
        self.at_switch = self._adam(ms)
        self.last_warmup = [*self.last_warmup, ms][-10:]

    def frozen_step(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """A frozen step's local gradients (one flat tensor per rank); returns ``r`` per value."""
        ms = sum(self._mean_sq(g) for g in grads) / len(grads)
        self.frozen += 1
        if self.kind == "fast":
            self.fast.mul_(0.9).add_(ms, alpha=0.1)
            now = self.fast / (1 - 0.9**self.frozen)
            if self.frozen == 10:
                self.ref = now
            if self.frozen >= 10 and self.frozen % 10 == 0:
                self.r = torch.where(self.ref > 0, now / self.ref, 1.0).clamp_min(1.0)
        elif self.kind == "adam":
            if self.c is None:
                self.first_frozen.append(ms)
                if self.frozen == 10:
                    loc = sum(self.first_frozen) / 10
                    glob = sum(self.last_warmup) / len(self.last_warmup)
                    self.c = torch.where(glob > 0, loc / glob, 1.0)
                    for early in self.first_frozen:
                        now = self._adam(early / self.c)
            else:
                now = self._adam(ms / self.c)
            if self.c is not None and self.frozen % 10 == 0:
                self.r = torch.where(self.at_switch > 0, now / self.at_switch, 1.0)
        return self.r.float()[self.tensor]


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run the emulation; return the validation losses (every ``--eval-every`` steps)."""
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    model_cfg = {"n_layer": 4, "n_embd": 256, "n_head": 4, "block": 128}
    cfg = {
        "model": model_cfg,
        "seed": args.seed,
        "steps": args.steps,
        "lr_schedule": args.lr_schedule,
        "lr_warmup": round(0.05 * args.steps) if args.lr_schedule == "cosine" else 0,
    }
    model, train_tok, val_tok = w.build(cfg)
    # the cluster benchmark's validation windows and every rank's batches
    ranks = [w.data({**cfg, "batch": args.batch}, train_tok, val_tok, r) for r in range(args.world)]
    val = ranks[0][0]
    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    n = sum(sizes)
    opt = torch.optim.Adam(params, lr=args.lr)
    factor = w.lr_factor(cfg)
    sched = None if factor is None else torch.optim.lr_scheduler.LambdaLR(opt, factor)
    seg = segments(sizes, args.world, args.scale)
    lengths = torch.bincount(seg).double()
    worker_err = [torch.zeros(n) for _ in range(args.world)]
    server_err = torch.zeros(n)
    sqrt_v: torch.Tensor | None = None
    rescale = Rescale(args.rescale, sizes)
    warmup = args.steps if args.no_compression else args.warmup
    codec = WarmupCodec(
        "fp32" if args.no_compression else args.warmup_codec,
        args.world,
        n,
        args.warmup_block,
        args.warmup_error_feedback == "on",
    )
    shadow_v = torch.zeros(n)  # Adam's variance had the warmup stepped on the exact mean
    grad_err: list[float] = []  # ||x - exact|| / ||exact|| of each warmup step's average
    variance: dict[str, Any] | None = None
    frac = warmup / args.steps
    bytes_ratio = (
        1.0 if args.no_compression else 1 / (frac / codec.bytes_factor() + (1 - frac) / 32)
    )
    label = "ddp" if args.no_compression else f"{args.scale}/{args.rescale}/{codec.kind}"
    evals = [{"step": 0, "val_loss": w.evaluate(model, val)}]
    t0 = time.monotonic()
    for k in range(1, args.steps + 1):
        grads = []
        for r in range(args.world):
            x, y = ranks[r][1][k - 1]
            opt.zero_grad(set_to_none=True)
            model(x, y).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
        with torch.no_grad():
            if k <= warmup:  # Adam on the average: DDP's step
                average = codec(grads)
                exact = average if codec.kind == "fp32" else sum(grads) / args.world
                shadow_v.mul_(0.999).addcmul_(exact, exact, value=1 - 0.999)
                grad_err.append(float((average - exact).norm() / exact.norm()))
                rescale.warmup(average)
                for p, g in zip(params, average.split(sizes), strict=True):
                    p.grad = g.view_as(p).clone()
                opt.step()
            else:
                if sqrt_v is None:  # the variance freezes, bias-corrected
                    t_freeze = float(opt.state[params[0]]["step"])
                    v = torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for p in params])
                    sqrt_v = v.div(1 - 0.999**t_freeze).sqrt_()
                    variance = variance_error(model, v, shadow_v, t_freeze)
                    print(
                        f"{label} switch at {k - 1}: variance rel. error median "
                        f"{variance['median']:.3e} max {variance['max']:.3e} "
                        f"({variance['max_tensor']}); zeroed {variance['zero_fraction']:.2%}, "
                        f"under a tenth {variance['under_tenth_fraction']:.2%}",
                        flush=True,
                    )
                d = sqrt_v * rescale.frozen_step(grads).sqrt() + 1e-8
                m = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in params])
                acc = torch.zeros(n)
                for r in range(args.world):
                    y = (0.9 * m + 0.1 * grads[r]) / d + worker_err[r]
                    c = compress(y, seg, lengths)
                    worker_err[r] = y - c
                    acc += c
                z = acc / args.world + server_err
                x = compress(z, seg, lengths)
                server_err = z - x
                lr = opt.param_groups[0]["lr"]
                for p, xv, dv in zip(params, x.split(sizes), d.split(sizes), strict=True):
                    opt.state[p]["exp_avg"].copy_((xv * dv).view_as(p))
                    p.add_(xv.view_as(p), alpha=-lr)
        if sched is not None:
            sched.step()
        if k % args.eval_every == 0 or k == args.steps:
            evals.append({"step": k, "val_loss": w.evaluate(model, val)})
            print(
                f"{label} seed {args.seed} step {k}: {evals[-1]['val_loss']:.4f} "
                f"({time.monotonic() - t0:.0f} s)",
                flush=True,
            )
    return {
        "args": vars(args),
        "segments": len(lengths),
        "warmup_codec": codec.kind,
        "warmup_steps": warmup,
        "warmup_bytes_factor": codec.bytes_factor(),
        "bytes_ratio_vs_fp32_ddp": bytes_ratio,
        "warmup_grad_rel_error_mean": sum(grad_err) / len(grad_err) if grad_err else None,
        "variance_rel_error_at_switch": variance,
        "final_val_loss": evals[-1]["val_loss"],
        "evals": evals,
    }


def variance_error(
    model: torch.nn.Module, v: torch.Tensor, shadow: torch.Tensor, t: float
) -> dict[str, Any]:
    """Per tensor ``||v - v_exact|| / ||v_exact||`` of the bias-corrected variances."""
    corr = 1 - 0.999**t
    errors = {}
    offset = 0
    for name, p in model.named_parameters():
        a = v[offset : offset + p.numel()].double() / corr
        b = shadow[offset : offset + p.numel()].double() / corr
        offset += p.numel()
        errors[name] = float((a - b).norm() / b.norm()) if b.norm() > 0 else 0.0
    ordered = sorted(errors.values())
    live = shadow > 0  # entries the exact mean gave a variance; the codec may have zeroed them
    return {
        "median": float(torch.tensor(ordered).median()),
        "max": ordered[-1],
        "max_tensor": max(errors, key=errors.get),
        "zero_fraction": float((live & (v == 0)).sum() / live.sum()),
        "under_tenth_fraction": float((live & (v < 0.1 * shadow)).sum() / live.sum()),
        "per_tensor": errors,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", default="chunk", help="chunk, tensor or block:N")
    p.add_argument("--rescale", default="off", help="off, fast or adam (rescale_variance's rule)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--batch", type=int, default=4, help="per virtual rank")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="cosine")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--warmup-codec", choices=("fp32", "bf16", "int8", "int4"), default="fp32")
    p.add_argument("--warmup-block", type=int, default=256, help="values per scale (int codecs)")
    p.add_argument("--warmup-error-feedback", choices=("on", "off"), default="on")
    p.add_argument("--no-compression", action="store_true", help="DDP: Adam on the mean, all steps")
    p.add_argument("--json", default=None, help="write the losses here")
    args = p.parse_args()
    result = train(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
