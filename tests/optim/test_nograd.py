"""Parameters without a gradient under the optimizers used directly (plain ``torch.distributed``,
real gloo ranks), as torch's Adam treats them: a parameter no rank has a gradient for keeps its
value, its state and its part of the exchange's error buffers (flat, two-level and bucketed
exchanges), in warmup and in the compression phase; one that some ranks use is averaged with
the others' zeros, as DDP averages it; each parameter's bias correction counts its own steps
(1-bit LAMB's too); and a step dropped by a verdict kept on the device is not counted as one
they missed.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_onebit.comm import fp32_allreduce_bytes
from lightning_onebit.optim import OneBitAdam, OneBitLamb, ZeroOneAdam
from tests.helpers.dist import run_distributed
from tests.helpers.reference import GROUPS, TRAINABLE, grad_of, initial_params, make_groups

STEPS = 12
SWITCH = 4  # the last warmup step
HEADS = ("unused", "alt", "one_rank")
FACTORIES = {
    # (torch Adam's arithmetic in the first phase: bias correction, no 1-bit steps, no floor)
    "onebit_adam": lambda p, **kw: OneBitAdam(
        p, lr=1e-2, freeze_step=SWITCH, bias_correction=True, **kw
    ),
    "zero_one_adam": lambda p, **kw: ZeroOneAdam(
        p,
        lr=1e-2,
        var_freeze_step=SWITCH,
        compressed_variance_phase=False,
        variance_floor=0.0,
        bias_correction=True,
        local_step_scaler=2,
        local_step_clipper=4,
        **kw,
    ),  # (local phase: syncs on steps 5, 6, 8 and 12; 7 and 9-11 are local steps)
    "onebit_lamb": lambda p, **kw: OneBitLamb(
        p, lr=1e-2, freeze_step=SWITCH, bias_correction=True, **kw
    ),
}
LOCAL_STEPS = {"zero_one_adam": [7, 9, 10, 11]}
#: the steps in which no rank had anything of ``alt`` (used on odd steps): every even one but
#: 0/1 Adam's sync steps 8 and 12, which synchronise its local steps 7 and 9, 11
ALT_MISSED = {"onebit_adam": 6, "zero_one_adam": 4, "onebit_lamb": 6}


class Heads(torch.nn.Module):
    """A small regression with three extra heads: ``unused`` never takes part in the loss,
    ``alt`` does on odd steps (on every rank), ``one_rank`` on rank 0 only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 1)
        for name in HEADS:
            setattr(self, name, torch.nn.Linear(16, 1))

    def loss(self, rank: int, t: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 * rank + t)
        x = torch.randn(16, 8, generator=gen)
        h = torch.tanh(self.body(x))
        pred = self.out(h)
        if t % 2:
            pred = pred + self.alt(h)
        if rank == 0:
            pred = pred + self.one_rank(h)
        return torch.nn.functional.mse_loss(pred, x.sum(1, keepdim=True).sin())


def _average_grads_(params: list[torch.nn.Parameter], world: int) -> None:
    """The reference's averaging, as DDP with ``find_unused_parameters=True`` does it: a
    gradient no rank has stays ``None``; the others are averaged, missing ones as zeros."""
    used = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8)
    dist.all_reduce(used, op=dist.ReduceOp.MAX)
    for p, u in zip(params, used.tolist(), strict=True):
        if not u:
            p.grad = None
            continue
        g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(g)
        p.grad = g / world


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _error_views(opt: Any, p: torch.Tensor) -> list[torch.Tensor]:
    """This rank's error buffers over parameter ``p`` (copies)."""
    layout = opt.flat.layout
    lo = layout.offsets[next(j for j, q in enumerate(layout.params) if q is p)]
    return [e.clone() for e in opt.flat.exchange.error_views(lo, lo + p.numel())]


def _heads_worker(rank: int, world: int) -> dict:
    out: dict[str, Any] = {}
    for algo, factory in FACTORIES.items():
        model, ref = Heads(), Heads()
        opt = factory(model.parameters())
        torch_adam = torch.optim.Adam(ref.parameters(), lr=1e-2)
        hist, ref_hist, averaged, sent = [], [], [], []
        for t in range(1, STEPS + 1):
            opt.zero_grad()
            model.loss(rank, t).backward()
            mine = {k: (v.grad.clone() if v.grad is not None else None)
                    for k, v in model.named_parameters()}  # fmt: skip
            opt.step()
            hist.append(_snapshot(model))
            sent.append(opt.comm_stats["bytes_last_step"])
            # the averaged gradients of this step (for 1-bit LAMB's replay at W = 1)
            for k, v in model.named_parameters():
                v.grad = mine[k]
            _average_grads_(list(model.parameters()), world)
            averaged.append({k: v.grad for k, v in model.named_parameters()})
            if algo != "onebit_lamb":
                torch_adam.zero_grad(set_to_none=True)
                ref.loss(rank, t).backward()
                _average_grads_(list(ref.parameters()), world)
                torch_adam.step()
                ref_hist.append(_snapshot(ref))
        out[algo] = {
            "hist": hist,
            "ref": ref_hist,
            "averaged": averaged,
            "sent": sent,
            "numel": opt.flat.layout.numel,
            "unused_m": [opt.state[p]["exp_avg"].clone() for p in model.unused.parameters()],
            "missed": {
                k: opt.state[p].get("steps_without_grad") for k, p in model.named_parameters()
            },
        }
    return out


def _lamb_replay(averaged: list[dict[str, torch.Tensor | None]]) -> list[dict[str, torch.Tensor]]:
    """1-bit LAMB's warmup in one process, fed the averaged gradients of the 2-rank run."""
    model = Heads()
    opt = FACTORIES["onebit_lamb"](model.parameters())
    hist = []
    for grads in averaged[:SWITCH]:
        for k, v in model.named_parameters():
            v.grad = grads[k]
        opt.step()
        hist.append(_snapshot(model))
    return hist


@pytest.mark.slow
def test_unused_heads_stay_and_partly_used_ones_average_as_under_ddp() -> None:
    """2 gloo ranks, plain ``torch.distributed``: the unused head stays bitwise fixed in warmup
    and after the switch (all three algorithms), its momentum zero; the head used on alternate
    steps and the one used by rank 0 only follow torch Adam + DDP's averaging in warmup to 1e-6
    (torch's per-parameter step counts in the bias correction), 1-bit LAMB its own replay at
    W = 1 on the averaged gradients; the ranks agree on which parameters no rank used with
    one byte per parameter and step (0/1 Adam's local steps included: nothing else)."""
    runs = run_distributed(_heads_worker, 2)
    p0 = _snapshot(Heads())
    params = len(p0)
    for algo in FACTORIES:
        for rank, run in enumerate(r[algo] for r in runs):
            for t, step in enumerate(run["hist"], start=1):
                for k in ("unused.weight", "unused.bias"):
                    assert torch.equal(step[k], p0[k]), (algo, rank, t, k)
            assert all(torch.equal(m, torch.zeros_like(m)) for m in run["unused_m"]), algo
            ref = run["ref"] if algo != "onebit_lamb" else _lamb_replay(run["averaged"])
            for t in range(SWITCH):
                diff = max(float((run["hist"][t][k] - ref[t][k]).abs().max()) for k in p0)
                assert diff < 1e-6, (algo, rank, t + 1, diff)
            # every parameter no rank used is counted as such (the bias correction's steps)
            assert run["missed"]["unused.weight"][0] == STEPS, algo
            assert run["missed"]["alt.weight"][0] == ALT_MISSED[algo], algo
            assert run["missed"]["one_rank.weight"] is None, algo  # (rank 0 used it)
            warm = fp32_allreduce_bytes(run["numel"], 2)
            assert run["sent"][0] == warm + params, (algo, run["sent"][0], warm)
            for t in LOCAL_STEPS.get(algo, []):  # (a local step sends only the agreement)
                assert run["sent"][t - 1] == params, (algo, t)
        # after the switch: the ranks stay together, the partly used heads keep training
        last = [r[algo]["hist"][-1] for r in runs]
        for k in p0:
            assert torch.equal(last[0][k], last[1][k]), (algo, k)
        for k in ("alt.weight", "one_rank.weight"):
            assert not torch.equal(last[0][k], runs[0][algo]["hist"][SWITCH - 1][k]), (algo, k)


# --------------------------------------------------------------------------- error buffers


def _errors_worker(rank: int, world: int, kw: dict, overlap: bool) -> dict:
    """1-bit Adam with an unused head through compression steps; the error buffers of the
    unused head, of the head used on odd steps and of the body around each of those steps."""
    model = Heads()
    opt = FACTORIES["onebit_adam"](model.parameters(), **kw)
    if overlap:
        opt.overlap_with_backward(0.0001)  # (3 buckets: the heads, out and unused, body)
    names = ("unused.weight", "alt.weight", "body.weight")
    watched = {k: p for k, p in model.named_parameters() if k in names}
    around = []
    for t in range(1, STEPS + 1):
        # (before backward: with the overlap, backward starts exchanges on these buffers)
        before = {k: _error_views(opt, p) for k, p in watched.items()} if t > SWITCH else {}
        opt.zero_grad()
        model.loss(rank, t).backward()
        opt.step()
        if t > SWITCH:
            after = {k: _error_views(opt, p) for k, p in watched.items()}
            around.append((t, before, after))
    buckets = len(opt.flat.exchange.bounds or [None])
    return {"around": around, "buckets": buckets, "kind": type(opt.flat.exchange).__name__}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "kw", "overlap", "kind"),
    [
        (4, {"hierarchical": True, "ranks_per_node": 2}, False, "HierarchicalAllreduce"),
        (2, {}, True, "BucketedAllreduce"),
    ],
    ids=["hierarchical_2x2", "bucketed_overlap"],
)
def test_a_parameter_without_gradient_keeps_its_error_buffers(
    world: int, kw: dict, overlap: bool, kind: str
) -> None:
    """Through the two-level exchange (2 nodes x 2 ranks: each rank's shard, its inter-node
    worker and server errors) and the bucketed one (overlap: buckets started during backward,
    the unused head's and those after it in step()): the error buffers over a parameter no
    rank has a gradient for in a compression step are bitwise what they were before it, while
    those of the parameters that trained move."""
    runs = run_distributed(_errors_worker, world, kw, overlap)
    assert all(r["kind"] == kind for r in runs)
    if overlap:
        assert runs[0]["buckets"] > 2
    seen = {"unused.weight": 0, "alt.weight": 0, "body.weight": 0}
    for run in runs:
        for t, before, after in run["around"]:
            for k in seen:
                pairs = list(zip(before[k], after[k], strict=True))
                seen[k] += len(pairs)
                same = all(torch.equal(a, b) for a, b in pairs)
                if k == "unused.weight" or (k == "alt.weight" and t % 2 == 0):
                    assert same, (t, k)
                elif pairs:
                    assert not same, (t, k)
    assert all(n > 0 for n in seen.values()), seen  # (some rank holds each one's errors)


# --------------------------------------------------------------------------- device verdicts

#: steps with a NaN on rank 1: a warmup step and a compression step in which ``alt`` (used on
#: odd steps) has no gradient on any rank
NAN_AT = (2, 8)


def _verdict_worker(rank: int, world: int, algo: str, device: bool) -> dict:
    import warnings

    model = Heads()
    opt = FACTORIES[algo](model.parameters())
    opt.verdict.on_cpu = device  # (the CUDA path's verdict, kept on the device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the skipped steps' warnings)
        for t in range(1, STEPS + 1):
            opt.zero_grad()
            loss = model.loss(rank, t)
            if t in NAN_AT and rank == 1:
                loss = loss + model.body.weight.sum() * float("nan")
            loss.backward()
            opt.step()
        state = opt.state_dict()  # (the last verdict is final here)
    return {
        "device_verdict": opt.flat.exchange.device_verdict,
        "params": _snapshot(model),
        "states": {k: v.clone() for k, v in opt.flat.states.items()},
        "errors": opt.flat.exchange.state_dict(),
        "missed": [s.get("steps_without_grad") for s in state["state"].values()],
        "torch_steps": [float(s["step"]) for s in state["state"].values()],
        "steps": opt.step_count,
    }


@pytest.mark.parametrize("algo", ["onebit_adam", "onebit_lamb"])
def test_a_step_dropped_by_a_device_verdict_is_not_a_step_missed(algo: str) -> None:
    """The CUDA path's verdict (kept on the device, read by the host one step later), run on
    the CPU with NaNs on rank 1: the held parameters' missed steps count only the steps that
    went through, as with the host's verdict, and everything else (parameters, moments, error
    buffers: a held parameter's restore on a dropped step) is bitwise the host's."""
    device = run_distributed(_verdict_worker, 2, algo, True)
    host = run_distributed(_verdict_worker, 2, algo, False)
    for d, h in zip(device, host, strict=True):
        assert d["device_verdict"] and not h["device_verdict"]
        assert d["steps"] == h["steps"] == STEPS - len(NAN_AT)
        assert d["missed"] == h["missed"]
        # unused: every step that went through; alt: the even batches that did
        counted = sorted(m[0] for m in d["missed"] if m is not None)
        alt = len([t for t in range(2, STEPS + 1, 2) if t not in NAN_AT])
        assert counted == [alt, alt, STEPS - len(NAN_AT), STEPS - len(NAN_AT)], counted
        assert d["torch_steps"] == h["torch_steps"]
        for k in d["params"]:
            assert torch.equal(d["params"][k], h["params"][k]), k
        for k in d["states"]:
            assert torch.equal(d["states"][k], h["states"][k]), k
        for k in ("worker_error", "server_error"):
            assert torch.equal(d["errors"][k], h["errors"][k]), k


# --------------------------------------------------------------------------- 1-bit LAMB

LAMB_STEPS = 10
#: the parameter (of tests/helpers/reference.py's problem) without a gradient on some steps
SOMETIMES = 4


def _lamb_grad(t: int, k: int, p: torch.Tensor) -> torch.Tensor | None:
    """Rank 0's gradient of reference.py's problem, none for parameter ``SOMETIMES`` on every
    third step."""
    if k == SOMETIMES and t % 3 == 0:
        return None
    return grad_of(0, t, k, p)


def _lamb_reference(steps: int, betas=(0.9, 0.999), eps=1e-8, coeff_beta=0.9) -> dict:
    """LAMB's warmup with bias correction in float64, one parameter at a time, each counting
    its own steps (a parameter without a gradient is skipped, as torch's Adam skips it), and
    the moments bias-corrected at the switch (max_coeff 10, min_coeff 0.01)."""
    b1, b2 = betas
    p0 = initial_params()
    p = {k: p0[k].clone() for k in TRAINABLE}
    m = {k: torch.zeros_like(p[k]) for k in TRAINABLE}
    v = {k: torch.zeros_like(p[k]) for k in TRAINABLE}
    own = dict.fromkeys(TRAINABLE, 0)
    hp = {k: h for idx, h in GROUPS for k in idx}
    for t in range(1, steps + 1):
        for k in TRAINABLE:
            g = _lamb_grad(t, k, p[k])
            if g is None:
                continue
            own[k] += 1
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g**2
            bc1, bc2 = 1 - b1 ** own[k], 1 - b2 ** own[k]
            u = (m[k] / bc1) / ((v[k] / bc2).sqrt() + eps) + hp[k]["weight_decay"] * p[k]
            pn, un = float(p[k].norm()), float(u.norm())
            coeff = min(max(pn / un, 0.01), 10.0) if pn > 0 and un > 0 else 1.0
            p[k] = p[k] - hp[k]["lr"] * coeff * u
    folded = {k: (m[k] / (1 - b1 ** own[k]), v[k] / (1 - b2 ** own[k])) for k in TRAINABLE}
    return {"params": p, "folded": folded, "own": own}


def test_lamb_bias_correction_counts_each_parameters_own_steps() -> None:
    """1-bit LAMB with ``bias_correction=True`` and a parameter without a gradient on every
    third step: its warmup steps and the moments folded at the switch are those of a float64
    LAMB whose bias correction counts each parameter's own steps."""
    from tests.helpers.reference import make_params

    params = make_params()
    opt = OneBitLamb(
        make_groups(params), freeze_step=LAMB_STEPS, bias_correction=True, variance_floor=0.0
    )
    for t in range(1, LAMB_STEPS + 1):
        for k, p in enumerate(params):
            if p.requires_grad:
                g = _lamb_grad(t, k, p.detach())
                p.grad = None if g is None else g.float()
        opt.step()
    ref = _lamb_reference(LAMB_STEPS)
    assert ref["own"][SOMETIMES] < LAMB_STEPS  # (the parameter did miss steps)
    for k in TRAINABLE:
        got = params[k].detach().double()
        err = float((got - ref["params"][k]).norm() / ref["params"][k].norm())
        assert err < 1e-5, (k, err)
        m, v = opt.state[params[k]]["exp_avg"].double(), opt.state[params[k]]["exp_avg_sq"].double()
        rm, rv = ref["folded"][k]
        assert float((m - rm).norm() / rm.norm()) < 1e-5, k
        assert float((v - rv).norm() / rv.norm()) < 1e-5, k
    assert math.isclose(  # (torch Adam's per-parameter step, for a DDP resume)
        float(opt.state_dict()["state"][SOMETIMES]["step"]),  # (packed index: its position)
        ref["own"][SOMETIMES],
    )
