"""Resuming ``OneBitStrategy`` runs: per-rank files, their consistency checks, and a change of
world size while 0/1 Adam is between two synchronisations of its local phase.

Already covered in ``tests/integration/test_strategy.py``: an exact resume with the same world size in the
compression phase for all three algorithms (``test_kill_and_resume_equals_uninterrupted``), and
a resume without any rank file (``test_resume_without_rank_files_resets_error_buffers_with_a_warning``,
warning only). Added here: what those left out —

* 0/1 Adam checkpointed *between* synchronisations (each rank has its own parameters: the rank
  files carry them) resumes exactly with the same world size, and with another world size (1 or
  4 ranks) continues from identical parameters on every rank, with a warning that names what
  was reset and what happened to the per-rank parameters;
* with one rank: a missing rank file and a rank file from another step each warn and really
  reset the error buffers; a present one restores them;
* rank files are written atomically: a temporary file in the same directory, renamed; a crash
  mid-write leaves the previous file intact and no temporary file behind.
"""

from __future__ import annotations

import math
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_onebit import OneBitStrategy
from lightning_onebit.optim import OneBitAdam
from tests.helpers.char_model import CharModel, _fit

# 0/1 Adam: variance phase for steps 1-4; local phase from step 5 with the local-step interval
# 1 (steps 5, 6), 2 (7, 8), then 4 (9-12): after step 10 the ranks are two local steps past
# their last synchronisation (step 8), so their parameters differ.
ZERO_ONE = {
    "algorithm": "zero_one_adam",
    "freeze_step": 4,
    "local_step_scaler": 2,
    "local_step_clipper": 4,
    "start_method": "fork",
}
CKPT_STEP, TOTAL = 10, 16


class AtTrainStart(Callback):
    """Every rank saves, when training starts (after the checkpoint is restored), its
    parameters, its optimizer's phase/step/exchange state, and the warnings since setup."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._catch = warnings.catch_warnings(record=True)
        self._seen = self._catch.__enter__()
        warnings.simplefilter("always")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._catch.__exit__(None, None, None)
        opt = trainer.strategy.onebit_optimizer
        record = {
            "params": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
            "phase": opt.phase,
            "step_count": opt.step_count,
            "exchange": opt.state_dict()["onebit"]["exchange"],
            "warnings": [str(w.message) for w in self._seen],
        }
        torch.save(record, self.out / f"start{trainer.global_rank}.pt")


def _resume(tmp: Path, ckpt: Path, devices: int, steps: int = TOTAL, **strategy: Any) -> tuple:
    tmp.mkdir(parents=True, exist_ok=True)
    kw = {**ZERO_ONE, **strategy}
    if devices == 1:
        kw.pop("start_method")  # one rank runs in this process
    end = _fit(
        tmp,
        OneBitStrategy(**kw),
        devices=devices,
        steps=steps,
        model=CharModel(lr=1e-3),
        ckpt_path=str(ckpt),
        callbacks=[AtTrainStart(tmp)],
        epoch_steps=5,
    )
    start = [torch.load(tmp / f"start{r}.pt", weights_only=False) for r in range(devices)]
    return start, end


def _rank_files(ckpt: Path) -> list[Path]:
    return sorted(ckpt.parent.glob(ckpt.name + ".onebit-rank*"))


# --------------------------------------------------------------------------- 0/1 Adam local phase


@pytest.fixture(scope="module")
def local_phase_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank 0/1 Adam checkpoint taken between two synchronisations (after step 10)."""
    tmp = tmp_path_factory.mktemp("local_phase")
    ckpt = ModelCheckpoint(dirpath=tmp / "ckpt", every_n_train_steps=CKPT_STEP, save_top_k=-1)
    _fit(
        tmp / "first",
        OneBitStrategy(**ZERO_ONE),
        steps=CKPT_STEP,
        model=CharModel(lr=1e-3),
        callbacks=[ckpt],
        epoch_steps=5,
    )
    (path,) = (tmp / "ckpt").glob(f"*step={CKPT_STEP}.ckpt")
    return path


def _saved_models(ckpt: Path) -> list[dict[str, torch.Tensor]]:
    return [torch.load(f, weights_only=False)["model"] for f in _rank_files(ckpt)]


def test_local_phase_checkpoint_keeps_each_ranks_parameters(local_phase_checkpoint: Path) -> None:
    meta = torch.load(local_phase_checkpoint, weights_only=False)["onebit"]
    assert meta == {
        "world_size": 2,
        "optimizer": "ZeroOneAdam",
        "params_differ_across_ranks": True,
        "saved_as": str(local_phase_checkpoint),
    }
    models = _saved_models(local_phase_checkpoint)
    assert len(models) == 2 and all(m is not None for m in models)
    assert any(not torch.equal(models[0][k], models[1][k]) for k in models[0]), (
        "the ranks' parameters are equal: the checkpoint is not between two synchronisations"
    )


def test_local_phase_same_world_size_resumes_exactly(
    local_phase_checkpoint: Path, tmp_path: Path
) -> None:
    full = _fit(
        tmp_path / "full",
        OneBitStrategy(**ZERO_ONE),
        steps=TOTAL,
        model=CharModel(lr=1e-3),
        epoch_steps=5,
    )
    start, end = _resume(tmp_path / "resumed", local_phase_checkpoint, devices=2)
    models = _saved_models(local_phase_checkpoint)
    for r in range(2):
        assert start[r]["phase"] == "local" and start[r]["step_count"] == CKPT_STEP
        assert start[r]["exchange"] is not None  # this rank's error buffers came back
        assert not [w for w in start[r]["warnings"] if "reset" in w], start[r]["warnings"]
        for k, v in models[r].items():  # each rank got its own parameters back
            assert torch.equal(start[r]["params"][k], v), f"rank {r}: {k}"
        assert end[r]["step_count"] == full[r]["step_count"] == TOTAL
        for k, v in full[r]["params"].items():
            torch.testing.assert_close(end[r]["params"][k], v, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("devices", [1, 4])
def test_local_phase_other_world_size_continues_from_identical_parameters(
    local_phase_checkpoint: Path, tmp_path: Path, devices: int
) -> None:
    start, end = _resume(tmp_path, local_phase_checkpoint, devices=devices)
    rank0 = _saved_models(local_phase_checkpoint)[0]
    for r in range(devices):
        assert start[r]["phase"] == "local" and start[r]["step_count"] == CKPT_STEP
        assert start[r]["exchange"] is None  # error buffers reset
        # every rank starts from rank 0's parameters: identical across the new ranks
        for k, v in rank0.items():
            assert torch.equal(start[r]["params"][k], v), f"rank {r}: {k}"
        # one warning, from rank 0
        warned = [w for w in start[r]["warnings"] if "per-rank 1-bit state" in w]
        assert len(warned) == (r == 0), warned
    (warning,) = [w for w in start[0]["warnings"] if "per-rank 1-bit state" in w]
    for part in (
        f"every rank of {devices}",
        f"world size changed from 2 to {devices}",
        "error buffers of those ranks reset to zero",
        "between two synchronisations of 0/1 Adam's local phase",
        "every rank resumes from rank 0's",
        "local steps the other ranks took since the last synchronisation are dropped",
        "all ranks start from identical parameters",
    ):
        assert part in warning, f"{part!r} not in: {warning}"
    for r in range(devices):
        assert end[r]["step_count"] == TOTAL
        assert math.isfinite(end[r]["metrics"]["train_loss"])
        assert all(torch.isfinite(v).all() for v in end[r]["params"].values())


# --------------------------------------------------------------------------- rank-file checks


@pytest.fixture(scope="module")
def single_rank_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """One-rank 1-bit Adam checkpoints after steps 8 and 12 (compression from step 5 on)."""
    tmp = tmp_path_factory.mktemp("single")
    ckpt = ModelCheckpoint(dirpath=tmp / "ckpt", every_n_train_steps=4, save_top_k=-1)
    _fit(
        tmp / "fit",
        OneBitStrategy(freeze_step=4),
        devices=1,
        steps=12,
        callbacks=[ckpt],
        epoch_steps=4,
    )
    return {s: next((tmp / "ckpt").glob(f"*step={s}.ckpt")) for s in (8, 12)}


def _copy(ckpt: Path, to: Path) -> Path:
    to.mkdir(parents=True, exist_ok=True)
    for f in (ckpt, *_rank_files(ckpt)):
        shutil.copy(f, to / f.name)
    return to / ckpt.name


def _single_resume(tmp: Path, ckpt: Path) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    _fit(
        tmp,
        OneBitStrategy(freeze_step=4),
        devices=1,
        steps=14,
        ckpt_path=str(ckpt),
        callbacks=[AtTrainStart(tmp)],
        epoch_steps=4,
    )
    return torch.load(tmp / "start0.pt", weights_only=False)


def test_rank_file_present_restores_the_error_buffers(
    single_rank_checkpoints: dict[int, Path], tmp_path: Path
) -> None:
    start = _single_resume(tmp_path, _copy(single_rank_checkpoints[12], tmp_path / "c"))
    assert start["exchange"] is not None and start["step_count"] == 12
    assert not [w for w in start["warnings"] if "per-rank" in w], start["warnings"]


def _without_saved_as(ckpt: Path) -> None:
    """A checkpoint that does not say where it was saved (as before 0.3): only the rank files
    beside it count."""
    checkpoint = torch.load(ckpt, weights_only=False)
    checkpoint["onebit"].pop("saved_as")
    torch.save(checkpoint, ckpt)


def test_copy_without_rank_files_finds_them_where_it_was_saved(
    single_rank_checkpoints: dict[int, Path], tmp_path: Path
) -> None:
    (tmp_path / "c").mkdir()
    ckpt = tmp_path / "c" / "copy.ckpt"
    shutil.copy(single_rank_checkpoints[12], ckpt)  # e.g. a callback that copies the best one
    start = _single_resume(tmp_path, ckpt)
    assert start["exchange"] is not None and start["step_count"] == 12
    assert not [w for w in start["warnings"] if "per-rank" in w], start["warnings"]


def test_missing_rank_file_warns_and_resets(
    single_rank_checkpoints: dict[int, Path], tmp_path: Path
) -> None:
    ckpt = _copy(single_rank_checkpoints[12], tmp_path / "c")
    for f in _rank_files(ckpt):
        f.unlink()
    _without_saved_as(ckpt)
    start = _single_resume(tmp_path, ckpt)
    assert start["exchange"] is None and start["step_count"] == 12
    (warning,) = [w for w in start["warnings"] if "per-rank 1-bit state" in w]
    assert f"every rank of 1 (rank 0: looked for {ckpt}.onebit-rank0-of-1;" in warning
    assert "found beside" in warning and ": none)" in warning
    assert "error buffers of those ranks reset to zero" in warning
    assert "world size changed" not in warning


def test_rank_file_from_another_step_is_ignored_with_a_warning(
    single_rank_checkpoints: dict[int, Path], tmp_path: Path
) -> None:
    ckpt = _copy(single_rank_checkpoints[12], tmp_path / "c")
    (stale,) = _rank_files(single_rank_checkpoints[8])
    (rank_file,) = _rank_files(ckpt)
    shutil.copy(stale, rank_file)  # e.g. a rank file left over from an overwritten checkpoint
    _without_saved_as(ckpt)
    start = _single_resume(tmp_path, ckpt)
    assert start["exchange"] is None and start["step_count"] == 12
    (warning,) = [w for w in start["warnings"] if "per-rank 1-bit state" in w]
    assert f"looked for {rank_file} (from step 8)" in warning
    assert "error buffers of those ranks reset to zero" in warning


# --------------------------------------------------------------------------- atomic write


def _save_rank_file(checkpoint_path: Path) -> Path:
    """``OneBitStrategy.save_checkpoint`` of a one-rank 1-bit Adam past its first exchange."""
    model = torch.nn.Linear(4, 4)
    opt = OneBitAdam(model.parameters(), freeze_step=1)
    for _ in range(3):
        model(torch.ones(2, 4)).square().sum().backward()
        opt.step()
    strategy = OneBitStrategy()
    strategy.optimizers = [opt]
    strategy.save_checkpoint(
        {"global_step": 3, "optimizer_states": [opt.state_dict()]}, checkpoint_path
    )
    return Path(f"{checkpoint_path}.onebit-rank0-of-1")


def test_rank_files_are_written_to_a_temporary_file_beside_them_then_renamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not via the system temp directory: when that is another filesystem than the
    checkpoint's, the final move is a copy, which a crash can leave half-written."""
    renames: list[tuple[str, str]] = []
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        renames.append((os.fspath(src), os.fspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    rank_file = _save_rank_file(tmp_path / "x.ckpt")
    (src,) = [src for src, dst in renames if dst == str(rank_file)]
    assert os.path.dirname(src) == str(tmp_path), f"temporary file {src} not beside {rank_file}"
    state = torch.load(rank_file, weights_only=False)
    assert state["global_step"] == 3 and state["optimizer"]["onebit"]["exchange"] is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.ckpt", rank_file.name]


def test_a_crash_mid_write_leaves_the_previous_rank_file_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rank_file = _save_rank_file(tmp_path / "x.ckpt")
    before = rank_file.read_bytes()
    real_save = torch.save

    def dies_half_way(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        real_save(obj, f, *args, **kwargs)
        if hasattr(f, "truncate"):
            f.truncate(f.tell() // 2)  # half the bytes are out
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(OSError, match="disk full"):
        _save_rank_file(tmp_path / "x.ckpt")
    monkeypatch.undo()
    assert rank_file.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.ckpt", rank_file.name]
