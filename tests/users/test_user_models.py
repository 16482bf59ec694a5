"""Ordinary users' models under the 1-bit strategies, each next to DDP on the same seed and data.

The models (``tests/helpers/user_models.py``) carry what trips 1-bit optimizers in practice: conv biases
in front of BatchNorm, dead ReLU units, attention key biases, unseen embedding rows, tied
weights, an LR warmup from 0, torch's default betas on short runs; transformers' GPT-2, BERT,
ResNet and ViT are built from configs (no downloads). Every run: 2 fork-started CPU ranks,
``Trainer(strategy=...)`` with the module unchanged (it returns torch Adam/AdamW), a 20% warmup.

What must hold, each measured against ``strategy="ddp"`` + the user's optimizer:
finishes; held-out loss within 1.25x of DDP's (1-bit LAMB: within 2x of DDP + Adam and within
1.25x of the same LAMB never frozen); no parameter beyond 10x its DDP counterpart (``|p|`` max
per tensor, DDP's floored at 1e-3); parameters identical on every rank; the compression phase
reached; and its bytes 32x below fp32 DDP's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_onebit import OneBitStrategy
from tests.helpers.user_models import MODELS, compare, fit_user_model

pytestmark = [pytest.mark.slow, pytest.mark.long]

#: 1-bit LAMB's learning rate per model (``OneBitStrategy(lamb_lr=...)``): LAMB's trust ratio
#: wants its own lr, not Adam's
LAMB_LR = {**dict.fromkeys(MODELS, 1e-2), "bert": 3e-3}  # at 1e-2 BERT's LayerNorms blow up

_ddp: dict[str, list[dict]] = {}


def _ddp_run(name: str, tmp: Path) -> list[dict]:
    if name not in _ddp:  # one DDP run per model, shared by its tests
        _ddp[name] = fit_user_model(name, "ddp_notebook", tmp / "ddp")
    return _ddp[name]


def _problems(c: dict[str, Any], loss_limit: float) -> list[str]:
    out = []
    if c["loss_ratio"] > loss_limit:
        out.append(f"loss {c['loss']:.4f} = {c['loss_ratio']:.2f}x DDP's (limit {loss_limit}x)")
    if c["param_ratio"] > 10:
        out.append(f"{c['param_name']} reaches {c['param_ratio']:.1f}x DDP's largest |value|")
    if not (c["in_sync"] or c["may_differ"]):
        out.append("parameters differ across ranks")
    if c["compressed_steps"] == 0:
        out.append(f"never compressed (phase {c['phase']})")
    else:
        # 32x minus padding and per-chunk scales, which weigh on a model of a few hundred values
        want = 1 / 30 if c["fp32_bytes"] >= 40_000 else 1 / 20
        if c["bytes_ratio"] is None or c["bytes_ratio"] > want:
            out.append(
                f"compression-phase bytes {c['bytes_ratio']} of fp32 DDP's (want <= {want:.3g})"
            )
    return out


#: (model, algorithm) pairs that do not meet the bar yet. Not strict: these runs are chaotic
#: enough that the same code lands on either side of a bar on another CPU (the kernels' SIMD path
#: and the thread count change the rounding; benchmarks/results/user-models-cpus-2026-11-25.md),
#: so a pass is reported (XPASS) without failing the suite.
KNOWN: dict[tuple[str, str], str] = {}


@pytest.mark.parametrize(
    "name, algo",
    [
        pytest.param(
            n,
            a,
            marks=[pytest.mark.xfail(reason=KNOWN[n, a], strict=False)] if (n, a) in KNOWN else [],
        )
        for n in MODELS
        for a in ("onebit_adam", "zero_one_adam")
    ],
)
def test_trains_like_ddp(name: str, algo: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp = tmp_path_factory.mktemp(name)
    records = fit_user_model(name, OneBitStrategy(algorithm=algo, start_method="fork"), tmp / algo)
    c = compare(_ddp_run(name, tmp), records)
    problems = _problems(c, 1.25)
    assert not problems, f"{name} under {algo}: " + "; ".join(problems)


#: models on which 1-bit LAMB (at LAMB_LR) does not meet the bar yet (not strict: see KNOWN)
KNOWN_LAMB = {
    "dead_relu": "1.23-1.37x the loss of LAMB never frozen over seeds 0-2: the freeze of both "
    "the variance and the trust ratio at step 40 of 200 (with an exact fp32 exchange instead of "
    "the 1 bit: 1.21-1.37x; only both live, i.e. LAMB, gets 0.99-1.05x; see docs/tuning.md)",
    "conv_bn": "LAMB never frozen is chaotic at this lr (its loss 0.038-0.32 over seeds 0-2, 8x; "
    "1-bit LAMB's 0.067-0.088, below DDP + Adam's): 0.23-1.78x of it; at lamb_lr 3e-3 and "
    "5e-3 a steady 1.2-3.0x from the switch at 20% (at 80%: 0.77-0.95x; see docs/tuning.md)",
    "vit": "0.92-1.04x the loss of LAMB never frozen over seeds 0-2 here, but q/k_proj.weight "
    "4.9/6.5/11.3x DDP's (and 1.0-2.2x, 9.6-14x on another machine before floored variances "
    "were raised to the mean)",
}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=[pytest.mark.xfail(reason=KNOWN_LAMB[n], strict=False)])
        if n in KNOWN_LAMB
        else n
        for n in MODELS
    ],
)
def test_onebit_lamb_trains_like_lamb(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp = tmp_path_factory.mktemp(name)
    lamb = fit_user_model(
        name,
        OneBitStrategy(algorithm="onebit_lamb", lamb_lr=LAMB_LR[name], start_method="fork"),
        tmp / "onebit_lamb",
    )
    never = fit_user_model(
        name,
        OneBitStrategy(
            algorithm="onebit_lamb", lamb_lr=LAMB_LR[name], freeze_step=10**9, start_method="fork"
        ),
        tmp / "lamb",
    )
    c = compare(_ddp_run(name, tmp), lamb)
    problems = _problems(c, 2.0)
    vs_lamb = lamb[0]["eval_loss"] / never[0]["eval_loss"]
    if vs_lamb > 1.25:
        problems.append(f"loss {vs_lamb:.2f}x that of LAMB never frozen (limit 1.25x)")
    assert not problems, f"{name} under onebit_lamb: " + "; ".join(problems)
