"""Multi-process (gloo, real processes) tests of the 1-bit optimizers.

* Parameters after every step equal the rank-by-rank float64 simulation of ``test_optim.py``
  (written from the update rules, sharing no code with the implementation), and are identical
  on every rank (0/1 Adam: after every synchronisation; its local steps differ by design).
* A checkpoint taken mid-phase on every rank resumes as if training had never stopped.
* Convergence on real text (Python's own standard library sources), 4 ranks, against the
  uncompressed counterparts; and the byte counts against the volume formula.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist

from lightning_onebit.comm import fp32_allreduce_bytes
from lightning_onebit.optim import OneBitAdam, OneBitLamb, ZeroOneAdam
from tests.helpers.dist import run_distributed
from tests.helpers.reference import (
    CKPT_CASES,
    RESCALE_INTERVAL,
    TRAINABLE,
    _algo,
    flat_trainable,
    make_groups,
    make_params,
    rel_err,
    run_with_restart,
    set_grads,
    simulate_zero_one_adam,
)

ALGOS = ["onebit_adam", "zero_one_adam", "onebit_lamb"]
STEPS = 30


# --------------------------------------------------------------------------- equal to the simulation


def _trajectory_worker(rank: int, world: int, steps: int) -> dict:
    out = {}
    for algo, robust in ((a, r) for a in ALGOS for r in (False, True)):
        factory, _ = _algo(
            algo, 1, 0, robust
        )  # the factory only; the simulation runs in the parent
        params = make_params()
        opt = factory(make_groups(params))
        hist = []
        for t in range(1, steps + 1):
            set_grads(params, rank, t)
            opt.step()
            hist.append(flat_trainable(params).float())
        out[algo, robust] = {"hist": torch.stack(hist), "stats": dict(opt.comm_stats)}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_parameters_match_rank_simulation_and_agree_across_ranks(world: int) -> None:
    results = run_distributed(_trajectory_worker, world, STEPS)
    for algo, robust in ((a, r) for a in ALGOS for r in (False, True)):
        _, ref = _algo(algo, world, STEPS, robust)
        synced = list(range(1, STEPS + 1))
        if algo == "zero_one_adam":
            _, synced = simulate_zero_one_adam(
                world,
                STEPS,
                var_freeze_step=14,
                var_update_scaler=3,
                local_step_scaler=5,
                local_step_clipper=4,
            )
            assert len(synced) < STEPS  # local steps did happen
        worst = 0.0
        for t in range(STEPS):
            for r in range(world):
                worst = max(worst, rel_err(results[r][algo, robust]["hist"][t], ref[t][r]))
            if t + 1 in synced:  # parameters identical on every rank, bit for bit
                for r in range(1, world):
                    assert torch.equal(
                        results[r][algo, robust]["hist"][t], results[0][algo, robust]["hist"][t]
                    ), f"{algo}: rank {r} differs from rank 0 after step {t + 1}"
        print(f"W={world} {algo} robust={robust}: max relative error vs simulation {worst:.2e}")
        assert worst <= 1e-5, (algo, robust, worst)
        # every rank counted the same bytes, and they are non-zero
        stats = [res[algo, robust]["stats"] for res in results]
        assert all(s == stats[0] for s in stats) and stats[0]["bytes_total"] > 0
    # rescale_variance's per-tensor all_reduce counts: one per RESCALE_INTERVAL compression steps
    extra = [r["onebit_adam", True]["stats"]["bytes_total"] for r in results]
    base = [r["onebit_adam", False]["stats"]["bytes_total"] for r in results]
    per_step = fp32_allreduce_bytes(len(TRAINABLE), world)
    reduces = (STEPS - 10) // RESCALE_INTERVAL
    assert all(e - b == reduces * per_step for e, b in zip(extra, base, strict=True))


# --------------------------------------------------------------------------- checkpoints


def _checkpoint_worker(rank: int, world: int) -> dict:
    out = {}
    for algo, (factory, steps, save_points) in CKPT_CASES.items():
        out[algo] = [torch.stack(run_with_restart(factory, steps, None, rank))]
        for save_at in save_points:
            out[algo].append(torch.stack(run_with_restart(factory, steps, save_at, rank)))
    return out


@pytest.mark.slow
def test_checkpoint_round_trip_two_ranks() -> None:
    results = run_distributed(_checkpoint_worker, 2)
    for rank, res in enumerate(results):
        for algo, (straight, *resumed) in res.items():
            for r in resumed:
                err = float((r - straight).abs().max() / straight.abs().max())
                assert err <= 1e-6, (rank, algo, err)


def _rank_file_worker(rank: int, world: int) -> dict:
    """1-bit Adam with rescale_variance resumed the way the strategy does it: rank 0's
    state_dict on every rank, then each rank's rank_state_dict; saved between two all-reduces of
    the gradients' mean squares (each rank's own sums pending)."""

    def make(params: list) -> OneBitAdam:
        opt = OneBitAdam(make_groups(params), freeze_step=8, rescale_variance=True)
        opt.rescale_interval = 4
        return opt

    def run(save_at: int | None, keep_sums: bool = True) -> torch.Tensor:
        params = make_params()
        opt = make(params)
        hist = []
        for t in range(1, 25):
            set_grads(params, rank, t)
            for p in params:  # growing gradients: the rescaled variance is in use
                if p.grad is not None:
                    p.grad.mul_(1 + 0.2 * t)
            opt.step()
            hist.append(flat_trainable(params))
            if t == save_at:
                main = [opt.state_dict() if rank == 0 else None]
                dist.broadcast_object_list(main, src=0)
                mine = copy.deepcopy(opt.rank_state_dict())
                if not keep_sums:
                    mine["onebit"].pop("grad_sq_sum")
                saved = [p.detach().clone() for p in params]
                params = make_params()
                with torch.no_grad():
                    for p, x in zip(params, saved, strict=True):
                        p.copy_(x)
                opt = make(params)
                opt.load_state_dict(main[0])
                opt.load_rank_state_dict(mine)
        scales.append(float(opt.rescale.scales(opt.flat).max()))
        return torch.stack(hist)

    scales: list[float] = []
    out = {"straight": run(None), "resumed": run(15), "without_sums": run(15, keep_sums=False)}
    return {**out, "scales": scales[0]}


@pytest.mark.slow
def test_rescale_variance_resumes_exactly_from_rank_files() -> None:
    results = run_distributed(_rank_file_worker, 2)
    for res in results:
        assert torch.equal(res["straight"], res["resumed"])
        assert res["scales"] > 1.2  # the rescaled variance was in use
    # (rank 1 would resume with rank 0's pending sums without its rank file's: not exact)
    assert not torch.equal(results[1]["straight"], results[1]["without_sums"])


# --------------------------------------------------------------------------- convergence on real text

CONTEXT, EMBED, HIDDEN, VOCAB = 8, 12, 128, 64
TOTAL_STEPS, BATCH, SWITCH = 300, 64, 60  # switch at 20% of the steps


def _corpus() -> torch.Tensor:
    """~300 KB of the Python standard library's own sources (no download), as token ids.

    The 63 most frequent bytes get their own id, all others share one. Every id then occurs
    many times during warmup: 1-bit Adam freezes the variance, and a coordinate whose variance
    is still 0 at the freeze would take steps of ``scale / eps`` (1 bit cannot encode the zero
    momentum; DeepSpeed's answer is ``exp_avg_mask``, for coordinates known to stay zero).
    """
    lib = os.path.dirname(os.__file__)
    text = b""
    for name in sorted(os.listdir(lib)):
        if name.endswith(".py"):
            with open(os.path.join(lib, name), "rb") as f:
                text += f.read()
        if len(text) > 320_000:
            break
    raw = torch.frombuffer(bytearray(text[:320_000]), dtype=torch.uint8).long()
    frequent = torch.bincount(raw, minlength=256).argsort(descending=True)[: VOCAB - 1]
    ids = torch.full((256,), VOCAB - 1, dtype=torch.long)
    ids[frequent] = torch.arange(VOCAB - 1)
    return ids[raw]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, EMBED),  # (B, T, E)
        torch.nn.Flatten(),  # (B, T*E)
        torch.nn.Linear(CONTEXT * EMBED, HIDDEN),
        torch.nn.Tanh(),  # no dead units: a zero-gradient weight would have v = 0
        torch.nn.Linear(HIDDEN, VOCAB),  # (B, V) next-character logits
    )


def _batch(data: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.arange(CONTEXT)
    return data[idx[:, None] + offsets], data[idx + CONTEXT]


def _train(rank: int, world: int, data: torch.Tensor, make_opt, manual_allreduce: bool) -> dict:
    model = _model()
    opt = make_opt(model.parameters())
    train_end = len(data) - 40_000
    for step in range(TOTAL_STEPS):
        g = torch.Generator().manual_seed(10_000 * step + rank)  # same samples for every optimizer
        x, y = _batch(data, torch.randint(0, train_end - CONTEXT, (BATCH,), generator=g))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if manual_allreduce:  # the uncompressed baseline: DDP-style gradient averaging
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        opt.step()
    idx = torch.arange(train_end, len(data) - CONTEXT - 1, 7)
    x, y = _batch(data, idx)
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(x), y).reshape(1)
    local = loss.clone()
    dist.all_reduce(loss)
    out = {"loss": float(loss) / world, "local_loss": float(local)}
    if hasattr(opt, "comm_stats"):
        out.update(opt.comm_stats, numel=sum(p.numel() for p in model.parameters()))
    return out


def _convergence_worker(rank: int, world: int) -> dict:
    data = _corpus()
    lr, lamb_lr = 2e-3, 1e-2
    runs = {
        "adam_torch": (lambda ps: torch.optim.Adam(ps, lr=lr), True),
        "adam": (lambda ps: OneBitAdam(ps, lr=lr, freeze_step=10**9), False),
        "onebit_adam": (lambda ps: OneBitAdam(ps, lr=lr, freeze_step=SWITCH), False),
        "zero_one_adam": (
            lambda ps: ZeroOneAdam(
                ps, lr=lr, var_freeze_step=SWITCH, local_step_scaler=40, local_step_clipper=4
            ),
            False,
        ),
        "lamb": (lambda ps: OneBitLamb(ps, lr=lamb_lr, freeze_step=10**9), False),
        "onebit_lamb": (lambda ps: OneBitLamb(ps, lr=lamb_lr, freeze_step=SWITCH), False),
    }
    return {name: _train(rank, world, data, make, manual) for name, (make, manual) in runs.items()}


@pytest.mark.slow
def test_convergence_and_bytes_on_real_text_four_ranks() -> None:
    world = 4
    res = run_distributed(_convergence_worker, world)[0]
    initial = math.log(VOCAB)
    print(
        f"\nchar-level LM on stdlib text, {world} ranks x {BATCH} x {TOTAL_STEPS} steps, "
        f"switch at step {SWITCH}; held-out loss (initial ~{initial:.2f}):"
    )
    for name, r in res.items():
        print(f"  {name:14s} {r['loss']:.4f}")
    for name, r in res.items():
        assert r["loss"] < 0.8 * initial, (name, r["loss"])  # everything actually learned
    # "adam" is Adam as these optimizers run it (no bias correction): the uncompressed
    # counterpart. torch.optim.Adam (bias-corrected) is printed for reference only.
    for compressed, baseline in [
        ("onebit_adam", "adam"),
        ("zero_one_adam", "adam"),
        ("onebit_lamb", "lamb"),
        ("onebit_adam", "adam_torch"),
        ("zero_one_adam", "adam_torch"),
    ]:
        ratio = res[compressed]["loss"] / res[baseline]["loss"]
        print(f"  {compressed} / {baseline} = {ratio:.4f}")
        if baseline != "adam_torch":
            assert ratio <= 1.05, (compressed, baseline, ratio)
    # 0/1 Adam takes local steps: ranks agree after the final step, which is a sync step
    assert res["zero_one_adam"]["local_loss"] == pytest.approx(res["zero_one_adam"]["loss"], rel=0)

    # bytes: 1-bit Adam with warmup fraction w saves 1 / (w + (1 - w) / 32) against fp32
    w = SWITCH / TOTAL_STEPS
    n = res["onebit_adam"]["numel"]
    print(
        f"bytes sent per rank ({n} parameters, fp32 ring allreduce every step = "
        f"{TOTAL_STEPS * fp32_allreduce_bytes(n, world):,}):"
    )
    for name in ["adam", "onebit_adam", "zero_one_adam", "lamb", "onebit_lamb"]:
        r = res[name]
        assert r["fp32_equiv_total"] == TOTAL_STEPS * fp32_allreduce_bytes(n, world)
        print(
            f"  {name:14s} {r['bytes_total']:>12,}  ({r['fp32_equiv_total'] / r['bytes_total']:.2f}x less)"
        )
    expected = 1 / (w + (1 - w) / 32)
    for name in ["onebit_adam", "onebit_lamb"]:
        measured = res[name]["fp32_equiv_total"] / res[name]["bytes_total"]
        print(f"  {name}: measured {measured:.3f}x, formula 1/(w + (1-w)/32) = {expected:.3f}x")
        assert abs(measured / expected - 1) <= 0.03
    # (and one byte per parameter tensor and step: the ranks agree on which ones none of them
    # has a gradient for, a ring all-reduce of 2 (W - 1) / W bytes each)
    agree = 2 * (world - 1) * len(list(_model().parameters())) // world
    assert res["adam"]["bytes_total"] == res["adam"]["fp32_equiv_total"] + TOTAL_STEPS * agree
    # 0/1 Adam communicates less than 1-bit Adam: few fp32 steps, and local steps send nothing
    assert res["zero_one_adam"]["bytes_total"] < res["onebit_adam"]["bytes_total"]
