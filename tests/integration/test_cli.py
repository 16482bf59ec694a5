"""Both strategies as LightningCLI / jsonargparse read them: every option typed (ranges
included), with its default and its help text, and a printed config that builds the same
strategy again. The signatures are made from one declaration of the options
(``_integration/options.py``); these tests check what the CLI makes of them."""

from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import yaml
from jsonargparse import ArgumentParser
from lightning.pytorch.cli import LightningCLI

from lightning_onebit import OneBitFabricStrategy, OneBitStrategy
from lightning_onebit._integration.options import StrategyOptions

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: (option, what its type says in the help) for options of each kind of type
TYPES = [
    ("algorithm", "Literal['onebit_adam', 'zero_one_adam', 'onebit_lamb']"),
    ("freeze_step", "Union[NonNegativeInt, OpenUnitInterval, null]"),
    ("freeze_threshold", "PositiveFloat"),
    ("freeze_window", "PositiveInt"),
    ("variance_floor", "ZeroToBelowOne | null"),
    ("factor_min", "AboveZeroToOne | null"),
    ("factor_max", "AtLeastOne | null"),
    ("bias_correction", "bool | null"),
    ("timeout", "timedelta | null"),
]
#: (option, words of its help text), shared by both strategies
HELP = [
    ("freeze_step", "a fraction of the run"),
    ("max_coeff", "1-bit LAMB: upper clamp of the layer-wise trust ratio"),
    ("average_dtype", "the dtype of the warmup's gradient average"),
    ("deepspeed_config", "a DeepSpeed JSON config"),
]


class _Tiny(L.LightningModule):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.net = torch.nn.Linear(width, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _cli(args: list[str], **kwargs: Any) -> LightningCLI:
    return LightningCLI(_Tiny, args=args, save_config_callback=None, **kwargs)


def _words(text: str) -> str:
    return " ".join(text.split())  # (argparse wraps the help at any width)


def _option_help(words: str, prefix: str, name: str) -> str:
    """The help of ``--<prefix>.<name>`` (up to the next option) in ``words``."""
    start = words.index(f" --{prefix}.{name} ")
    end = words.find(f" --{prefix}.", start + 1)
    return words[start:end]


def _check_help(words: str, prefix: str) -> None:
    for f in dataclasses.fields(StrategyOptions):
        assert f" --{prefix}.{f.name} " in words, f.name
    for name, kind in TYPES:
        assert f"(type: {kind}," in _option_help(words, prefix, name), name
    for name, text in HELP:
        assert text in _option_help(words, prefix, name), name
    assert "default: 0.05)" in _option_help(words, prefix, "freeze_threshold")
    assert "default: 25.0)" in _option_help(words, prefix, "overlap_bucket_mb")
    # DDP's own, found behind **kwargs
    assert f" --{prefix}.find_unused_parameters " in words


def test_lightning_cli_help_documents_the_trainer_strategy(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", ["train.py"])  # (not pytest's arguments)
    with pytest.raises(SystemExit) as exited:
        _cli(["fit", "--trainer.strategy.help", "lightning_onebit.OneBitStrategy"])
    assert exited.value.code == 0
    words = _words(capsys.readouterr().out)
    _check_help(words, "trainer.strategy")
    assert "log phase and byte counters" in _option_help(
        words, "trainer.strategy", "log_comm_stats"
    )
    assert " --trainer.strategy.max_steps " not in words
    # DDPStrategy's hook options, which OneBitStrategy sets itself, are not offered
    assert "ddp_comm_hook" not in words and "model_averaging_period" not in words


def _fabric_parser() -> ArgumentParser:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(OneBitFabricStrategy, "strategy")
    return parser


def test_jsonargparse_help_documents_the_fabric_strategy() -> None:
    import io

    out = io.StringIO()
    _fabric_parser().print_help(out)
    words = _words(out.getvalue())
    _check_help(words, "strategy")
    assert "the run's optimizer steps" in _option_help(words, "strategy", "max_steps")
    assert " --strategy.log_comm_stats " not in words


GIVEN = {
    "algorithm": "zero_one_adam",
    "freeze_step": 12,
    "freeze_window": 7,
    "variance_floor": 0.02,
    "local_step_clipper": 4,
    "average_dtype": "float32",
    "on_divergence": "raise",
    "start_method": "fork",
}


def test_a_printed_trainer_config_builds_the_same_strategy(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", ["train.py"])
    given = [f"--trainer.strategy.{k}={v}" for k, v in GIVEN.items()]
    machine = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.logger=false"]
    strategy = ["--trainer.strategy=lightning_onebit.OneBitStrategy"]
    with pytest.raises(SystemExit) as exited:
        _cli(["--print_config", *machine, *strategy, *given], run=False)
    assert exited.value.code == 0
    printed = capsys.readouterr().out
    section = yaml.safe_load(printed)["trainer"]["strategy"]
    assert section["class_path"] == "lightning_onebit.OneBitStrategy"
    for f in dataclasses.fields(StrategyOptions):  # every option, with its value or default
        assert f.name in section["init_args"], f.name
    assert section["init_args"]["freeze_threshold"] == 0.05
    config = tmp_path / "config.yaml"
    config.write_text(printed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = _cli(["--config", str(config)], run=False)
    built = cli.trainer.strategy
    assert isinstance(built, OneBitStrategy)
    want = OneBitStrategy(**{**GIVEN, "average_dtype": torch.float32}).options
    assert built.options == want
    assert type(built.options.freeze_step) is int and type(built.options.variance_floor) is float
    assert built.log_comm_stats is True


def test_a_dumped_fabric_config_builds_the_same_strategy() -> None:
    parser = _fabric_parser()
    cfg = parser.parse_args(
        [f"--strategy.{k}={v}" for k, v in GIVEN.items()] + ["--strategy.max_steps=40"]
    )
    again = parser.parse_string(parser.dump(cfg))
    built = parser.instantiate_classes(again)["strategy"]
    assert isinstance(built, OneBitFabricStrategy) and built.max_steps == 40
    assert built.options == OneBitFabricStrategy(**GIVEN).options


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ({"variance_floor": "1.5"}, "restriction v>=0.0 and v<1.0"),
        ({"freeze_window": "0"}, "PositiveInt"),
        ({"factor_max": "0.5"}, "restriction v>=1.0"),
    ],
)
def test_the_cli_refuses_a_value_out_of_range(value: dict[str, str], said: str) -> None:
    from jsonargparse import ArgumentError

    ((name, bad),) = value.items()
    with pytest.raises(ArgumentError, match=said.replace("(", r"\(")):
        _fabric_parser().parse_args([f"--strategy.{name}={bad}"])
