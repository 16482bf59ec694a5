"""The examples: the data module on user text, the CLI configs end to end, the notebook.

The CLI runs use strategy="ddp" (popen launcher), which re-runs its command for the other
ranks; inside pytest that would re-run pytest, so they run ``examples/train.py`` in a subprocess.
The notebook forks its ranks from a Jupyter kernel (another process too).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.helpers.dist import script_env

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _import_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module (the examples import each other by plain name)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(EXAMPLES))


def _onebit_registered(name: str) -> bool:
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_onebit

    return hasattr(lightning_onebit, "OneBitStrategy") and name in StrategyRegistry


# --------------------------------------------------------------------------- script names


@pytest.mark.parametrize("folder", ["benchmarks", "examples", "scripts"])
def test_no_script_shadows_an_installed_or_standard_module(folder: str) -> None:
    """A script runs with its folder first on ``sys.path``, so a script named like an installed
    package (``kernels.py`` against the ``kernels`` package transformers imports) or a standard
    module breaks every import of that name in the run."""
    import importlib.metadata

    taken = set(importlib.metadata.packages_distributions()) | set(sys.stdlib_module_names)
    assert {"torch", "json"} <= taken  # both sources are read
    clashes = sorted(p.name for p in (ROOT / folder).glob("*.py") if p.stem in taken)
    assert clashes == [], f"rename {clashes} in {folder}/: they shadow modules of that name"


# --------------------------------------------------------------------------- data module


def test_text_datamodule_reads_a_directory_and_a_file(tmp_path: Path) -> None:
    gpt = _import_example("gpt")
    (tmp_path / "b.txt").write_text("hello world\n" * 40)
    (tmp_path / "a.txt").write_text("abc abc abc\n" * 40 + "\u00e9")  # é: 2 rare bytes
    (tmp_path / "skip.md").write_text("not matched " * 100)
    dm = gpt.TextDataModule(str(tmp_path), pattern="*.txt", block_size=8, batch_size=4, min_count=5)
    assert [p.name for p in dm.files()] == ["a.txt", "b.txt"]  # sorted, pattern applied
    assert dm.vocab_size == 1 + len(set("hello world\nabc "))  # + the unknown id
    n = len(dm.train_tokens) + len(dm.val_tokens)
    assert n == 12 * 40 + 2 + 12 * 40
    assert len(dm.val_tokens) == int(0.1 * n)
    # the held-out split is the end of the corpus, the last file in sorted order
    assert dm.decode(dm.val_tokens[-12:]) == "hello world\n"
    assert dm.decode(dm.encode("abc\u00e9")) == "abc??"  # rare bytes share the unknown id
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 8) and x.dtype == torch.long
    assert int(x.max()) < dm.vocab_size

    single = gpt.TextDataModule(str(tmp_path / "b.txt"), block_size=8, min_count=1)
    assert [p.name for p in single.files()] == ["b.txt"]
    assert single.decode(single.train_tokens[:11]) == "hello world"

    with pytest.raises(FileNotFoundError, match="no files match"):
        gpt.TextDataModule(str(tmp_path), pattern="*.rst")


def test_default_corpus_is_the_standard_library() -> None:
    gpt = _import_example("gpt")
    dm = gpt.TextDataModule(max_bytes=200_000, block_size=32)
    assert dm.files()[0].parent == Path(os.__file__).parent
    assert 50 < dm.vocab_size <= 256
    model = gpt.GPT(vocab_size=dm.vocab_size, block_size=32, n_layer=1, n_embd=32)
    x, _ = next(iter(dm.train_dataloader()))
    assert model(x).shape == (*x.shape, dm.vocab_size)  # (B, T, V)


# --------------------------------------------------------------------------- the CLI end to end


def _train(tmp_path: Path, config: str, *extra: str) -> dict:
    out = tmp_path / "run.json"
    cmd = [
        sys.executable,
        str(EXAMPLES / "train.py"),
        "fit",
        "--config",
        str(EXAMPLES / "configs" / config),
        "--trainer.devices",
        "2",
        "--trainer.max_steps",
        "3",
        "--trainer.val_check_interval",
        "3",
        "--trainer.limit_val_batches",
        "2",
        "--trainer.enable_progress_bar",
        "false",
        "--data.max_bytes",
        "300000",
        "--summary.json_path",
        str(out),
        *extra,
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240, env=script_env()
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    "config",
    [
        # the other two: the same run with another algorithm (the CLI by name and a DeepSpeed
        # config below take 1-bit Adam and 0/1 Adam through the CLI on every change)
        pytest.param("onebit_adam.yaml", marks=pytest.mark.long),
        pytest.param("zero_one_adam.yaml", marks=pytest.mark.long),
        "onebit_lamb.yaml",
    ],
)
def test_cli_onebit_config(tmp_path: Path, config: str) -> None:
    name = config.removesuffix(".yaml")
    if not _onebit_registered(name):
        pytest.skip(f"strategy {name!r} is not registered yet (lightning_onebit.OneBitStrategy)")
    r = _train(tmp_path, config)
    assert r["steps"] == 3 and r["world_size"] == 2
    # freeze_step 0.2 of 3 steps: one fp32 warmup step (at least one always runs), then 1-bit
    # steps: fewer bytes than 3 fp32 allreduces
    assert 0 < r["bytes_per_rank"] < r["fp32_ddp_bytes_per_rank"]
    assert 0 < r["final_val_loss"] < 10


@pytest.mark.slow
def test_compare_quick_ddp_only_runs_the_ddp_config(tmp_path: Path) -> None:
    """``compare.py`` runs ``train.py`` with ``ddp_adam.yaml`` (DDP + AdamW through the CLI),
    prints the table, plots, and keeps the run's record."""
    from lightning_onebit.comm import fp32_allreduce_bytes

    cmd = [
        sys.executable,
        str(EXAMPLES / "compare.py"),
        "--quick",
        "--steps",
        "6",
        "--only",
        "DDP + AdamW",
        "--out",
        str(tmp_path / "out"),
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240, env=script_env()
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "| DDP + AdamW |" in proc.stdout
    assert (tmp_path / "out" / "compare.png").stat().st_size > 10_000
    r = json.loads((tmp_path / "out" / "ddp__adamw.json").read_text())
    assert r["steps"] == 6 and r["world_size"] == 2 and r["optimizer"] == "AdamW"
    assert r["bytes_per_rank"] == 6 * fp32_allreduce_bytes(r["parameters"], 2)
    assert len(r["val_curve"]) == 6 and 0 < r["final_val_loss"] < 10  # (validated every step)


# --------------------------------------------------------------------------- the notebook

_STEPS = re.compile(r"^STEPS = \d+", re.M)


@pytest.mark.slow
def test_notebook_runs(tmp_path: Path) -> None:
    missing = [
        m for m in ("nbclient", "nbformat", "ipykernel") if importlib.util.find_spec(m) is None
    ]
    if missing:
        pytest.skip(
            f"executing the notebook needs {', '.join(missing)} (pip install nbclient ipykernel)"
        )
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(EXAMPLES / "notebook.ipynb", as_version=4)
    # fewer steps per run: what runs is the notebook's code; how well it trains is the CLI's and
    # the strategy tests' business
    steps = [c for c in nb.cells if c.cell_type == "code" and _STEPS.search(c.source)]
    assert len(steps) == 1, "the notebook sets STEPS = <n> in one cell"
    steps[0].source = _STEPS.sub("STEPS = 20", steps[0].source)
    # run it as a user would (next to gpt.py), writing its outputs under tmp_path
    nb.cells.insert(
        0,
        nbformat.v4.new_code_cell(f"import sys; sys.path.insert(0, {str(EXAMPLES)!r})"),
    )
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
    )
    assert "| DDP + AdamW |" in outputs
    images = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "image/png" in o.get("data", {})
    ]
    assert images, "the plot cell produced no image"


def test_the_committed_notebook_shows_its_results() -> None:
    """A reader who opens the notebook on GitHub sees the table, the plot and a sample
    (``python scripts/execute_notebook.py`` re-executes it), in a file of modest size."""
    nb = json.loads((EXAMPLES / "notebook.ipynb").read_text())
    outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    text = "".join("".join(o.get("text", "")) for o in outputs)
    assert "| DDP + AdamW |" in text and "| 1-bit Adam |" in text
    assert "compression phase (1-bit exchange)" in text
    assert any("image/png" in o.get("data", {}) for o in outputs)
    assert "it/s" not in text and "\x1b" not in text  # no progress-bar redraws
    assert (EXAMPLES / "notebook.ipynb").stat().st_size < 200_000


@pytest.mark.slow
def test_cli_strategy_by_name(tmp_path: Path) -> None:
    """`--trainer.strategy onebit_adam` (a registered name) works."""
    r = _train(tmp_path, "ddp_adam.yaml", "--trainer.strategy", "onebit_adam")
    assert r["optimizer"] == "OneBitAdam" and r["world_size"] == 2
    assert 0 < r["bytes_per_rank"] < r["fp32_ddp_bytes_per_rank"]


def test_cli_help_documents_the_strategy(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`train.py fit --trainer.strategy.help lightning_onebit.OneBitStrategy` documents the
    strategy's hyperparameters (LightningCLI reads them from OneBitStrategy's docstring); the
    script's CLI class, in this process (it prints the help and exits before building anything)."""
    train = _import_example("train")
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / "train.py")])  # (not pytest's arguments)
    with pytest.raises(SystemExit) as exited:
        train.CLI(
            train.GPT,
            train.TextDataModule,
            args=["fit", "--trainer.strategy.help", "lightning_onebit.OneBitStrategy"],
        )
    assert exited.value.code == 0
    out = capsys.readouterr().out
    words = " ".join(out.split())  # (argparse wraps the help at any width)
    for text in (
        "--trainer.strategy.freeze_step",
        "fraction of the run",
        "--trainer.strategy.max_coeff",
        "--trainer.strategy.deepspeed_config",
        "--trainer.strategy.find_unused_parameters",  # DDP's own, passed on
    ):
        assert text in words, text
    # DDPStrategy's hook options, which OneBitStrategy refuses, are not offered
    assert "ddp_comm_hook" not in out and "model_averaging_period" not in out


def _strategy_config(tmp_path: Path, **init_args: object) -> Path:
    """``onebit_adam.yaml`` with ``init_args`` in its strategy section, in ``tmp_path``."""
    import yaml  # (jsonargparse's dependency)

    config = yaml.safe_load((EXAMPLES / "configs" / "onebit_adam.yaml").read_text())
    config["trainer"]["strategy"]["init_args"].update(init_args)
    config["trainer"]["default_root_dir"] = str(tmp_path / "runs")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize(
    ("init_args", "expected"),
    [
        ({"algorithm": "onebit_adamm"}, ['Parser key "algorithm"', "Got value: onebit_adamm"]),
        (
            {"freeze_step": -3},
            ['Parser key "freeze_step"', "NonNegativeInt", "OpenUnitInterval", "Given value: -3"],
        ),
        (
            {"variance_floor": 1.5},
            ['Parser key "variance_floor"', "restriction v>=0.0 and v<1.0", "Given value: 1.5"],
        ),
    ],
    ids=["algorithm", "freeze_step", "variance_floor"],
)
def test_cli_refuses_a_bad_strategy_value_while_parsing(
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    init_args: dict,
    expected: list[str],
) -> None:
    """A bad value in a config's strategy section is a parse error of a few lines (exit code 2,
    no traceback): the strategy's arguments are typed with their ranges, which LightningCLI
    checks before it builds anything, and the script prints a one-line usage."""
    train = _import_example("train")
    config = _strategy_config(tmp_path, **init_args)
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / "train.py"), "fit", "--config", str(config)])
    with pytest.raises(SystemExit) as exited:
        train.main()
    assert exited.value.code == 2
    err = capsys.readouterr().err
    for text in expected:
        assert text in err, err
    assert "Traceback" not in err
    assert len(err.splitlines()) <= 20, err


def test_cli_hands_the_strategy_plain_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The range-checked types the CLI parses into are subclasses of int and float; the
    strategy keeps plain ones (they go into param groups and checkpoints)."""
    train = _import_example("train")
    config = _strategy_config(tmp_path, freeze_step=12, freeze_window=7, variance_floor=0.02)
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / "train.py")])
    cli = train.CLI(
        train.GPT,
        train.TextDataModule,
        args=["--config", str(config), "--trainer.devices", "2", "--data.max_bytes", "20000"],
        run=False,
    )
    options = cli.trainer.strategy.options
    assert type(options.freeze_step) is int and options.freeze_step == 12
    assert type(options.freeze_window) is int and options.freeze_window == 7
    assert type(options.variance_floor) is float and options.variance_floor == 0.02


@pytest.mark.slow
def test_cli_takes_a_deepspeed_config(tmp_path: Path) -> None:
    ds = EXAMPLES / "configs" / "deepspeed" / "zero_one_adam.json"
    r = _train(
        tmp_path,
        "ddp_adam.yaml",
        "--trainer.strategy",
        "lightning_onebit.OneBitStrategy",
        "--trainer.strategy.deepspeed_config",
        str(ds),
        "--trainer.strategy.freeze_step",
        "1",  # the tutorial's 1000 is for a 100k-step run
    )
    assert r["optimizer"] == "ZeroOneAdam" and r["world_size"] == 2
    assert 0 < r["bytes_per_rank"] < r["fp32_ddp_bytes_per_rank"]
