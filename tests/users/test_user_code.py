"""What users' training code expects from the strategy: LR schedulers, checkpoint options, resume.

Each case runs the same LightningModule under ``strategy="ddp"`` and under a 1-bit strategy and
compares what the user observes (the learning rate and betas of every step, parameters after a
resume, files on disk).
"""

from __future__ import annotations

import ast
import logging
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.optim import lr_scheduler as sched
from torch.utils.data import DataLoader, TensorDataset

from lightning_onebit import OneBitStrategy
from tests.helpers.dist import free_port, run_distributed, script_env
from tests.helpers.fit import OneThread

STEPS = 12


class Regression(L.LightningModule):
    """A linear regression whose ``configure_optimizers`` builds Adam and ``make_scheduler``'s."""

    def __init__(
        self, make_scheduler: Callable[[torch.optim.Optimizer], dict], lr: float, width: int = 16
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
        )
        self.make_scheduler = make_scheduler
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        # a monitored value that does not depend on the numerics (ReduceLROnPlateau's decisions
        # must not differ because 1-bit steps change the loss)
        self.log("plateau", float([3, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0][batch_idx % 12]))
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.lr, betas=(0.9, 0.99))
        return {"optimizer": opt, "lr_scheduler": self.make_scheduler(opt)}


class TraceHyperparameters(Callback):
    """The lr and beta1 of every group that each optimizer step used."""

    def __init__(self) -> None:
        self.trace: list[list[tuple[float, float]]] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.trace.append([(g["lr"], g["betas"][0]) for g in optimizer.param_groups])


class WarmupToTarget(sched.LRScheduler):
    """A user's scheduler that keeps its own key in the param groups (like OneCycleLR does)."""

    def __init__(self, optimizer: torch.optim.Optimizer, steps: int) -> None:
        for g in optimizer.param_groups:
            g["warmup_target"] = g["lr"]
        self.steps = steps
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        f = min(1.0, (self.last_epoch + 1) / self.steps)
        return [g["warmup_target"] * f for g in self.optimizer.param_groups]


def _trainer(strategy: Any, devices: int, max_steps: int, **kw: Any) -> L.Trainer:
    """A quiet CPU Trainer (no logger, progress bar, summary; checkpoints only if asked)."""
    kw.setdefault("enable_checkpointing", False)
    kw.setdefault("enable_progress_bar", False)
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=max_steps,
        logger=False,
        enable_model_summary=False,
        **kw,
    )


def _step(s: Any) -> dict:
    return {"scheduler": s, "interval": "step"}


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], dict]] = {
    "OneCycleLR": lambda o: _step(
        sched.OneCycleLR(o, max_lr=1e-2, total_steps=STEPS, cycle_momentum=True)
    ),
    "SequentialLR": lambda o: _step(
        sched.SequentialLR(
            o,
            [
                sched.LinearLR(o, start_factor=0.01, total_iters=4),
                sched.CosineAnnealingLR(o, T_max=8, eta_min=1e-4),
            ],
            milestones=[4],
        )
    ),
    "ChainedScheduler": lambda o: _step(
        sched.ChainedScheduler(
            [sched.ConstantLR(o, factor=0.5, total_iters=3), sched.ExponentialLR(o, gamma=0.8)]
        )
    ),
    "LambdaLR": lambda o: _step(sched.LambdaLR(o, lambda s: 1.0 / (1 + s))),
    "CyclicLR": lambda o: _step(
        sched.CyclicLR(o, base_lr=1e-4, max_lr=1e-2, step_size_up=3, cycle_momentum=True)
    ),
    "ReduceLROnPlateau": lambda o: {
        **_step(sched.ReduceLROnPlateau(o, factor=0.5, patience=1, min_lr=2e-4)),
        "monitor": "plateau",
    },
    "custom": lambda o: _step(WarmupToTarget(o, steps=5)),
}


def _trace(strategy: Any, name: str, lr: float = 3e-3) -> list[list[tuple[float, float]]]:
    x = torch.randn(STEPS * 16, 8, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=16)
    tracer = TraceHyperparameters()
    # the schedule does not depend on the ranks: one in-process rank is enough
    trainer = _trainer(strategy, 1, STEPS, callbacks=[tracer])
    trainer.fit(Regression(SCHEDULERS[name], lr), loader)
    return tracer.trace


@pytest.mark.filterwarnings("ignore:.*(lr_scheduler|decoupled|devices=1).*")
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_every_lr_scheduler_drives_the_converted_optimizer_as_under_ddp(name: str) -> None:
    ddp = _trace("ddp", name)
    assert len(ddp) == STEPS and len({tuple(t) for t in ddp}) > 1  # the schedule moves
    assert _trace(OneBitStrategy(freeze_step=4), name) == ddp
    # 1-bit LAMB with its own lr: the whole schedule scaled (absolute lrs such as OneCycleLR's
    # max_lr, CyclicLR's bounds, eta_min, min_lr included)
    lamb = OneBitStrategy(algorithm="onebit_lamb", lamb_lr=3e-2, freeze_step=4)
    if name == "custom":  # only torch's schedulers are known to hold nothing else
        with pytest.warns(UserWarning, match=r"WarmupToTarget .*\['warmup_target'\]"):
            _trace(lamb, name)
        return
    assert _trace(lamb, name) == [
        [(pytest.approx(lr * 10, rel=1e-9), b1) for lr, b1 in step] for step in ddp
    ]


# --------------------------------------------------------------------------- checkpoints


class Record(Callback):
    """Every rank writes its parameters and optimizer step count at the end of fit (after
    every callback's ``on_train_end``)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        opt = trainer.strategy.optimizers[0]
        record = {
            "params": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
            "step_count": getattr(getattr(opt, "_optimizer", opt), "step_count", None),
        }
        torch.save(record, self.out / f"rank{trainer.global_rank}.pt")


def _no_scheduler(opt: torch.optim.Optimizer) -> dict:
    return _step(sched.LambdaLR(opt, lambda s: 1.0))


def _fit2(
    tmp: Path,
    strategy: Any,
    max_steps: int,
    callbacks: list[Callback] = (),  # type: ignore[assignment]
    ckpt_path: str | Path | None = None,
    epoch_steps: int = 6,
    console: Path | None = None,
    width: int = 16,
    **trainer_kw: Any,
) -> list[dict]:
    """A 2-rank fit (fork-started) of the regression; epochs of ``epoch_steps`` steps, so a run
    resumed at an epoch boundary sees exactly the batches of an uninterrupted one."""
    tmp.mkdir(parents=True, exist_ok=True)
    x = torch.randn(epoch_steps * 16 * 2, 8, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=16, shuffle=True)
    trainer = _trainer(
        strategy,
        2,
        max_steps,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        callbacks=[Record(tmp), OneThread(), *callbacks],
        default_root_dir=tmp,
        **trainer_kw,
    )
    handler = logging.FileHandler(console) if console else None
    logger = logging.getLogger("lightning.pytorch")
    if handler:  # the forked ranks inherit it
        logger.addHandler(handler)
    try:
        trainer.fit(Regression(_no_scheduler, 3e-3, width), loader, ckpt_path=ckpt_path)
    finally:
        if handler:
            logger.removeHandler(handler)
            handler.close()
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _assert_bitwise_equal(a: list[dict], b: list[dict]) -> None:
    for r in range(2):
        assert a[r]["step_count"] == b[r]["step_count"]
        for k, v in a[r]["params"].items():
            assert torch.equal(v, b[r]["params"][k]), f"rank {r}: {k} differs"


def _onebit() -> OneBitStrategy:
    return OneBitStrategy(freeze_step=3, start_method="fork")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _fit2(tmp_path_factory.mktemp("full"), _onebit(), max_steps=12)


@pytest.mark.parametrize("how", ["save_last=link", "save_last=True", "save_top_k", "a copy"])
def test_resume_through_every_checkpoint_option_is_exact(
    uninterrupted: list[dict], tmp_path: Path, how: str
) -> None:
    opts = {
        "save_last=link": {"save_last": "link", "save_top_k": 1},
        "save_last=True": {"save_last": True, "save_top_k": 0},
        "save_top_k": {"save_top_k": 2, "monitor": "plateau", "mode": "max"},
        "a copy": {"save_top_k": -1},
    }[how]
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=6, **opts)
    _fit2(tmp_path / "first", _onebit(), max_steps=6, callbacks=[ckpt])
    if how.startswith("save_last"):
        path = tmp_path / "ckpt" / "last.ckpt"
        assert path.is_symlink() == (how == "save_last=link")
    elif how == "save_top_k":
        path = Path(ckpt.best_model_path)
    else:  # copied elsewhere without its rank files, e.g. by the user's own callback
        (tmp_path / "kept").mkdir()
        path = tmp_path / "kept" / "model.ckpt"
        shutil.copy(ckpt.best_model_path or next((tmp_path / "ckpt").glob("*.ckpt")), path)
    with warnings.catch_warnings():  # (the forked ranks inherit the filter)
        warnings.filterwarnings("error", ".*per-rank 1-bit state.*")  # no reset on any rank
        resumed = _fit2(tmp_path / "second", _onebit(), max_steps=12, ckpt_path=path)
    _assert_bitwise_equal(resumed, uninterrupted)


def test_a_fractional_switch_belongs_to_the_run_across_a_resume(tmp_path: Path) -> None:
    """freeze_step=0.5 of a 16-step run switches after step 8. The run stops after 6 steps
    (one epoch, as a preempted job) and is resumed with max_steps=32: it still switches after
    step 8 (not 0.5 * 32), exactly as a run with freeze_step=8 does."""
    single = _fit2(
        tmp_path / "single", OneBitStrategy(freeze_step=8, start_method="fork"), max_steps=32
    )
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=6, save_top_k=-1)

    def half() -> OneBitStrategy:
        return OneBitStrategy(freeze_step=0.5, start_method="fork")

    _fit2(tmp_path / "a", half(), max_steps=16, max_epochs=1, callbacks=[ckpt])
    console = tmp_path / "console.txt"
    resumed = _fit2(
        tmp_path / "b",
        half(),
        max_steps=32,
        ckpt_path=tmp_path / "ckpt" / "epoch=0-step=6.ckpt",
        console=console,
    )
    _assert_bitwise_equal(resumed, single)
    text = console.read_text()
    assert (
        "1-bit compression starts after optimizer step 8 (freeze_step=0.5 of the run as it "
        "started, from the checkpoint) (OneBitAdam)"
    ) in text
    assert "compression phase (1-bit exchange) from optimizer step 9 on" in text

    # resumed once more, in the compression phase: no "starts after" of a switch long past
    ckpt2 = ModelCheckpoint(dirpath=tmp_path / "ckpt2", every_n_train_steps=12, save_top_k=-1)
    _fit2(tmp_path / "c", half(), max_steps=12, callbacks=[ckpt2])
    console.unlink()
    _fit2(
        tmp_path / "d",
        half(),
        max_steps=48,
        ckpt_path=tmp_path / "ckpt2" / "epoch=1-step=12.ckpt",
        console=console,
    )
    text = console.read_text()
    assert "starts after" not in text
    assert (
        "OneBitAdam: resuming in the compression phase (1-bit exchange since optimizer step 7)"
        in text
    )


def test_checkpoints_hold_what_is_identical_once(tmp_path: Path) -> None:
    """The main checkpoint carries the moments (equal on every rank), each rank file only its
    error buffers: its size is about (n + n / W) float32 values, and the main checkpoint about
    DDP's with Adam."""
    ckpt = lambda d: ModelCheckpoint(dirpath=d, every_n_train_steps=6, save_top_k=-1)  # noqa: E731
    kw: dict[str, Any] = {"max_steps": 6, "width": 4096}
    _fit2(tmp_path / "ddp", "ddp_notebook", callbacks=[ckpt(tmp_path / "c_ddp")], **kw)
    _fit2(tmp_path / "ob", _onebit(), callbacks=[ckpt(tmp_path / "c_ob")], **kw)
    n = sum(p.numel() for p in Regression(_no_scheduler, 1e-3, 4096).parameters())
    ddp = (tmp_path / "c_ddp" / "epoch=0-step=6.ckpt").stat().st_size
    main = tmp_path / "c_ob" / "epoch=0-step=6.ckpt"
    assert main.stat().st_size < ddp + 8 * 1024  # + the 1-bit counters and metadata
    for r in range(2):
        rank_file = Path(f"{main}.onebit-rank{r}-of-2")
        state = torch.load(rank_file, weights_only=False)["optimizer"]
        assert set(state) == {"onebit"}  # no moments: those are in the main checkpoint
        assert rank_file.stat().st_size < 4 * (n + n // 2) + 4 * 1024


def test_zero_one_adam_ending_between_synchronisations_ends_with_identical_ranks(
    tmp_path: Path,
) -> None:
    """Local phase from step 5 with local-step intervals 1, 1, 2, 2, 4: steps 9 and 10 are
    local, so without a synchronisation at the end the ranks would keep their own parameters."""
    strategy = OneBitStrategy(
        algorithm="zero_one_adam",
        freeze_step=4,
        local_step_scaler=2,
        local_step_clipper=4,
        start_method="fork",
    )
    ranks = _fit2(tmp_path, strategy, max_steps=10)
    assert ranks[0]["step_count"] == ranks[1]["step_count"] == 10
    for k, v in ranks[0]["params"].items():
        assert torch.equal(v, ranks[1]["params"][k]), f"{k} differs across ranks"


def test_synchronize_is_a_synchronisation_step_without_a_step() -> None:
    """``synchronize()`` after local steps 5-7 gives what the synchronisation step 8 gives when
    its learning rate is 0 (its own local step then adds nothing): the same parameters,
    momentum and error buffers, on both ranks, bitwise."""
    results = run_distributed(_synchronize_vs_a_zero_lr_sync_step, 2)
    for r in results:
        for k in ("params", "exp_avg", "worker_error", "server_error"):
            assert torch.equal(r["synchronized"][k], r["sync_step"][k]), k
        assert r["synchronized"]["step_count"] == 7 and r["sync_step"]["step_count"] == 8
    assert not torch.equal(results[0]["before"], results[1]["before"])  # they differed
    assert torch.equal(results[0]["synchronized"]["params"], results[1]["synchronized"]["params"])


def _synchronize_vs_a_zero_lr_sync_step(rank: int, world: int) -> dict:
    from lightning_onebit.optim import ZeroOneAdam

    def run(last: str) -> dict:
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 8)
        opt = ZeroOneAdam(
            model.parameters(),
            lr=1e-2,
            weight_decay=0.01,
            var_freeze_step=3,
            local_step_scaler=1,
            local_step_clipper=4,
        )
        gen = torch.Generator().manual_seed(rank)

        def step() -> None:
            opt.zero_grad()
            model(torch.randn(16, 64, generator=gen)).square().mean().backward()
            opt.step()

        for _ in range(7):  # sync at 4 (intervals 1, 2, 4 from there): 5, 6, 7 are local
            step()
        out = {"before": torch.cat([p.detach().flatten().clone() for p in model.parameters()])}
        if last == "synchronize":
            opt.synchronize()
        else:
            opt.param_groups[0]["lr"] = 0.0
            step()  # step 8: a synchronisation step
        ex = opt.state_dict()["onebit"]["exchange"]
        out.update(
            params=torch.cat([p.detach().flatten().clone() for p in model.parameters()]),
            exp_avg=opt.flat.states["exp_avg"].clone(),
            worker_error=ex["worker_error"],
            server_error=ex["server_error"],
            step_count=opt.step_count,
        )
        return out

    synchronized = run("synchronize")
    return {
        "before": synchronized.pop("before"),
        "synchronized": synchronized,
        "sync_step": run("step"),
    }


# --------------------------------------------------------------------------- clean exit

EXIT_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "exit_fit.py"


@pytest.mark.slow
@pytest.mark.parametrize(
    # one algorithm on every change (they share the teardown); scripts/exit_check.py, after the
    # suite in CI, runs each under each launcher
    "algo",
    [
        "onebit_adam",
        pytest.param("zero_one_adam", marks=pytest.mark.long),
        pytest.param("onebit_lamb", marks=pytest.mark.long),
    ],
)
def test_finished_runs_exit_cleanly_on_every_rank(algo: str) -> None:
    """torchrun fails the job when any rank exits non-zero (an abort at interpreter exit
    included): two fits per process, then exit 0 on both ranks."""
    env = script_env()
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), str(EXIT_SCRIPT), algo],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "terminate called" not in out and "Traceback" not in out, out[-3000:]
    for rank in (0, 1):  # (the ranks' lines may interleave in torchrun's merged stdout)
        assert len(re.findall(f"exit-check: rank {rank} pid \\d+ done", run.stdout)) == 1, out


@pytest.mark.slow
def test_a_script_run_leaves_no_process_group_or_thread_to_the_interpreters_exit() -> None:
    """Lightning's popen launcher (the script run as is, rank 1 started by rank 0): after fit,
    both processes exit 0, and when every exit handler has run no process group is left and
    none of gloo's, the store's or the exchange's threads is alive: nothing is left for the
    interpreter's shutdown and C++ static destructors (where a gloo thread that still holds a
    Python object aborts the process)."""
    env = script_env()
    del env["OMP_NUM_THREADS"]  # (OpenMP's worker threads as a user gets them)
    run = subprocess.run(
        [sys.executable, str(EXIT_SCRIPT), "zero_one_adam", "--fits", "1", "--steps", "12",
         "--report-exit"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "terminate called" not in out and "Traceback" not in out, out[-3000:]
    states = re.findall(
        r"exit-state: pid \d+ initialized=(\w+) threads=(\[.*?\]) python_threads=(\[.*?\])",
        run.stdout,
    )
    assert len(states) == 2, run.stdout[-2000:]  # (both ranks: rank 1 writes to the same pipe)
    for initialized, native, python in states:
        assert initialized == "False", out[-2000:]
        names = ast.literal_eval(native) + ast.literal_eval(python)
        assert not [t for t in names if "gloo" in t or "tcpstore" in t or "onebit" in t], names


@pytest.mark.slow
def test_a_diverged_run_prints_one_traceback_not_one_per_rank() -> None:
    """Every rank raises NonFiniteError in the same step: rank 0 prints the traceback, rank 1 one
    line (torchrun prefixes each rank's uncaught-error lines with ``[rankN]:``)."""
    env = script_env()
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), str(EXIT_SCRIPT), "onebit_adam", "diverge"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    err = run.stderr
    assert run.returncode != 0, err[-3000:]
    assert err.count("[rank0]: lightning_onebit.comm.NonFiniteError: 10 steps in a row") == 1, err
    assert "[rank1]: Traceback" not in err, err[-3000:]
    assert err.count("[rank 1] stopped: NonFiniteError (raised on every rank") == 1, err[-3000:]


# --------------------------------------------------------------------------- messages


def _fit1(
    strategy: Any, model: L.LightningModule | None = None, steps: int = 4, **trainer_kw: Any
) -> L.Trainer:
    """A 1-rank, in-process fit of the regression (messages are raised in this process)."""
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=16)
    trainer = _trainer(strategy, 1, steps, **trainer_kw)
    trainer.fit(model or Regression(_no_scheduler, 1e-3), loader)
    return trainer


class TwoOptimizers(Regression):
    def configure_optimizers(self) -> Any:
        return [
            torch.optim.Adam(self.net[0].parameters()),
            torch.optim.Adam(self.net[2].parameters()),
        ]


class OwnZeroOne(Regression):
    def configure_optimizers(self) -> Any:
        from lightning_onebit import ZeroOneAdam

        return ZeroOneAdam(self.parameters(), lr=1e-3, var_freeze_step=2)


def test_the_end_of_fit_says_what_compression_saved(caplog: pytest.LogCaptureFixture) -> None:
    """One line at the end of fit: bytes saved, step time per phase, time saved vs DDP."""
    import logging

    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO), pytest.warns(UserWarning, match="single process"):
            trainer = _fit1(OneBitStrategy(freeze_step=3), steps=8)
    finally:
        logger.removeHandler(caplog.handler)
    line = next(r.message for r in caplog.records if r.message.startswith("lightning-onebit:"))
    m = trainer.callback_metrics
    assert f"{float(m['onebit/step_ms_warmup']):.0f} ms/step over 3 steps" in line
    assert f"{float(m['onebit/step_ms_compression']):.0f} ms/step over 5 steps" in line
    assert f"step speedup vs warmup {float(m['onebit/step_speedup']):.2f}x" in line
    # one process sends nothing, and the line says so (no bytes "sent", no time saved vs DDP)
    assert line.startswith("lightning-onebit: one process: nothing is sent (the exchange runs ")
    assert "sent 0 B" not in line and "per rank" not in line and "vs DDP" not in line


def test_two_optimizers_get_our_message_not_lightnings() -> None:
    with pytest.raises(Exception, match="trains with one optimizer") as err:
        _fit1(OneBitStrategy(), TwoOptimizers(_no_scheduler, 1e-3))
    assert "manual optimization" not in str(err.value)
    assert "one param group per former optimizer" in str(err.value)


def test_single_process_and_a_mismatched_optimizer_are_said(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.warns(UserWarning, match="single process .* has nobody to exchange with"):
        trainer = _fit1(OneBitStrategy(freeze_step=3), steps=8, enable_progress_bar=True)
    # the phase, the bytes ratio and the step speedup on the progress bar under short names
    # (the rich bar wraps long ones), unless turned off or there is no bar; the logger gets
    # the long names
    bar = trainer.progress_bar_metrics
    assert {"1bit", "bytes_x", "step_x"} <= set(bar) and not [k for k in bar if "/" in k]
    metrics = trainer.callback_metrics
    assert float(bar["step_x"]) == pytest.approx(float(metrics["onebit/step_speedup"]))
    assert float(bar["bytes_x"]) == float(metrics["onebit/ratio_vs_ddp"])
    for strategy, kw in (
        (OneBitStrategy(comm_stats_on_progress_bar=False), {"enable_progress_bar": True}),
        (OneBitStrategy(), {}),  # (no progress bar)
    ):
        trainer = _fit1(strategy, **kw)
        assert not {"1bit", "bytes_x", "step_x"} & set(trainer.progress_bar_metrics)
        assert "onebit/phase" in trainer.callback_metrics
    with pytest.warns(
        UserWarning, match=r"returned ZeroOneAdam, but the strategy is 'onebit_lamb'"
    ):
        _fit1(OneBitStrategy(algorithm="onebit_lamb"), OwnZeroOne(_no_scheduler, 1e-3))


def test_interactive_sessions_are_sent_to_our_notebook_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import lightning_onebit._integration.strategy_base as strategy_base

    monkeypatch.setattr(strategy_base, "IS_INTERACTIVE", True)
    with pytest.raises(Exception, match="use strategy='zero_one_adam_notebook'") as err:
        L.Trainer(strategy="zero_one_adam", accelerator="cpu", devices=2)
    assert "ddp_notebook" not in str(err.value)
    L.Trainer(strategy="zero_one_adam_notebook", accelerator="cpu", devices=2)  # accepted


class Unused(Regression):
    """A layer that never takes part in the loss."""

    def __init__(self) -> None:
        super().__init__(_no_scheduler, 1e-3)
        self.unused = torch.nn.Linear(4, 4)


def test_unused_parameters_point_to_our_find_unused_names(tmp_path: Path) -> None:
    with pytest.raises(Exception) as err:
        _fit2u(tmp_path / "a", "onebit_adam_notebook")
    text = str(err.value)
    assert "strategy='onebit_adam_find_unused_parameters_true'" in text, text[-2000:]
    assert "ddp_find_unused_parameters_true" not in text
    _fit2u(tmp_path / "b", "onebit_adam_notebook_find_unused_parameters_true")  # trains


def _fit2u(tmp: Path, strategy: str) -> None:
    x = torch.randn(8 * 32, 8, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=16)
    _trainer(strategy, 2, 6, callbacks=[OneThread()], default_root_dir=tmp).fit(Unused(), loader)


def test_the_pytorch_lightning_package_gets_a_message_that_says_what_to_import() -> None:
    code = (
        "import pytorch_lightning as pl, lightning_onebit\n"
        "pl.Trainer(strategy='onebit_lamb', accelerator='cpu', devices=2)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "is a lightning_onebit strategy for the `lightning` package" in run.stderr, run.stderr


def test_a_1bit_optimizer_under_plain_ddp_is_said_once() -> None:
    """Gradients DDP already averaged reach the optimizer: one warning, from rank 0; none when
    each rank hands it its own gradients."""
    ddp, local = run_distributed(_warnings_under, 2, "ddp"), run_distributed(_warnings_under, 2, "")
    assert [len(w) for w in ddp] == [1, 0]
    assert "received identical gradients on all 2 ranks" in ddp[0][0]
    assert "DistributedDataParallel" in ddp[0][0]
    assert local == [[], []]


def _warnings_under(rank: int, world: int, wrapper: str) -> list[str]:
    from lightning_onebit import OneBitAdam

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=2)
    if wrapper == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    gen = torch.Generator().manual_seed(rank)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(16, 8, generator=gen)).square().mean().backward()
            opt.step()
    return [str(w.message) for w in seen if "identical gradients" in str(w.message)]


class Finetune(L.LightningModule):
    """A backbone that Lightning's ``BackboneFinetuning`` freezes before training (so DDP, built
    after, never registers it) and adds to the optimizer at the start of epoch 1."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh())
        self.head = torch.nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=3e-3)


def _fit_finetune(tmp: Path, algo: str, freeze_step: int) -> list[dict]:
    from lightning.pytorch.callbacks import BackboneFinetuning

    x = torch.randn(6 * 16 * 2, 8, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=16, shuffle=True)
    strategy = OneBitStrategy(algorithm=algo, freeze_step=freeze_step, start_method="fork")
    unfreeze = BackboneFinetuning(unfreeze_backbone_at_epoch=1, verbose=False)
    callbacks = [Record(tmp), OneThread(), unfreeze]
    _trainer(strategy, 2, 24, callbacks=callbacks, default_root_dir=tmp).fit(Finetune(), loader)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("algo", ["onebit_adam", "zero_one_adam", "onebit_lamb"])
def test_a_backbone_unfrozen_mid_run_trains_in_sync(algo: str, tmp_path: Path) -> None:
    """``BackboneFinetuning`` unfreezes the backbone after step 6, before the switch (12): the
    optimizer averages its warmup gradients itself (DDP does not know it; under plain DDP the
    ranks' backbones drift apart silently, Lightning issue #20340), and after the switch the
    1-bit exchange carries it with the rest. Before: every rank trained its own backbone."""
    records = _fit_finetune(tmp_path, algo, freeze_step=12)
    initial = Finetune().state_dict()
    for k, v in records[0]["params"].items():
        assert torch.equal(v, records[1]["params"][k]), f"{k} differs across ranks"
        assert not torch.equal(v, initial[k]), f"{k} did not train"
    assert records[0]["step_count"] == 24


def test_a_backbone_unfrozen_after_the_switch_is_said_before_training(tmp_path: Path) -> None:
    with pytest.raises(Exception) as err:
        _fit_finetune(tmp_path, "onebit_adam", freeze_step=4)
    text = str(err.value)
    said = "BackboneFinetuning(unfreeze_backbone_at_epoch=1) adds the backbone to the optimizer "
    assert said + "after optimizer step 6" in text, text[-2000:]
    assert "switches to 1-bit compression after step 4" in text and "freeze_step=N" in text
    assert not list(tmp_path.glob("rank*.pt"))  # (it never got to train)


class SaveTrace(TraceHyperparameters):
    """The hyperparameters of every optimizer step, the global step and the optimizer's own
    step count, saved by every rank at the end of fit (the ranks are forked)."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        opt = trainer.strategy.optimizers[0]
        record = {
            "trace": self.trace,
            "global_step": trainer.global_step,
            "step_count": getattr(getattr(opt, "_optimizer", opt), "step_count", None),
            "params": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
            # what a LearningRateMonitor logged, per name
            "logged": {k: v for c in trainer.callbacks for k, v in getattr(c, "lrs", {}).items()},
        }
        torch.save(record, self.out / f"trace{trainer.global_rank}.pt")


def _fit_with(tmp: Path, strategy: Any, callbacks: list[Callback], max_epochs: int) -> list[dict]:
    from lightning.pytorch.loggers import CSVLogger

    tmp.mkdir(parents=True, exist_ok=True)
    x = torch.randn(6 * 16 * 2, 8, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=16)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=max_epochs,
        logger=CSVLogger(tmp, name="logs", version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        callbacks=[SaveTrace(tmp), OneThread(), *callbacks],
    )
    model = Regression(lambda o: _step(sched.ExponentialLR(o, gamma=0.9)), 3e-3)
    trainer.fit(model, loader)
    return [torch.load(tmp / f"trace{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.filterwarnings("ignore:.*(SWA|swa|lr_scheduler).*")
def test_lightnings_training_callbacks_drive_the_1bit_optimizer_as_under_ddp(
    tmp_path: Path,
) -> None:
    """``StochasticWeightAveraging`` (swaps the scheduler for SWALR mid-run and averages the
    weights), ``GradientAccumulationScheduler`` (accumulates 1, then 2, then 3 batches per step)
    and ``LearningRateMonitor``, together: every optimizer step has DDP's learning rate and
    betas, there are as many steps as under DDP (the optimizer's own counter agrees), the
    monitor logs what the optimizer used, and the ranks end with the same (averaged) weights."""
    from lightning.pytorch.callbacks import (
        GradientAccumulationScheduler,
        LearningRateMonitor,
        StochasticWeightAveraging,
    )

    def callbacks() -> list[Callback]:
        return [
            StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=3, annealing_epochs=2),
            GradientAccumulationScheduler(scheduling={0: 1, 2: 2, 4: 3}),
            LearningRateMonitor("step"),
        ]

    ddp = _fit_with(tmp_path / "ddp", "ddp_notebook", callbacks(), 6)
    ours = _fit_with(tmp_path / "onebit", OneBitStrategy(start_method="fork"), callbacks(), 6)
    assert ddp[0]["global_step"] == 6 + 6 + 3 + 3 + 2 + 2  # the accumulation schedule
    assert len({tuple(t) for t in ddp[0]["trace"]}) > 3  # the lr moves (decay, then SWALR)
    for r in range(2):
        assert ours[r]["trace"] == ddp[r]["trace"]
        assert ours[r]["global_step"] == ours[r]["step_count"] == ddp[r]["global_step"]
        for k, v in ours[0]["params"].items():
            assert torch.equal(v, ours[r]["params"][k]), f"{k} differs across ranks"
            assert not torch.equal(v, ddp[0]["params"][k])  # (1-bit steps: not DDP's weights)
    logged = ddp[0]["logged"]["lr-Adam"]
    assert len(logged) == 6 * 6 and logged[0] == 3e-3  # (every batch, log_every_n_steps=1)
    assert ours[0]["logged"] == {"lr-OneBitAdam": logged}


def test_early_stopping_stops_every_rank_where_ddp_stops(tmp_path: Path) -> None:
    """EarlyStopping on a metric that does not depend on the numerics: the same epoch as DDP,
    on both ranks (a rank that stopped alone would leave the other waiting in an exchange)."""
    from lightning.pytorch.callbacks import EarlyStopping

    def stop() -> list[Callback]:
        return [EarlyStopping("plateau", patience=2, check_on_train_epoch_end=True)]

    ddp = _fit_with(tmp_path / "ddp", "ddp_notebook", stop(), 20)
    ours = _fit_with(tmp_path / "onebit", OneBitStrategy(start_method="fork"), stop(), 20)
    assert ddp[0]["global_step"] < 20 * 6
    assert [r["global_step"] for r in ours] == [r["global_step"] for r in ddp]
    assert [r["step_count"] for r in ours] == [r["global_step"] for r in ddp]


@pytest.mark.parametrize(
    "algo, kw",
    [
        # (rescale_variance off: it measures the averaged gradients' recent scale in the warmup,
        # which torch's Adam does not keep; resumed at the switch it takes the variance's mean)
        ("onebit_adam", {"rescale_variance": False}),
        # (0/1 Adam's phase 1 floors the variance at each variance step, which Adam does not:
        # without the floor its phase 1 is Adam, and the resume is exact)
        ("zero_one_adam", {"variance_floor": 0.0, "rescale_variance": False}),
    ],
)
def test_a_ddp_checkpoint_resumes_as_if_the_1bit_strategy_had_run_from_the_start(
    algo: str, kw: dict, tmp_path: Path
) -> None:
    """A run under strategy="ddp" with torch Adam, resumed from its checkpoint under a 1-bit
    strategy that switches at that very step: with DDP's fp32 average the warmup is Adam
    (bias-corrected), so the result is the 1-bit run's from step 0, to float rounding (the step
    count continues, and the switch comes at step 12)."""
    strategy = lambda: OneBitStrategy(  # noqa: E731
        algorithm=algo, freeze_step=12, average_dtype="float32", start_method="fork", **kw
    )
    ddp = _ddp_checkpoint(tmp_path)
    trace = SaveTrace(tmp_path / "resumed")
    resumed = _fit2(tmp_path / "resumed", strategy(), 24, callbacks=[trace], ckpt_path=ddp)
    whole = _fit2(tmp_path / "whole", strategy(), 24)
    assert len(torch.load(tmp_path / "resumed" / "trace0.pt")["trace"]) == 12  # (it resumed)
    for r in range(2):
        assert resumed[r]["step_count"] == whole[r]["step_count"] == 24
        _assert_params_close(resumed[r]["params"], whole[r]["params"], atol=1e-6)


@pytest.mark.slow
def test_a_ddp_job_switched_to_1bit_adam_follows_a_1bit_run_only_with_an_fp32_warmup(
    tmp_path: Path,
) -> None:
    """What docs/checkpoints.md says (benchmarks/ddp_resume.py measures it): 100 steps after the
    switch the DDP job resumed as 1-bit Adam is within float rounding of a 1-bit run from step 0
    whose warmup averaged in fp32, as DDP does; one whose warmup averaged in bf16 (the default)
    ended its warmup elsewhere."""
    ddp = _ddp_checkpoint(tmp_path)

    def onebit(average_dtype: str) -> OneBitStrategy:
        return OneBitStrategy(
            freeze_step=12,
            rescale_variance=False,
            average_dtype=average_dtype,
            start_method="fork",
        )

    # (resumed at the switch, the run has no warmup step: its average_dtype does not matter)
    resumed = _fit2(tmp_path / "resumed", onebit("float32"), 112, ckpt_path=ddp)[0]["params"]
    fp32 = _fit2(tmp_path / "fp32", onebit("float32"), 112)[0]["params"]
    bf16 = _fit2(tmp_path / "bf16", onebit("bf16"), 112)[0]["params"]
    _assert_params_close(resumed, fp32, atol=1e-6)
    assert max(float((v - bf16[k]).abs().max()) for k, v in resumed.items()) > 1e-4


def test_a_ddp_checkpoint_past_the_switch_names_one_switch_step(tmp_path: Path) -> None:
    """Resumed past its freeze_step, the run compresses from its first step, and every line that
    names the switch names that step: one line for the switch, no warmup in the summary."""
    ddp = _ddp_checkpoint(tmp_path)
    console = tmp_path / "console.txt"
    strategy = OneBitStrategy(freeze_step=8, start_method="fork")
    assert (
        _fit2(tmp_path / "b", strategy, 24, ckpt_path=ddp, console=console)[0]["step_count"] == 24
    )
    lines = console.read_text().splitlines()
    assert (
        "OneBitAdam: compression phase (1-bit exchange) from optimizer step 13 on, the first step "
        "of this fit (its checkpoint's step count has reached freeze_step=8)"
    ) in lines
    steps = [int(n) for line in lines for n in re.findall(r"(?:optimizer|after) step (\d+)", line)]
    assert steps == [13], lines  # (not 'from the next step on', step 14, or 'after step 8')
    (summary,) = [line for line in lines if line.startswith("lightning-onebit:")]
    assert "warmup" not in summary and "compression" in summary and "over 12 steps" in summary
    assert summary.startswith("lightning-onebit: sent ")  # (two ranks: the bytes)


def _ddp_checkpoint(tmp: Path) -> Path:
    """The checkpoint of 12 steps of the regression under strategy="ddp" with torch Adam."""
    ckpt = ModelCheckpoint(dirpath=tmp / "ddp" / "ckpt", every_n_train_steps=12)
    _fit2(tmp / "ddp", "ddp_notebook", 12, callbacks=[ckpt])
    (path,) = (tmp / "ddp" / "ckpt").glob("*.ckpt")  # (written by the forked rank 0)
    return path


def _assert_params_close(a: dict, b: dict, atol: float) -> None:
    for k, v in a.items():
        torch.testing.assert_close(v, b[k], rtol=0, atol=atol, msg=k)


def test_a_ddp_checkpoint_resumed_under_1bit_lamb_gets_lamb_lr(tmp_path: Path) -> None:
    """Resuming a torch Adam checkpoint under 1-bit LAMB with its own lamb_lr: the restored
    learning rates (param groups and scheduler) are scaled as the conversion scales
    configure_optimizers', the trust ratios start from the first resumed step's (not 0.1 of
    it), and compression starts after that step."""
    ddp = _ddp_checkpoint(tmp_path)
    lamb = OneBitStrategy(
        algorithm="onebit_lamb", lamb_lr=3e-2, freeze_step=12, start_method="fork"
    )
    trace, ratios = SaveTrace(tmp_path / "lamb"), LambRatios(tmp_path / "lamb")
    resumed = _fit2(tmp_path / "lamb", lamb, 24, callbacks=[trace, ratios], ckpt_path=ddp)
    steps = [torch.load(tmp_path / "lamb" / f"trace{r}.pt", weights_only=False) for r in range(2)]
    assert [t[0][0] for t in steps[0]["trace"]] == [pytest.approx(3e-2)] * 12  # Adam's 3e-3 x 10
    for k, v in resumed[0]["params"].items():
        assert torch.equal(v, resumed[1]["params"][k]) and v.isfinite().all(), k
    assert resumed[0]["step_count"] == 24
    seen = torch.load(tmp_path / "lamb" / "ratios0.pt")
    assert seen["phases"] == ["warmup"] + ["compression"] * 11  # measured at 13, then switched
    # frozen at the first resumed step's trust ratios themselves (an average from 0: 0.1 of them)
    assert seen["frozen"] == pytest.approx(seen["first"], rel=1e-6) and min(seen["first"]) > 0


class LambRatios(Callback):
    """1-bit LAMB's phase at each step, its trust ratios at the first step of the fit and its
    frozen ones at the end (rank 0)."""

    def __init__(self, out: Path) -> None:
        self.out, self.phases, self.first = out, [], None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.phases.append(str(trainer.strategy.onebit_optimizer.phase))  # (the step's)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.first is None:
            self.first = trainer.strategy.onebit_optimizer.lamb_coeffs

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        opt = trainer.strategy.onebit_optimizer
        frozen = opt.flat.scalars["lamb_coeff_freeze"].tolist()
        record = {"phases": self.phases, "first": self.first, "frozen": frozen}
        torch.save(record, self.out / f"ratios{trainer.global_rank}.pt")


def test_a_1bit_checkpoint_resumes_under_ddp(tmp_path: Path) -> None:
    """Going back: a 1-bit Adam checkpoint taken in its warmup (Adam, with DDP's fp32 average),
    resumed under strategy="ddp" with torch Adam, continues as a DDP run from step 0 would
    (torch's Adam needs each parameter's ``step``, which the state dict carries); one taken in
    the compression phase loads and trains on."""
    warm = ModelCheckpoint(dirpath=tmp_path / "warm", every_n_train_steps=12)
    fp32 = OneBitStrategy(freeze_step=20, average_dtype="float32", start_method="fork")
    _fit2(tmp_path / "a", fp32, 12, callbacks=[warm])
    (path,) = (tmp_path / "warm").glob("*.ckpt")
    resumed = _fit2(tmp_path / "b", "ddp_notebook", 24, ckpt_path=path)
    whole = _fit2(tmp_path / "c", "ddp_notebook", 24)
    _assert_params_close(resumed[0]["params"], whole[0]["params"], atol=1e-6)

    late = ModelCheckpoint(dirpath=tmp_path / "late", every_n_train_steps=12)
    _fit2(tmp_path / "d", OneBitStrategy(freeze_step=4, start_method="fork"), 12, callbacks=[late])
    (path,) = (tmp_path / "late").glob("*.ckpt")
    after = _fit2(tmp_path / "e", "ddp_notebook", 24, ckpt_path=path)
    for k, v in after[0]["params"].items():
        assert torch.equal(v, after[1]["params"][k]) and v.isfinite().all(), k


@pytest.mark.slow
def test_a_forked_run_after_a_single_process_run_in_the_same_process() -> None:
    """A notebook's order: a 1-process fit, then a fork-started 2-rank fit from the same
    process. The forked ranks inherit the first run's record of the default group it created;
    replacing it there must not release the parent's group (its destructor waited forever for
    threads that stayed in the parent)."""
    code = (
        "import sys; sys.argv = ['x']\n"
        "import lightning as L, torch\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "import tests.scripts.exit_fit as E\n"
        "data = torch.randint(0, 32, (64, 9), generator=torch.Generator().manual_seed(0))\n"
        "for devices, method in ((1, 'popen'), (2, 'fork')):\n"
        "    trainer = L.Trainer(strategy=E._strategy('onebit_adam', True, method),\n"
        "        accelerator='cpu', devices=devices, max_steps=4, logger=False,\n"
        "        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)\n"
        "    trainer.fit(E.Attention(), DataLoader(TensorDataset(data), batch_size=16))\n"
        "print('both fits done', flush=True)\n"
    )
    env = script_env()
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "both fits done" in run.stdout, out[-3000:]
