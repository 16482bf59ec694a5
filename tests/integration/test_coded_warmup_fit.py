"""``OneBitStrategy(average_dtype="int4")`` through the Trainer on 2 fork-started CPU ranks: the
optimizer averages the warmup's gradients in integer codes (DDP's hook sends nothing), each
warmup step sends the exchange's records, the fit trains like the bf16 warmup, and a run
stopped in the warmup resumes exactly (the error buffers in the rank files)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_onebit import OneBitStrategy
from tests.helpers.char_model import CharModel, _fit, coded_bytes


def _strategy(dtype: str, **options: object) -> OneBitStrategy:
    window = {"variance_window": 7} if dtype == "int4" else {}  # steps 14-20 in int8
    return OneBitStrategy(
        freeze_step=20, average_dtype=dtype, start_method="fork", **window, **options
    )


def test_an_int4_warmup_sends_its_codes_and_trains_like_the_bf16_one(tmp_path: Path) -> None:
    int4 = _fit(tmp_path / "int4", _strategy("int4"), steps=40)
    bf16 = _fit(tmp_path / "bf16", _strategy("bf16"), steps=40)
    sizes = [int(p.numel()) for p in int4[0]["params"].values()]
    per_call = {b: coded_bytes(sizes, 2, b) for b in (4, 8)}
    for r in int4:
        assert r["phase"] == "compression" and r["skipped_steps"] == 0
        warmup = [h["bytes"] for h in r["history"] if h["phase"] == "warmup"]
        # the exchange's records, the variance window (7 steps) in int8; DDP's hook
        # sends nothing
        assert warmup == [per_call[4]] * 13 + [per_call[8]] * 7
    for a, b in zip(int4[0]["params"].values(), int4[1]["params"].values(), strict=True):
        assert torch.equal(a, b)
    # the warmup's average rounds more, but feeds the rounding back: the same loss, nearly
    late = [sum(h["loss"] for h in r["history"][-10:]) / 10 for r in (int4[0], bf16[0])]
    assert late[0] < 1.03 * late[1], late
    ratios = [r["metrics"]["onebit/ratio_vs_ddp"] for r in (int4[0], bf16[0])]
    assert ratios[0] > 1.3 * ratios[1], ratios


@pytest.mark.slow
@pytest.mark.parametrize("stop", [8, 16])  # before the variance window (steps 14-20), inside it
def test_a_run_stopped_in_the_int4_warmup_resumes_exactly(tmp_path: Path, stop: int) -> None:
    def kw() -> dict:  # a fresh model per fit: the fork launcher copies rank 0's weights back
        return {"model": CharModel(lr=1e-3), "epoch_steps": 8}

    def int4() -> OneBitStrategy:  # overlapped with backward in several buckets
        return _strategy("int4", overlap_bucket_mb=0.01)

    full = _fit(tmp_path / "full", int4(), steps=24, **kw())
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=8, save_top_k=-1)
    _fit(tmp_path / "first", int4(), steps=stop, callbacks=[ckpt], **kw())
    path = tmp_path / "ckpt" / f"epoch={stop // 8 - 1}-step={stop}.ckpt"
    rank_file = torch.load(f"{path}.onebit-rank1-of-2", weights_only=True)
    assert len(rank_file["optimizer"]["onebit"]["coded_average"]["buckets"]) > 2
    window = torch.load(path, weights_only=True)["optimizer_states"][0]["onebit"]
    assert (window["window_variance"] is not None) == (stop > 13)
    resumed = _fit(tmp_path / "second", int4(), steps=24, ckpt_path=str(path), **kw())
    for r in range(2):
        assert resumed[r]["step_count"] == full[r]["step_count"] == 24
        for k, v in full[r]["params"].items():
            assert torch.equal(resumed[r]["params"][k], v), k
