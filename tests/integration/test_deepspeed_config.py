"""DeepSpeed JSON configs of the 1-bit optimizers (DeepSpeed's tutorials' own, in
``examples/configs/deepspeed``) build the strategy, train, and say what they do not apply."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_onebit import OneBitFabricStrategy, OneBitStrategy
from lightning_onebit._integration.deepspeed import read
from lightning_onebit._integration.front_end import FABRIC, TRAINER

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs" / "deepspeed"


def test_the_tutorial_configs_map_every_parameter() -> None:
    algo, options, hparams, notes = read(CONFIGS / "onebit_adam.json", TRAINER)
    assert (algo, options, hparams) == (
        "onebit_adam",
        {"algorithm": "onebit_adam", "freeze_step": 23000},
        {"lr": 4e-4},
    )
    algo, options, hparams, _ = read(CONFIGS / "zero_one_adam.json", TRAINER)
    assert options == {
        "algorithm": "zero_one_adam",
        "freeze_step": 1000,  # DeepSpeed's var_freeze_step
        "var_update_scaler": 16,
        "local_step_scaler": 1000,
        "local_step_clipper": 16,
    }
    assert hparams == {"lr": 1e-3, "weight_decay": 0.01}
    algo, options, hparams, _ = read(CONFIGS / "onebit_lamb.json", TRAINER)
    assert options == {
        "algorithm": "onebit_lamb",
        "freeze_step": 1000,
        "max_coeff": 0.3,
        "min_coeff": 0.01,
        "coeff_beta": 0.9,
        "factor_max": 4.0,
        "factor_min": 0.5,
        "factor_threshold": 0.1,
    }
    assert hparams == {"lr": 11e-3}
    said = "; ".join(notes)
    for part in (
        "optimizer.params.cuda_aware: no effect here",
        "optimizer.params.comm_backend_name: no effect here",
        "gradient_clipping: not applied by the strategy; here it is Trainer(gradient_clip_val=...)",
        "fp16: not applied by the strategy; here it is Trainer(precision='16-mixed')",
        "train_micro_batch_size_per_gpu: not applied by the strategy; here it is your DataLoader's",
    ):
        assert part in said, part


def test_what_the_config_does_not_apply_is_named_in_the_users_front_end() -> None:
    config = {
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True},
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "max_grad_norm": 1.0}},
    }
    with pytest.warns(UserWarning, match="DeepSpeed config") as trainer_warnings:
        OneBitStrategy.from_deepspeed_config(config)
    said = " ".join(str(w.message) for w in trainer_warnings)
    assert (
        "gradient_clipping: not applied by the strategy; here it is Trainer(gradient_clip_val=...)"
        in said
    )
    assert "fp16: not applied by the strategy; here it is Trainer(precision='16-mixed')" in said
    assert "fabric." not in said and "Fabric(" not in said
    with pytest.warns(UserWarning, match="DeepSpeed config") as fabric_warnings:
        OneBitFabricStrategy.from_deepspeed_config(config)
    said = " ".join(str(w.message) for w in fabric_warnings)
    assert f"gradient_clipping: not applied by the strategy; here it is {FABRIC.clip}" in said
    assert "fp16: not applied by the strategy; here it is Fabric(precision='16-mixed')" in said
    assert (
        "max_grad_norm: no effect here (DeepSpeed's 1-bit optimizers ignore it; clip with fabric.clip_gradients("
        in said
    )
    assert (
        "gradient_accumulation_steps: not applied by the strategy; here it is fabric.no_backward_sync"
        in said
    )
    assert (
        "Trainer" not in said
        and "accumulate_grad_batches" not in said
        and "configure_optimizers" not in said
    )


def _config(**params: Any) -> dict:
    return {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, **params}}}


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (_config(freez_step=10), r"unknown parameter 'freez_step' for DeepSpeed's OneBitAdam"),
        (_config(var_freeze_step=10), r"unknown parameter 'var_freeze_step'"),  # 0/1 Adam's
        (_config(amsgrad=True), "no AMSGrad variant"),
        ({"optimizer": {"type": "Adam", "params": {}}}, "'Adam' is not a 1-bit optimizer"),
        ({"train_batch_size": 8}, 'no "optimizer"'),
        ({"optimizer": {"type": "OneBitAdam", "param": {}}}, r"unknown keys .*\['param'\]"),
    ],
)
def test_what_cannot_run_here_is_refused_by_name(config: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OneBitStrategy.from_deepspeed_config(config)


def test_a_path_that_is_not_there_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"ds\.json"):
        OneBitStrategy(deepspeed_config=str(tmp_path / "ds.json"))


class NoOptimizer(L.LightningModule):
    """As under DeepSpeed: the optimizer comes from the config."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return None


class Record(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        opt = trainer.strategy.onebit_optimizer
        torch.save(
            {
                "optimizer": type(opt).__name__,
                "group": {k: v for k, v in opt.param_groups[0].items() if k != "params"},
                "phase": opt.phase,
                "params": {k: v.clone() for k, v in pl_module.state_dict().items()},
            },
            self.out / f"rank{trainer.global_rank}.pt",
        )


@pytest.mark.parametrize("name", ["onebit_adam", "zero_one_adam", "onebit_lamb"])
def test_the_tutorial_configs_train(tmp_path: Path, name: str) -> None:
    config = json.loads((CONFIGS / f"{name}.json").read_text())
    # the tutorials' switch points are for 100k-step runs: overridden for a 12-step one
    strategy = OneBitStrategy.from_deepspeed_config(config, freeze_step=4, start_method="fork")
    x = torch.randn(12 * 2 * 16, 8, generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=12,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Record(tmp_path)],
    )
    trainer.fit(NoOptimizer(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), 16))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    params = config["optimizer"]["params"]
    for r in ranks:
        assert r["optimizer"] == config["optimizer"]["type"]
        assert r["phase"] != "warmup" and r["phase"] != "variance"  # it switched
        assert r["group"]["lr"] == params["lr"]
        assert r["group"]["weight_decay"] == params.get("weight_decay", 0.0)
        assert all(torch.isfinite(v).all() for v in r["params"].values())
    for k, v in ranks[0]["params"].items():
        assert torch.equal(v, ranks[1]["params"][k])


class Built(NoOptimizer):
    """The same model, with the optimizer ``make(params)`` returns."""

    def __init__(self, make: Any) -> None:
        super().__init__()
        self.make = make

    def configure_optimizers(self) -> Any:
        return self.make(self.parameters())


def _fit_params(out: Path, strategy: Any, model: L.LightningModule) -> dict[str, torch.Tensor]:
    """Rank 0's parameters after a 10-step 2-rank fit (the ranks' checked equal)."""
    out.mkdir()
    x = torch.randn(10 * 2 * 16, 8, generator=torch.Generator().manual_seed(0))
    L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=10,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Record(out)],
    ).fit(model, DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), 16))
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for k, v in ranks[0]["params"].items():
        assert torch.equal(v, ranks[1]["params"][k]), k
    assert ranks[0]["phase"] not in ("warmup", "variance")  # it switched
    return ranks[0]["params"]


_DS_TYPES = {
    "onebit_adam": "OneBitAdam",
    "zero_one_adam": "ZeroOneAdam",
    "onebit_lamb": "OneBitLamb",
}


@pytest.mark.parametrize("algorithm", ["onebit_adam", "zero_one_adam", "onebit_lamb"])
def test_deepspeed_compatible_strategies_compute_what_the_optimizer_does(
    tmp_path: Path, algorithm: str
) -> None:
    """``deepspeed_compatible=True`` on the strategy (converting AdamW), the optimizer built with
    ``deepspeed_compatible=True`` and a DeepSpeed config: bitwise the same parameters."""
    from lightning_onebit.strategy import ALGORITHMS

    cls = ALGORITHMS[algorithm]
    switch = "var_freeze_step" if algorithm == "zero_one_adam" else "freeze_step"
    hparams = {"lr": 1e-2, "weight_decay": 0.01}
    fork = {"algorithm": algorithm, "start_method": "fork"}
    own = _fit_params(
        tmp_path / "own",
        OneBitStrategy(**fork),
        Built(lambda p: cls(p, **hparams, **{switch: 4}, deepspeed_compatible=True)),
    )
    converted = _fit_params(
        tmp_path / "converted",
        OneBitStrategy(**fork, freeze_step=4, deepspeed_compatible=True, lamb_lr=1e-2),
        Built(lambda p: torch.optim.AdamW(p, **hparams)),
    )
    config = {"optimizer": {"type": _DS_TYPES[algorithm], "params": {**hparams, switch: 4}}}
    from_config = _fit_params(
        tmp_path / "config",
        OneBitStrategy.from_deepspeed_config(config, start_method="fork"),
        NoOptimizer(),
    )
    for k, v in own.items():
        assert torch.equal(converted[k], v), k
        assert torch.equal(from_config[k], v), k
    # and this library's own arithmetic is another one (the switch reaches the optimizer)
    robust = OneBitStrategy(algorithm=algorithm)
    assert robust.options.optimizer_kwargs({})["bias_correction"] is True
    assert "deepspeed_compatible" not in robust.options.optimizer_kwargs({})


def test_deepspeed_compatible_refuses_a_contradicting_option_by_name() -> None:
    with pytest.raises(ValueError, match=r"deepspeed_compatible=True .* bias_correction=True"):
        OneBitStrategy(deepspeed_compatible=True, bias_correction=True)
    with pytest.raises(ValueError, match=r"variance_floor=0.01 was given too"):
        OneBitStrategy.from_deepspeed_config(_config(), variance_floor=0.01)
    # DeepSpeed's own values, and a config with this library's arithmetic asked for, are fine
    OneBitStrategy(deepspeed_compatible=True, bias_correction=False, variance_floor=0.0)
    kept = OneBitStrategy.from_deepspeed_config(_config(), deepspeed_compatible=False)
    assert kept.options.optimizer_kwargs({})["bias_correction"] is True
    with pytest.raises(ValueError, match="deepspeed_compatible must be True, False or None"):
        OneBitStrategy(deepspeed_compatible="yes")
