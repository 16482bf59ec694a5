"""Per-rank 1-bit files are loaded so that nothing in them can run code.

* Every kind of file the strategies write (``tests/data/rank_files``, written by the release
  before this check) loads with ``weights_only=True`` and resumes a 2-rank run exactly as it was
  saved: the error buffers in the file are the optimizer's after the restore.
* A rank file replaced by a pickle whose loading would create a file is refused on every rank
  before training, for each kind, with ``weights_only`` left to its default and with
  ``weights_only=True``; the file is not created, and the message names the rank file and the
  two ways on.
* A file of the right format but foreign content (a model's state dict, an extra entry, an
  object of another class) is refused, even with ``weights_only=False``.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_onebit import OneBitFabricStrategy, OneBitStrategy, RankFileError
from lightning_onebit._integration.rank_files import load_rank_file
from tests.data.make_rank_files import STEPS, Tiny, data, tiny_model

FIXTURES = Path(__file__).parents[1] / "data" / "rank_files"
KINDS = {
    "trainer_onebit_adam": {"freeze_step": 4},
    "trainer_zero_one_local": {
        "algorithm": "zero_one_adam",
        "freeze_step": 2,
        "local_step_scaler": 2,
        "local_step_clipper": 4,
    },
    "trainer_lamb_overlap": {
        "algorithm": "onebit_lamb",
        "freeze_step": 4,
        "overlap_bucket_mb": 0.0004,
    },
}


class Payload:
    """Unpickling it touches ``path``: what a tampered rank file could do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return Path.touch, (self.path,)


def _copy(kind: str, to: Path) -> Path:
    shutil.copytree(FIXTURES / kind, to)
    return to / "last.ckpt"


def _rank_file(ckpt: Path, rank: int) -> Path:
    return Path(f"{ckpt}.onebit-rank{rank}-of-2")


class RestoredExchange(Callback):
    """Each rank saves the error buffers its optimizer holds when training starts."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        opt = trainer.strategy.onebit_optimizer
        torch.save(opt.rank_state_dict(), self.out / f"restored{trainer.global_rank}.pt")


def _resume(tmp: Path, ckpt: Path, weights_only: bool | None = None, **strategy: Any) -> None:
    trainer = L.Trainer(
        strategy=OneBitStrategy(start_method="fork", **strategy),
        accelerator="cpu",
        devices=2,
        max_steps=STEPS + 2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[RestoredExchange(tmp)],
        default_root_dir=tmp,
    )
    loader = DataLoader(data(), batch_size=16)
    trainer.fit(Tiny(), loader, ckpt_path=str(ckpt), weights_only=weights_only)


def _tensors(x: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return {prefix: x}
    items = (
        x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list | tuple) else ()
    )
    return {k: v for key, value in items for k, v in _tensors(value, f"{prefix}/{key}").items()}


@pytest.mark.parametrize("kind", [*KINDS, "fabric_onebit_adam"])
def test_every_kind_of_rank_file_loads_with_weights_only(kind: str) -> None:
    for rank in range(2):
        f = _rank_file(FIXTURES / kind / "last.ckpt", rank)
        safe, full = load_rank_file(str(f)), torch.load(f, weights_only=False)
        assert safe.keys() == full.keys() and safe["rank"] == rank
        a, b = _tensors(safe), _tensors(full)
        assert a.keys() == b.keys() and a, kind
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_files_of_the_previous_release_resume_exactly(kind: str, tmp_path: Path) -> None:
    ckpt = _copy(kind, tmp_path / "ckpt")
    saved = [torch.load(_rank_file(ckpt, r), weights_only=False)["optimizer"] for r in range(2)]
    _resume(tmp_path, ckpt, weights_only=True, **KINDS[kind])
    for r in range(2):
        restored = torch.load(tmp_path / f"restored{r}.pt", weights_only=True)
        a, b = _tensors(restored.get("onebit", restored)), _tensors(saved[r].get("onebit", {}))
        if "state" in saved[r]:  # 0/1 Adam between synchronisations: the whole state dict
            a, b = _tensors(restored["state"]), _tensors(saved[r]["state"])
        assert a.keys() == b.keys() and a, kind
        for k in a:
            assert torch.equal(a[k], b[k]), f"{kind}: rank {r} {k} not restored"


def _tamper(ckpt: Path, rank: int, marker: Path, with_torch: bool = True) -> Path:
    """Replace rank ``rank``'s file by a pickle (written by ``torch.save``, or by ``pickle`` in
    its newest protocol) whose loading would create ``marker``."""
    f = _rank_file(ckpt, rank)
    payload = {"optimizer": Payload(marker)}
    if with_torch:
        torch.save(payload, f)
    else:
        with open(f, "wb") as out:
            pickle.dump(payload, out, protocol=pickle.HIGHEST_PROTOCOL)
    return f


@pytest.mark.slow
@pytest.mark.parametrize("weights_only", [None, True])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_tampered_rank_file_is_refused_on_every_rank_and_runs_nothing(
    kind: str, weights_only: bool | None, tmp_path: Path
) -> None:
    ckpt = _copy(kind, tmp_path / "ckpt")
    marker = tmp_path / "created-by-the-payload"
    tampered = _tamper(ckpt, 1, marker, with_torch=weights_only is None)
    with pytest.raises(Exception) as refused:  # raised in rank 1 and rank 0, through the launcher
        _resume(tmp_path, ckpt, weights_only=weights_only, **KINDS[kind])
    text = str(refused.value)
    assert f"refused to load the per-rank 1-bit file {tampered}" in text, text
    assert "weights_only=True" in text and "delete it to resume" in text, text
    if weights_only is None:  # torch.save's pickle: the unpickler names what it refused
        assert "Unsupported global: GLOBAL getattr was not an allowed global" in text, text
    assert "rank 0: " not in text, "rank 0's file was intact"
    assert not marker.exists(), "the tampered file's code ran"
    assert not list(tmp_path.glob("restored*.pt")), "a rank started training"


def _fabric_resume(fabric: L.Fabric, ckpt: Path) -> None:
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    fabric.load(ckpt, {"model": model, "optimizer": opt})


@pytest.mark.slow
def test_fabric_refuses_a_tampered_rank_file_and_loads_an_intact_one(tmp_path: Path) -> None:
    ckpt = _copy("fabric_onebit_adam", tmp_path / "ckpt")
    fabric = L.Fabric(
        strategy=OneBitFabricStrategy(freeze_step=4, start_method="fork"),
        accelerator="cpu",
        devices=2,
    )
    fabric.launch(_fabric_resume, ckpt)  # intact: loads
    marker = tmp_path / "created-by-the-payload"
    tampered = _tamper(ckpt, 0, marker)
    with pytest.raises(Exception, match="refused to load the per-rank 1-bit file") as refused:
        fabric.launch(_fabric_resume, ckpt)
    assert str(tampered) in str(refused.value)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ({"weight": torch.ones(2)}, "its entries are ['weight']"),
        (
            {"world_size": 2, "rank": 0, "global_step": 8, "optimizer": {}, "model": None, "x": 1},
            "its entries are",
        ),
        (
            {
                "world_size": 2,
                "rank": 0,
                "global_step": 8,
                "optimizer": {"onebit": {"exchange": torch.nn.Linear(1, 1)}},
                "model": None,
            },
            "['optimizer']['onebit']['exchange'] is a torch.nn.modules.linear.Linear",
        ),
        ([torch.ones(2)], "it holds a list, not a dict"),
    ],
)
@pytest.mark.parametrize("weights_only", [None, False])
def test_foreign_content_is_refused_even_without_weights_only(
    content: Any, why: str, weights_only: bool | None, tmp_path: Path
) -> None:
    f = tmp_path / "x.ckpt.onebit-rank0-of-2"
    torch.save(content, f)
    with pytest.raises(RankFileError) as refused:
        load_rank_file(str(f), weights_only=weights_only)
    text = str(refused.value)
    assert f"refused to load the per-rank 1-bit file {f}" in text
    if weights_only is None and isinstance(content, dict) and "exchange" in str(content):
        assert "Unsupported global" in text  # the module is refused by the unpickler first
    else:
        assert why in text, text
