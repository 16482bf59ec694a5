"""The hierarchical (two-level) exchange on real gloo processes: 2 "nodes" x 2 ranks (ranks
numbered node by node, ``ranks_per_node=2``) on this machine.

* The exchange equals a float64 simulation of the two-level algorithm (``SimHierarchical``:
  the node's exact mean, shard ``k`` through the one-level exchange among the nodes), call after
  call (error feedback), and every rank gets the same bits; its inter-node bytes are 1.75x below
  the flat exchange's (its all_to_all part L = 2 times; the flat all_gather is a ring, which
  already sends most records across a node's link once).
* A NaN on one rank stops the call on every rank of every node, nothing written.
* The three optimizers with ``hierarchical=True`` equal the rank-by-rank simulation (whose
  exchange is two-level), stay in sync, resume exactly from a checkpoint; the overlap path (its
  own groups, buckets) too.
* One node (``ranks_per_node=W``) or one rank per node reduce to the flat exchange bit for bit;
  a checkpoint of the other layout resumes with fresh error buffers and says so.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_onebit.comm import (
    CompressedAllreduce,
    HierarchicalAllreduce,
    NodeGroups,
    NonFiniteError,
    hierarchical_average,
)
from lightning_onebit.optim import OneBitAdam
from tests.helpers.dist import run_distributed
from tests.helpers.reference import (
    CKPT_CASES,
    SimHierarchical,
    _algo,
    flat_trainable,
    make_groups,
    make_params,
    rel_err,
    run_with_restart,
    set_grads,
    simulate_zero_one_adam,
)

W, L = 4, 2
SIZES = [37, 1000, 4099]  # smaller than one byte per rank, padded, odd
CALLS = 5


def _inputs(size: int, call: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * size + 10 * call + rank)
    return torch.randn(size, generator=g) * (1 + rank) + 0.3


# --------------------------------------------------------------------------- the exchange


def _exchange_worker(rank: int, world: int) -> dict:
    nodes = NodeGroups(None, L)
    out = {"nodes": (nodes.nodes, nodes.local_rank, nodes.node_rank)}
    for size in SIZES:
        hier = HierarchicalAllreduce(size, nodes)
        flat = CompressedAllreduce(size)
        res = []
        for call in range(CALLS):
            x = _inputs(size, call, rank)
            res.append(hier(x).clone())
            flat(x)
        out[size] = {
            "results": torch.stack(res),
            "intra": hier.bytes_sent_intra,
            "inter": hier.bytes_sent_inter,
            "flat_inter": flat.inter_node_bytes(L),
            "flat_total": flat.bytes_sent,
        }
    x = _inputs(5000, 0, rank)
    mean = x.clone()
    hierarchical_average(mean, torch.float32, nodes)
    half = x.clone()
    hierarchical_average(half, torch.bfloat16, nodes)
    out["average"] = (mean, half)
    return out


@pytest.mark.slow
def test_exchange_matches_two_level_simulation_and_sends_fewer_inter_node_bytes() -> None:
    results = run_distributed(_exchange_worker, W)
    assert [r["nodes"] for r in results] == [(2, 0, 0), (2, 1, 0), (2, 0, 1), (2, 1, 1)]
    for size in SIZES:
        sim = SimHierarchical(size, W // L, L)
        for call in range(CALLS):
            want = sim([_inputs(size, call, r).double() for r in range(W)])
            got = results[0][size]["results"][call]
            for r in range(1, W):  # every rank of every node: the same bits
                assert torch.equal(results[r][size]["results"][call], got), (size, call, r)
            assert rel_err(got, want) < 1e-6, (size, call, rel_err(got, want))
        stats = results[0][size]
        if size >= 1000:  # per rank, what leaves the node: the flat all_to_all's 2 records
            # and 1.5 of its ring all_gather vs 1 + 1 of the inter-node exchange (padding aside)
            assert stats["flat_inter"] >= 1.7 * stats["inter"], stats
        # inside the node: the fp32 reduce-scatter and the gathered records
        assert stats["intra"] >= (L - 1) * 4 * size / L
    # the two-level full-precision average: the mean, identical everywhere
    xs = torch.stack([_inputs(5000, 0, r) for r in range(W)])
    exact = xs.double().mean(0)
    for r in range(W):
        mean, half = results[r]["average"]
        assert torch.equal(mean, results[0]["average"][0])
        assert torch.equal(half, results[0]["average"][1])
        assert rel_err(mean, exact) < 1e-6
        assert rel_err(half, exact) < 2e-2  # bfloat16: 8 bits of mantissa


def _nan_worker(rank: int, world: int) -> dict:
    nodes = NodeGroups(None, L)
    ex = HierarchicalAllreduce(1000, nodes)
    twin = HierarchicalAllreduce(1000, nodes)  # never sees the bad call
    errors, results = [], []
    for call in range(4):
        x = _inputs(1000, call, rank)
        if call == 2:
            if rank == 3:
                x[17] = float("nan")
            try:
                ex(x)
            except NonFiniteError as e:
                errors.append(str(e))
            continue
        results.append((ex(x).clone(), twin(x).clone()))
    return {"errors": errors, "results": results}


@pytest.mark.slow
def test_nan_on_one_rank_stops_every_rank_of_every_node_and_changes_nothing() -> None:
    results = run_distributed(_nan_worker, W)
    for r, res in enumerate(results):
        assert len(res["errors"]) == 1, (r, res["errors"])
        assert "node(s) [1] (ranks 2-3)" in res["errors"][0], res["errors"]
        for got, twin in res["results"]:  # error buffers as if the call had not been there
            assert torch.equal(got, twin)


def _tensor_source_worker(rank: int, world: int) -> list[bool]:
    """Three calls of two exchanges, one fed the tensor, its twin a TensorSource of it (started
    directly, then through finish()): the results and the error buffers bit for bit."""
    from lightning_onebit.kernels import TensorSource

    nodes = NodeGroups(None, L)
    plain, twin = HierarchicalAllreduce(1000, nodes), HierarchicalAllreduce(1000, nodes)
    same = []
    for call in range(3):
        x = _inputs(1000, call, rank)
        a = plain(x).clone()
        if call < 2:
            b = twin.start(TensorSource(x.clone())).wait().clone()
        else:
            b = torch.empty(1000)
            twin.finish([TensorSource(x.clone())], b)
        shards = plain.state_dict()["shard"], twin.state_dict()["shard"]
        errors = [(shards[0][k], shards[1][k]) for k in ("worker_error", "server_error")]
        same.append(
            all(torch.equal(e.view(torch.int32), f.view(torch.int32)) for e, f in [(a, b), *errors])
        )
    return same


@pytest.mark.slow
def test_a_tensor_source_is_exchanged_as_its_tensor() -> None:
    for rank, same in enumerate(run_distributed(_tensor_source_worker, W)):
        assert same == [True] * 3, rank


# --------------------------------------------------------------------------- the optimizers

ALGOS = ["onebit_adam", "zero_one_adam", "onebit_lamb"]
STEPS = 24


def _trajectory_worker(rank: int, world: int, overlap: bool) -> dict:
    out = {}
    for algo in ALGOS:
        factory, _ = _algo(algo, 1, 0, robust=True, ranks_per_node=L)
        params = make_params()
        opt = factory(make_groups(params))
        if overlap:  # its own groups; one bucket per param group here (the problem is small)
            opt.overlap_with_backward(25.0)
        hist = []
        for t in range(1, STEPS + 1):
            set_grads(params, rank, t)
            opt.step()
            hist.append(flat_trainable(params).float())
        out[algo] = {"hist": torch.stack(hist), "stats": dict(opt.comm_stats)}
        assert opt.node_groups() is not None
        opt.overlap_with_backward(None)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["in_step", "overlap"])
def test_optimizers_match_two_level_simulation_and_agree_across_ranks(overlap: bool) -> None:
    results = run_distributed(_trajectory_worker, W, overlap)
    for algo in ALGOS:
        _, ref = _algo(algo, W, STEPS, robust=True, ranks_per_node=L)
        synced = list(range(1, STEPS + 1))
        if algo == "zero_one_adam":
            _, synced = simulate_zero_one_adam(
                W, STEPS, 14, 3, 5, 4, bias_correction=True, floor=0.5, preconditioned=True
            )
        worst = 0.0
        for t in range(STEPS):
            for r in range(W):
                worst = max(worst, rel_err(results[r][algo]["hist"][t], ref[t][r]))
            if t + 1 in synced:
                for r in range(1, W):
                    assert torch.equal(results[r][algo]["hist"][t], results[0][algo]["hist"][t])
        assert worst <= 1e-5, (algo, worst)
        stats = [res[algo]["stats"] for res in results]
        assert all(s == stats[0] for s in stats)
        s = stats[0]
        assert 0 < s["bytes_total_inter"] < s["bytes_total"]
        assert s["fp32_equiv_total_inter"] == s["fp32_equiv_total"] // L


def _checkpoint_worker(rank: int, world: int) -> dict:
    out = {}
    for algo, (factory, steps, save_points) in CKPT_CASES.items():

        def hier(g, factory=factory):
            opt = factory(g)
            opt.hierarchical, opt.ranks_per_node = True, L
            return opt

        out[algo] = [torch.stack(run_with_restart(hier, steps, None, rank))]
        for save_at in save_points:
            out[algo].append(torch.stack(run_with_restart(hier, steps, save_at, rank)))
    return out


@pytest.mark.slow
def test_checkpoint_resumes_exactly_with_per_shard_error_buffers() -> None:
    results = run_distributed(_checkpoint_worker, W)
    for algo in CKPT_CASES:
        for r in range(W):
            base, *resumed = results[r][algo]
            for run in resumed:
                assert torch.equal(run, base), (algo, r)


# --------------------------------------------------------------------------- reductions


def _reduction_worker(rank: int, world: int) -> dict:
    runs = {}
    caught = {}
    for name, kw in (
        ("flat", {}),
        ("one_node", {"hierarchical": True, "ranks_per_node": W}),
        ("one_rank_per_node", {"hierarchical": True, "ranks_per_node": 1}),
        ("auto_one_node", {"hierarchical": "auto", "ranks_per_node": W}),
    ):
        params = make_params()
        opt = OneBitAdam(make_groups(params), freeze_step=5, **kw)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for t in range(1, 15):
                set_grads(params, rank, t)
                opt.step()
        caught[name] = [str(x.message) for x in w if "hierarchical=True" in str(x.message)]
        runs[name] = flat_trainable(params)
        assert opt.node_groups() is None
    # a layout change on resume: hierarchical state into a flat optimizer
    params = make_params()
    opt = OneBitAdam(make_groups(params), freeze_step=2, hierarchical=True, ranks_per_node=L)
    for t in range(1, 6):
        set_grads(params, rank, t)
        opt.step()
    state = opt.state_dict()
    flat = OneBitAdam(make_groups(params), freeze_step=2)
    flat.load_state_dict(state)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        set_grads(params, rank, 6)
        flat.step()
    caught["layout"] = [str(x.message) for x in w if "restart from zero" in str(x.message)]
    return {"runs": runs, "caught": caught}


@pytest.mark.slow
def test_one_node_or_one_rank_per_node_is_the_flat_exchange_bitwise() -> None:
    results = run_distributed(_reduction_worker, W)
    for r, res in enumerate(results):
        runs, caught = res["runs"], res["caught"]
        for name in ("one_node", "one_rank_per_node", "auto_one_node"):
            assert torch.equal(runs[name], runs["flat"]), (r, name)
        assert "one node" in caught["one_node"][0]
        assert "one rank per node" in caught["one_rank_per_node"][0]
        assert caught["auto_one_node"] == []
        assert len(caught["layout"]) == 1
        assert "hierarchical exchange of 2 nodes x 2 ranks" in caught["layout"][0]


def test_hierarchical_needs_ranks_per_node() -> None:
    with pytest.raises(ValueError, match="hierarchical must be"):
        OneBitAdam(make_groups(make_params()), hierarchical="yes")
    with pytest.raises(ValueError, match="ranks_per_node"):
        OneBitAdam(make_groups(make_params()), ranks_per_node=0)


def test_strategies_refuse_a_bad_hierarchical_value() -> None:
    from lightning_onebit import OneBitStrategy
    from lightning_onebit.fabric import OneBitFabricStrategy

    for cls in (OneBitStrategy, OneBitFabricStrategy):
        with pytest.raises(ValueError, match="hierarchical must be True, False or 'auto'"):
            cls(hierarchical="yes")
        assert cls().options.hierarchical == "auto"


def _skip_worker(rank: int, world: int) -> dict:
    out = {}
    for algo in ALGOS:
        factory, _ = _algo(algo, 1, 0, robust=True, ranks_per_node=L)
        params = make_params()
        opt = factory(make_groups(params))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for t in range(1, 21):
                set_grads(params, rank, t)
                if t in (5, 16) and rank == 3:  # a warmup step and a compression step
                    params[0].grad[1, 2] = float("nan")
                opt.step()
        out[algo] = {"skipped": opt.skipped_steps, "params": flat_trainable(params)}
        if algo == "zero_one_adam":
            opt.synchronize()
            out[algo]["params"] = flat_trainable(params)
    return out


@pytest.mark.slow
def test_a_nan_on_one_rank_skips_the_step_on_every_rank_of_every_node() -> None:
    results = run_distributed(_skip_worker, W)
    for algo in ALGOS:
        # (0/1 Adam: step 5 a 1-bit gradient step, step 16 a synchronisation)
        assert [res[algo]["skipped"] for res in results] == [2] * W, algo
        for res in results:
            assert torch.isfinite(res[algo]["params"]).all(), algo
            assert torch.equal(res[algo]["params"], results[0][algo]["params"]), algo
