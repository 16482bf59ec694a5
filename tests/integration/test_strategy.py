"""OneBitStrategy with real multi-process CPU training (gloo, fork-started ranks).

The same LightningModule (``configure_optimizers`` returns ``torch.optim.AdamW``) trains under
``strategy="ddp_notebook"`` and under the 1-bit strategies; the data is Python's own standard
library source (next-character prediction), no downloads.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_onebit
from lightning_onebit import CompressionScheduler, OneBitStrategy
from lightning_onebit.comm import fp32_allreduce_bytes
from lightning_onebit.optim import OneBitAdam, OneBitLamb, ZeroOneAdam
from tests.helpers.char_model import (
    ALGOS,
    SYNC_STEPS_OF_40,
    CharModel,
    _assert_same_on_all_ranks,
    _fit,
    _held_out_loss,
    _per_call,
    _rescale_bytes,
    bf16_warmup_bytes,
    warmup_bytes,
)

# --------------------------------------------------------------------------- registry


def test_registry_names_resolve_to_the_strategy() -> None:
    for algo in ALGOS:
        for name, start in ((algo, "popen"), (f"{algo}_notebook", "fork")):
            strategy = StrategyRegistry.get(name)
            assert isinstance(strategy, OneBitStrategy)
            assert strategy.algorithm == algo
            assert strategy._start_method == start
    # importing again, or registering again, must not fail
    import importlib

    importlib.reload(lightning_onebit)
    OneBitStrategy.register_strategies(StrategyRegistry)
    assert isinstance(StrategyRegistry.get("onebit_lamb"), OneBitStrategy)


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("onebit-adam", "onebit_adam"),
        ("OneBitAdam", "onebit_adam"),  # DeepSpeed's type name (Lightning lowercases it)
        ("1-bit-lamb", "onebit_lamb"),
        ("0/1_adam", "zero_one_adam"),
        ("zero-one-adam-notebook", "zero_one_adam_notebook"),
    ],
)
def test_a_near_miss_name_says_which_name_was_meant(name: str, meant: str) -> None:
    with pytest.raises(ValueError, match=f"did you mean strategy={meant!r}"):
        L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    for canonical in ALGOS:  # and no registered name is taken for a misspelling
        assert StrategyRegistry[canonical]["strategy"] is OneBitStrategy


def test_algorithm_options_are_declared_once_on_the_optimizers() -> None:
    """The strategy offers every optimizer option with ``None`` = the optimizer's default (its
    ``__init__`` signature), and validates with the optimizer's own checks."""
    import inspect

    strategy_params = inspect.signature(OneBitStrategy.__init__).parameters
    for cls in (OneBitAdam, ZeroOneAdam, OneBitLamb):
        for name in cls.OPTIONS:
            assert strategy_params[name].default is None, name
        strategy = OneBitStrategy(algorithm=_ALGO_OF[cls])
        opt = cls([torch.nn.Parameter(torch.zeros(2))], **strategy.options.optimizer_kwargs({}))
        for name, default in cls.option_defaults().items():
            got = getattr(opt, name, None)
            if got is None:  # (LAMB's trust-ratio clamps are param-group hyperparameters)
                got = opt.param_groups[0][name]
            # (and what the strategy sets when it builds the optimizer itself)
            converted = {
                "bias_correction": True,
                (OneBitAdam, "rescale_variance"): True,
                (ZeroOneAdam, "rescale_variance"): True,
                (ZeroOneAdam, "compressed_variance_phase"): False,
            }
            want = converted.get((cls, name), converted.get(name, default))
            assert got == want, (cls, name)
    # asking for the paper's variance schedule (as a DeepSpeed config does) keeps its phase 1
    strategy = OneBitStrategy(algorithm="zero_one_adam", var_update_scaler=8)
    kw = strategy.options.optimizer_kwargs({})
    assert kw["var_update_scaler"] == 8 and "compressed_variance_phase" not in kw
    strategy = OneBitStrategy(
        algorithm="zero_one_adam", var_update_scaler=8, compressed_variance_phase=False
    )
    assert strategy.options.optimizer_kwargs({})["compressed_variance_phase"] is False
    bad = {
        ZeroOneAdam: [{"var_update_scaler": 0}, {"local_step_clipper": 1.5}],
        OneBitLamb: [{"factor_min": 2.0}, {"coeff_beta": 1.0}, {"min_coeff": 20.0}],
        OneBitAdam: [{"variance_floor": 1.0}],
    }
    for cls, cases in bad.items():
        for kwargs in cases:
            with pytest.raises(ValueError) as built:
                cls([torch.nn.Parameter(torch.zeros(1))], **kwargs)
            with pytest.raises(ValueError) as checked:
                cls.check_options(**kwargs)
            assert str(checked.value) == str(built.value)
    with pytest.raises(TypeError, match="has no option"):
        OneBitAdam.check_options(max_coeff=1.0)


_ALGO_OF = {OneBitAdam: "onebit_adam", ZeroOneAdam: "zero_one_adam", OneBitLamb: "onebit_lamb"}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"algorithm": "onebit_sgd"}, "algorithm must be one of"),
        ({"freeze_step": -1}, "freeze_step must be >= 0"),
        ({"freeze_step": 1.5}, r"must be in \(0, 1\)"),
        ({"freeze_step": 0.0}, r"must be in \(0, 1\)"),
        ({"freeze_step": "10"}, "freeze_step must be an int"),
        ({"algorithm": "onebit_lamb", "min_coeff": 5.0, "max_coeff": 1.0}, "min_coeff"),
        ({"algorithm": "onebit_lamb", "factor_min": 5.0}, "factor_min"),
        ({"algorithm": "zero_one_adam", "var_update_scaler": 0}, "var_update_scaler"),
        ({"algorithm": "zero_one_adam", "local_step_clipper": 0}, "local_step_clipper"),
        ({"freeze_window": 0}, "window"),
        ({"ddp_comm_hook": lambda s, b: None}, "installs its own DDP communication hook"),
        ({"average_dtype": "fp64"}, "average_dtype must be"),
        ({"average_dtype": torch.float64}, "average_dtype must be"),
    ],
)
def test_bad_configuration_fails_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OneBitStrategy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "dtype"),
    [
        ({}, torch.int4),
        ({"average_dtype": "float32"}, torch.float32),
        ({"average_dtype": "fp16"}, torch.float16),
        ({"deepspeed_compatible": True}, torch.float32),
        ({"deepspeed_compatible": True, "average_dtype": "bf16"}, torch.bfloat16),
    ],
)
def test_the_warmup_average_is_int4_unless_asked_or_deepspeed_compatible(
    kwargs: dict, dtype: torch.dtype
) -> None:
    """The optimizer the strategy builds averages its warmup in int4 by default (until
    ``settle_average`` sees the run), in float32 with DeepSpeed's arithmetic, and in whatever
    ``average_dtype`` names."""
    for algorithm in ALGOS:
        options = OneBitStrategy(algorithm=algorithm, **kwargs).options
        assert options.optimizer_kwargs({"lr": 1e-3})["average_dtype"] == dtype


@pytest.mark.parametrize(
    ("kwargs", "adaptive", "dtype"),
    [
        ({}, False, torch.int4),
        ({}, True, torch.bfloat16),
        ({"average_dtype": "float32"}, True, torch.float32),
        ({"average_dtype": "int4"}, True, torch.int4),
        ({"deepspeed_compatible": True}, False, torch.float32),
    ],
)
def test_the_default_warmup_average_is_int4_where_its_window_can_end_at_the_switch(
    kwargs: dict, adaptive: bool, dtype: torch.dtype, caplog: pytest.LogCaptureFixture
) -> None:
    """Once the run is set up, the optimizer the strategy built keeps the int4 default on CPU
    parameters with a fixed switch; an adaptive switch (whose step the variance window cannot
    precede) makes it bf16, said in one info line; a dtype given stays as given."""
    for algorithm in ALGOS:
        strategy = OneBitStrategy(algorithm=algorithm, **kwargs)
        params = list(torch.nn.Linear(4, 2).parameters())
        opt = strategy.builder.from_user(torch.optim.AdamW(params), "returned", "return")
        with caplog.at_level(logging.INFO):
            caplog.clear()
            strategy.builder.settle_average(opt, adaptive)
        assert opt.average_dtype == dtype
        assert opt.average_warmup_grads == (dtype == torch.int4)  # else DDP's hook averages
        said = [r.getMessage() for r in caplog.records if "averages in bf16" in r.getMessage()]
        assert len(said) == (dtype == torch.bfloat16), said
    strategy = OneBitStrategy(variance_window=4)
    opt = strategy.builder.from_user(torch.optim.AdamW(params), "returned", "return")
    with pytest.raises(MisconfigurationException, match="variance_window=4 applies to the int4"):
        strategy.builder.settle_average(opt, True)


# --------------------------------------------------------------------------- training


@pytest.mark.slow
@pytest.mark.parametrize(
    # 4 ranks: the same code with more chunks per exchange (the exchange itself is compared with
    # the simulation on 4 ranks on every change, tests/optim/test_optim_dist.py)
    "devices",
    [2, pytest.param(4, marks=pytest.mark.long)],
)
def test_trains_like_ddp_with_fewer_bytes(tmp_path: Path, devices: int) -> None:
    """Each algorithm against DDP + AdamW (same module, same steps); 1-bit LAMB against LAMB."""
    steps, switch = 100, 25  # compression after 25% of the steps
    results: dict[str, tuple[float, list[dict]]] = {}
    runs: dict[str, Any] = {
        "ddp": "ddp_notebook",
        **{a: OneBitStrategy(algorithm=a, freeze_step=switch, start_method="fork") for a in ALGOS},
        # LAMB baseline: 1-bit LAMB that never leaves its (uncompressed) warmup
        "lamb": OneBitStrategy(algorithm="onebit_lamb", freeze_step=10**9, start_method="fork"),
    }
    for name, strategy in runs.items():
        # a frozen variance scales the step like lr / sqrt(v): short runs need a modest lr
        lr = 5e-3 if "lamb" in name else 6e-4
        records = _fit(
            tmp_path / name, strategy, devices=devices, steps=steps, model=CharModel(lr=lr)
        )
        _assert_same_on_all_ranks(records)
        results[name] = (_held_out_loss(records[0]["params"]), records)
    initial = _held_out_loss(CharModel().state_dict())
    print(
        f"\nW={devices}, {steps} steps, switch after {switch}: held-out loss (initial {initial:.3f})"
    )
    for name, (loss, recs) in results.items():
        stats = recs[0]["comm_stats"]
        ratio = stats.get("fp32_equiv_total", 0) / max(stats.get("bytes_total", 1), 1)
        print(
            f"  {name:14s} {loss:.4f}  bytes/rank {stats.get('bytes_total', '-')}  x{ratio:.2f} fewer than fp32"
        )
    for name in ALGOS:
        baseline = results["lamb" if name == "onebit_lamb" else "ddp"][0]
        loss, recs = results[name]
        assert loss < 0.9 * initial, f"{name} did not learn"
        assert loss <= 1.05 * baseline, f"{name}: {loss:.4f} vs baseline {baseline:.4f}"
        rec = recs[0]
        assert rec["optimizer"] == {
            "onebit_adam": "OneBitAdam",
            "zero_one_adam": "ZeroOneAdam",
        }.get(name, "OneBitLamb")
        assert rec["phase"] != {"onebit_adam": "warmup", "zero_one_adam": "variance"}.get(
            name, "warmup"
        )
        # logged counters are the optimizer's, and they add up to the expected traffic
        stats = rec["comm_stats"]
        assert rec["metrics"]["onebit/bytes_total"] == stats["bytes_total"]
        numel = sum(v.numel() for v in rec["params"].values())
        assert stats["fp32_equiv_total"] == steps * fp32_allreduce_bytes(numel, devices)
        # warmup: int8 codes (the variance window); then one 1-bit exchange a step
        if name != "zero_one_adam":
            per_call = _per_call(numel, devices)
            expect = switch * warmup_bytes(rec["params"], devices) + (steps - switch) * per_call
            if name == "onebit_adam":
                expect += _rescale_bytes(rec["params"], devices, steps - switch)
            assert stats["bytes_total"] == expect
        assert stats["fp32_equiv_total"] / stats["bytes_total"] > 3.0


@pytest.mark.slow
def test_half_precision_warmup_average(tmp_path: Path) -> None:
    """``average_dtype="bf16"``: DDP's bf16 hook averages the warmup gradients, half the warmup
    bytes of ``"float32"`` (DDP's exact average), a (rounded) different trajectory that learns
    as well."""
    steps, switch = 30, 20
    runs = {
        d: _fit(
            tmp_path / str(d),
            OneBitStrategy(freeze_step=switch, average_dtype=d, start_method="fork"),
            steps=steps,
        )
        for d in ("float32", "bf16")
    }
    numel = sum(v.numel() for v in runs["float32"][0]["params"].values())
    for d, records in runs.items():
        _assert_same_on_all_ranks(records)
        warm = fp32_allreduce_bytes(numel, 2) if d == "float32" else bf16_warmup_bytes(numel, 2)
        expect = switch * warm + (steps - switch) * _per_call(numel, 2)
        expect += _rescale_bytes(records[0]["params"], 2, steps - switch)
        assert records[0]["comm_stats"]["bytes_total"] == expect
    fp32, bf16 = runs["float32"][0]["params"], runs["bf16"][0]["params"]
    assert any(not torch.equal(fp32[k], bf16[k]) for k in fp32)  # the hook did round
    loss32, loss16 = _held_out_loss(fp32), _held_out_loss(bf16)
    assert abs(loss16 - loss32) < 0.02 * loss32, (loss32, loss16)


@pytest.mark.slow
def test_adam_with_scheduler_and_groups_is_converted(tmp_path: Path) -> None:
    class Grouped(CharModel):
        def configure_optimizers(self) -> Any:
            opt = torch.optim.Adam(
                [
                    {"params": self.net[0].parameters(), "lr": 1e-3},
                    {"params": list(self.net[2:].parameters()), "weight_decay": 0.01},
                ],
                lr=2e-3,
                betas=(0.8, 0.99),
                eps=1e-7,
            )
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    records = _fit(tmp_path, OneBitStrategy(freeze_step=4), devices=1, steps=10, model=Grouped())
    rec = records[0]
    assert rec["optimizer"] == "OneBitAdam"
    # StepLR halves every 4 steps: after 10 steps the lrs are a quarter of the initial ones
    assert rec["lr"] == pytest.approx([1e-3 / 4, 2e-3 / 4])
    assert rec["phase"] == "compression" and rec["step_count"] == 10


def test_unsupported_optimizers_get_a_clear_error(tmp_path: Path) -> None:
    class SGDModel(CharModel):
        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class TwoOpts(CharModel):
        def configure_optimizers(self) -> Any:
            return [
                torch.optim.Adam(self.net[0].parameters()),
                torch.optim.Adam(self.net[2].parameters()),
            ]

    for model, match in ((SGDModel(), "cannot run SGD"), (TwoOpts(), "trains with one optimizer")):
        with pytest.raises((MisconfigurationException, RuntimeError), match=match):
            _fit(tmp_path, OneBitStrategy(), devices=1, steps=1, model=model)


@pytest.mark.slow
def test_own_optimizer_is_used_as_is_and_accumulation_works(tmp_path: Path) -> None:
    class Own(CharModel):
        def configure_optimizers(self) -> Any:
            return OneBitLamb(self.parameters(), lr=5e-3, freeze_step=3)

    records = _fit(
        tmp_path,
        OneBitStrategy(algorithm="onebit_adam", start_method="fork"),
        steps=8,
        model=Own(),
        accumulate_grad_batches=2,
    )
    assert records[0]["optimizer"] == "OneBitLamb"  # the strategy's algorithm does not override it
    assert records[0]["step_count"] == 8 and records[0]["phase"] == "compression"
    _assert_same_on_all_ranks(records)


# --------------------------------------------------------------------------- checkpoints


@pytest.mark.slow
@pytest.mark.parametrize("algo", ALGOS)
def test_kill_and_resume_equals_uninterrupted(tmp_path: Path, algo: str) -> None:
    """Stop at step 16 (in the compression phase), resume to 32: same parameters as 32 at once."""

    def strategy() -> OneBitStrategy:
        # (0/1 Adam's local_step_scaler by default is a fraction of each fit's max_steps: 16
        # for the first fit, 32 for the whole run)
        return OneBitStrategy(
            algorithm=algo, freeze_step=6, local_step_scaler=4, start_method="fork"
        )

    def kw() -> dict:  # a fresh model per fit: the fork launcher copies rank 0's weights back
        return {"model": CharModel(lr=1e-3), "epoch_steps": 8}

    full = _fit(tmp_path / "full", strategy(), steps=32, **kw())
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=16, save_top_k=-1)
    _fit(tmp_path / "first", strategy(), steps=16, callbacks=[ckpt], **kw())
    path = tmp_path / "ckpt" / "epoch=1-step=16.ckpt"
    assert path.exists() and all(Path(f"{path}.onebit-rank{r}-of-2").exists() for r in range(2))
    resumed = _fit(tmp_path / "second", strategy(), steps=32, ckpt_path=str(path), **kw())
    for r in range(2):
        assert resumed[r]["step_count"] == full[r]["step_count"] == 32
        for k, v in full[r]["params"].items():
            torch.testing.assert_close(resumed[r]["params"][k], v, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_resume_without_rank_files_resets_error_buffers_with_a_warning(tmp_path: Path) -> None:
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=8, save_top_k=-1)
    _fit(
        tmp_path / "a",
        OneBitStrategy(freeze_step=4, start_method="fork"),
        steps=8,
        callbacks=[ckpt],
    )
    path = tmp_path / "ckpt" / "epoch=0-step=8.ckpt"
    for r in range(2):
        Path(f"{path}.onebit-rank{r}-of-2").unlink()
    with pytest.warns(UserWarning, match="error buffers of those ranks reset"):
        # devices=1: the warning is raised in this process (no fork)
        records = _fit(
            tmp_path / "b", OneBitStrategy(freeze_step=4), devices=1, steps=12, ckpt_path=str(path)
        )
    assert records[0]["step_count"] == 12


# --------------------------------------------------------------------------- precision


def _fp16_plugin() -> MixedPrecision:
    # Trainer(precision="16-mixed") on CPU silently becomes bf16-mixed; torch itself has fp16
    # autocast and a GradScaler on CPU, so build the plugin explicitly to test the scaler path.
    return MixedPrecision(precision="16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision(tmp_path: Path, precision: str) -> None:
    kw = {"precision": precision} if precision == "bf16-mixed" else {"plugins": [_fp16_plugin()]}
    records = _fit(tmp_path, OneBitStrategy(freeze_step=4, start_method="fork"), steps=12, **kw)
    _assert_same_on_all_ranks(records)
    assert records[0]["step_count"] == 12
    assert all(torch.isfinite(v).all() for v in records[0]["params"].values())


@pytest.mark.slow
def test_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path: Path) -> None:
    """16-mixed: an inf loss on rank 1 only, in the compression phase: every rank skips it."""
    records = _fit(
        tmp_path,
        OneBitStrategy(freeze_step=4, start_method="fork"),
        steps=12,
        plugins=[_fp16_plugin()],
        model=CharModel(nan_at=8),
    )
    _assert_same_on_all_ranks(records)
    counts = {r["step_count"] for r in records}
    assert counts == {11}, counts  # 12 batches, one optimizer step skipped everywhere
    assert all(torch.isfinite(v).all() for v in records[0]["params"].values())


@pytest.mark.slow
@pytest.mark.parametrize("nan_at", [2, 8])
def test_nan_on_one_rank_in_fp32_skips_the_step_on_every_rank(tmp_path: Path, nan_at: int) -> None:
    """fp32, no loss scaler: an inf loss on rank 1 in the warmup (2) or the compression phase (8)
    poisons a communicated quantity; the optimizer drops the step on every rank and says so
    once (rank 0), not once per rank."""
    logging.captureWarnings(True)  # the forked ranks' warnings, into a file they inherit
    handler = logging.FileHandler(tmp_path / "warnings.txt")
    logging.getLogger("py.warnings").addHandler(handler)
    try:
        records = _fit(
            tmp_path,
            OneBitStrategy(freeze_step=4, start_method="fork"),
            steps=12,
            model=CharModel(nan_at=nan_at),
        )
    finally:
        logging.getLogger("py.warnings").removeHandler(handler)
        handler.close()
        logging.captureWarnings(False)
    said = (tmp_path / "warnings.txt").read_text()
    assert said.count(f"skipped step {nan_at + 1} on every rank") == 1, said
    _assert_same_on_all_ranks(records)
    assert {r["step_count"] for r in records} == {11}
    assert records[0]["metrics"]["onebit/skipped_steps"] == 1.0
    assert all(torch.isfinite(v).all() for v in records[0]["params"].values())


class PauseOverlap(Callback):
    """Keeps the optimizer's overlap paused: the same buckets, all exchanged inside step()."""

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        trainer.strategy.optimizers[0].overlap_paused = True


@pytest.mark.slow
def test_overlap_with_gradient_accumulation_equals_the_exchange_in_step(tmp_path: Path) -> None:
    """Buckets exchanged during the last micro-batch's backward (the others pause the overlap)
    give bitwise the parameters of the same buckets exchanged in step(); every rank agrees."""
    kw = dict(steps=10, accumulate_grad_batches=2)
    strategy = lambda: OneBitStrategy(  # noqa: E731
        freeze_step=3, overlap_bucket_mb=0.005, start_method="fork"
    )
    live = _fit(tmp_path / "live", strategy(), **kw)
    late = _fit(tmp_path / "late", strategy(), callbacks=[PauseOverlap()], **kw)
    _assert_same_on_all_ranks(live)
    assert live[0]["overlap"] and live[0]["buckets"] >= 3, (live[0]["overlap"], live[0]["buckets"])
    for k, v in live[0]["params"].items():
        assert torch.equal(v, late[0]["params"][k]), k
    assert live[0]["step_count"] == 10


def test_overlap_is_off_where_gradients_change_after_backward(tmp_path: Path) -> None:
    clipped = _fit(
        tmp_path / "clip",
        OneBitStrategy(freeze_step=2, start_method="fork"),
        steps=4,
        gradient_clip_val=1.0,
    )
    assert clipped[0]["overlap"] is False
    off = _fit(
        tmp_path / "off",
        OneBitStrategy(freeze_step=2, overlap_bucket_mb=None, start_method="fork"),
        steps=4,
    )
    assert off[0]["overlap"] is False
    with pytest.raises(ValueError, match=r"overlap_bucket_mb must be a number in \(0, inf\)"):
        OneBitStrategy(overlap_bucket_mb=0)


# --------------------------------------------------------------------------- the callback


def test_compression_scheduler_validates_its_arguments() -> None:
    with pytest.raises(ValueError, match="window"):
        CompressionScheduler(window=0)
    with pytest.raises(ValueError, match="fraction"):
        CompressionScheduler(freeze_step=2.5)
    assert CompressionScheduler(freeze_step=12.0).freeze_step == 12  # "12" from a CLI or YAML
    assert OneBitStrategy(freeze_step=12.0).options.freeze_step == 12


@pytest.mark.slow
def test_fraction_and_adaptive_switch(tmp_path: Path) -> None:
    records = _fit(
        tmp_path / "frac", OneBitStrategy(freeze_step=0.25, start_method="fork"), steps=16
    )
    assert records[0]["phase"] == "compression"
    numel = sum(v.numel() for v in records[0]["params"].values())
    # 0.25 of 16 steps: exactly 4 warmup steps (int8, the variance window), then 12 compressed
    # exchanges
    assert records[0]["comm_stats"]["bytes_total"] == 4 * warmup_bytes(
        records[0]["params"], 2
    ) + 12 * _per_call(numel, 2) + _rescale_bytes(records[0]["params"], 2, 12)
    sched = CompressionScheduler(freeze_step=10**6, adaptive=True, threshold=0.5, window=3)
    records = _fit(
        tmp_path / "adaptive",
        OneBitStrategy(start_method="fork"),
        steps=20,
        callbacks=[sched],
        model=CharModel(lr=1e-3),
    )
    assert records[0]["phase"] == "compression", "the variance never counted as stable"
    # an adaptive switch's step is not known ahead: the default warmup is bf16, not int4 (whose
    # variance window must end at the switch)
    warm = {h["bytes"] for h in records[0]["history"] if h["phase"] == "warmup"}
    assert warm == {bf16_warmup_bytes(numel, 2)}, warm


def test_switch_step_maps_to_each_optimizers_freeze_parameter() -> None:
    opt = OneBitAdam([torch.nn.Parameter(torch.zeros(3))], freeze_step=7)
    assert opt.switch_step == 7
    z = ZeroOneAdam([torch.nn.Parameter(torch.zeros(3))], var_freeze_step=9)
    assert z.switch_step == 9
    z.switch_step = 11
    assert z.var_freeze_step == 11


class SentPerStep(Callback):
    """Every rank writes the bytes it sent in each optimizer step (0: a local step)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.sent: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        opt = trainer.strategy.optimizers[0]
        self.sent.append(getattr(opt, "_optimizer", opt).comm_stats["bytes_last_step"])

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.save(self.sent, self.out / f"sent{trainer.global_rank}.pt")


@pytest.mark.slow
def test_zero_one_adam_by_name_takes_local_steps_on_a_short_run(tmp_path: Path) -> None:
    """``strategy="zero_one_adam"`` sets ``local_step_scaler`` to 0.4 of the run: on 40 steps
    it synchronises on 32 of them and sends fewer bytes than 1-bit Adam, which synchronises on
    all 40. An explicit ``local_step_scaler`` and a DeepSpeed config keep theirs."""
    runs = {}
    for algorithm in ("zero_one_adam", "onebit_adam"):
        out = tmp_path / algorithm
        out.mkdir()
        strategy = OneBitStrategy(algorithm=algorithm, start_method="fork")
        records = _fit(out, strategy, steps=40, callbacks=[SentPerStep(out)])
        sent = torch.load(out / "sent0.pt")
        runs[algorithm] = records[0], sent, [i + 1 for i, b in enumerate(sent) if b > 0]
    zero_one, zero_one_sent, zero_one_syncs = runs["zero_one_adam"]
    onebit, onebit_sent, onebit_syncs = runs["onebit_adam"]
    assert zero_one["local_step_scaler"] == 16
    assert zero_one_syncs == SYNC_STEPS_OF_40
    assert onebit_syncs == list(range(1, 41))
    # the same variance phase / warmup (int8 codes), then one 1-bit exchange per synchronising step
    numel = sum(v.numel() for v in zero_one["params"].values())
    assert zero_one_sent[:8] == onebit_sent[:8] == [warmup_bytes(zero_one["params"], 2)] * 8
    saved = (40 - len(SYNC_STEPS_OF_40)) * _per_call(numel, 2)
    # (a sync step after local steps first agrees on the parameters without a gradient: one
    # byte per parameter tensor)
    after_local = [t for t in SYNC_STEPS_OF_40 if t - 1 not in SYNC_STEPS_OF_40]
    saved -= len(after_local) * len(zero_one["param_names"])
    assert zero_one["comm_stats"]["bytes_total"] <= onebit["comm_stats"]["bytes_total"] - saved
    # an explicit value, and a DeepSpeed config (DeepSpeed's 32768 where it names none), are kept
    explicit = OneBitStrategy(algorithm="zero_one_adam", local_step_scaler=3, start_method="fork")
    assert _fit(tmp_path / "explicit", explicit, steps=10)[0]["local_step_scaler"] == 3
    config = {"optimizer": {"type": "ZeroOneAdam", "params": {"lr": 3e-3, "var_freeze_step": 4}}}
    from_config = OneBitStrategy.from_deepspeed_config(config, start_method="fork")
    assert _fit(tmp_path / "config", from_config, steps=10)[0]["local_step_scaler"] == 32768


# --------------------------------------------------------------------------- ordinary models


class WithUnusedBias(CharModel):
    """A parameter whose gradient is exactly zero (like a conv bias in front of BatchNorm)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.unused_bias = torch.nn.Parameter(torch.zeros(4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) + 0.0 * self.unused_bias.sum()


@pytest.mark.slow
def test_conversion_and_switch_are_visible_and_zero_gradient_parameters_stay_put(
    tmp_path: Path,
) -> None:
    # Lightning's console messages, as the forked ranks write them (a handler they inherit)
    console = logging.FileHandler(tmp_path / "console.txt")
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(console)
    try:
        records = _fit(
            tmp_path, OneBitStrategy(freeze_step=4, start_method="fork"), model=WithUnusedBias()
        )
    finally:
        logger.removeHandler(console)
        console.close()
    text = (tmp_path / "console.txt").read_text()
    assert text.count("replaced AdamW by OneBitAdam") == 1  # rank 0 only
    assert (
        "bias_correction=True, variance_floor=0.01, preconditioned_exchange=True, "
        "rescale_variance=True" in text
    )
    assert text.count("compression phase (1-bit exchange) from optimizer step 5 on") == 1
    # what the floor compares, not a claim about the gradients: besides the zero-gradient bias
    # it catches embedding rows whose gradients are small, not zero
    floor = re.search(
        r"variance floor \(variance_floor=0\.01\) raised (\d+) coordinates (.*)", text
    )
    assert floor is not None, text
    assert floor[2].startswith(
        "whose variance is too small to precondition (v <= 0.0001 = variance_floor**2 times the "
        "larger of the mean v of its tensor and of its param group): "
    )
    assert "unused_bias (4,): 4" in floor[2] and int(floor[1]) >= 4
    assert "gradient was ~0" not in text
    _assert_same_on_all_ranks(records)
    assert records[0]["params"]["unused_bias"].abs().max() <= 36 * 3e-3  # <= ~lr per step


@pytest.mark.slow
def test_lamb_conversion_takes_its_own_lr(tmp_path: Path) -> None:
    records = _fit(
        tmp_path,
        OneBitStrategy(algorithm="onebit_lamb", lamb_lr=1e-2, freeze_step=4, start_method="fork"),
        model=CharModel(lr=2e-3, scheduler=True),
        steps=12,
    )
    # StepLR(step_size=5, gamma=0.5) over 12 steps, from lamb_lr instead of 2e-3
    assert records[0]["lr"] == [pytest.approx(1e-2 * 0.5**2)]
    with pytest.warns(UserWarning, match="onebit_lamb runs at the converted optimizer's lr=0.003"):
        _fit(
            tmp_path / "default",
            OneBitStrategy(algorithm="onebit_lamb"),  # devices=1: warns in this process
            devices=1,
            steps=2,
        )
