"""Every bad configuration is refused (or warned about) before the first training step, with a
message that names the parameter, the bad value and the valid range.

One table per level, each row ``(what is bad, how to build it, substrings the message must
contain)``:

* optimizers (``OneBitAdam``, ``ZeroOneAdam``, ``OneBitLamb``): constructor, param groups,
  ``add_param_group``; no processes, milliseconds per row;
* ``OneBitStrategy`` constructor and ``Trainer`` construction (precision);
* ``Trainer.fit`` with one in-process rank: what only setup can see (the optimizer returned by
  ``configure_optimizers``, the model's modules, ``max_steps``); a callback proves that no
  training step ran before the error (or before the warning);
* ``Trainer.fit`` with two fork-started ranks: a model that differs across ranks; several
  optimizers and manual optimization (our message, not Lightning's).
"""

from __future__ import annotations

import math
import re
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_onebit import OneBitStrategy
from lightning_onebit.optim import OneBitAdam, OneBitLamb, ZeroOneAdam
from tests.helpers.char_model import CharModel, _fit

OPTIMIZERS = [OneBitAdam, ZeroOneAdam, OneBitLamb]
FREEZE = {OneBitAdam: "freeze_step", ZeroOneAdam: "var_freeze_step", OneBitLamb: "freeze_step"}


def _param() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(3))]


def _assert_names(message: str, expected: list[str]) -> None:
    for part in expected:
        assert part in message, f"{part!r} missing from the message: {message}"


# --------------------------------------------------------------------------- optimizers

# (what is bad, constructor kwargs, substrings: parameter, bad value, valid range)
_COMMON_ROWS: list[tuple[str, dict[str, Any], list[str]]] = [
    ("lr negative", {"lr": -1e-3}, ["lr must be", "got -0.001", "[0.0, inf)", "0 keeps"]),
    ("lr nan", {"lr": math.nan}, ["lr must be", "got nan", "[0.0, inf)"]),
    ("eps zero", {"eps": 0.0}, ["eps must be", "got 0.0", "(0.0, inf)"]),
    ("eps negative", {"eps": -1e-8}, ["eps must be", "got -1e-08", "(0.0, inf)"]),
    ("beta1 = 1", {"betas": (1.0, 0.999)}, ["betas[0] must be", "got 1.0", "[0.0, 1.0)"]),
    ("beta1 < 0", {"betas": (-0.1, 0.999)}, ["betas[0] must be", "got -0.1", "[0.0, 1.0)"]),
    ("beta2 = 1", {"betas": (0.9, 1.0)}, ["betas[1] must be", "got 1.0", "[0.0, 1.0)"]),
    ("beta2 > 1", {"betas": (0.9, 1.5)}, ["betas[1] must be", "got 1.5", "[0.0, 1.0)"]),
    ("betas not a pair", {"betas": (0.9,)}, ["betas must be a pair", "(0.9,)"]),
    (
        "weight_decay < 0",
        {"weight_decay": -0.1},
        ["weight_decay must be", "got -0.1", "[0.0, inf]"],
    ),
    ("amsgrad", {"amsgrad": True}, ["amsgrad=True"]),
]

_SPECIFIC_ROWS: list[tuple[type, str, dict[str, Any], list[str]]] = [
    *(
        (cls, "freeze step < 0", {FREEZE[cls]: -1}, [f"{FREEZE[cls]} must be", "got -1", ">= 0"])
        for cls in OPTIMIZERS
    ),
    *(
        (cls, "freeze step not an int", {FREEZE[cls]: 2.5}, [FREEZE[cls], "got 2.5", "integer"])
        for cls in OPTIMIZERS
    ),
    *(
        (ZeroOneAdam, f"{name} < 1", {name: bad}, [f"{name} must be", f"got {bad}", ">= 1"])
        for name in ("var_update_scaler", "local_step_scaler", "local_step_clipper")
        for bad in (0, -3)
    ),
    (
        OneBitLamb,
        "min_coeff > max_coeff",
        {"min_coeff": 2.0, "max_coeff": 1.0},
        ["min_coeff must be", "got 2.0", "(0.0, 1.0]", "max_coeff=1.0"],
    ),
    (OneBitLamb, "max_coeff = 0", {"max_coeff": 0.0}, ["max_coeff must be", "got 0.0", "(0.0"]),
    (
        OneBitLamb,
        "factor_min > factor_max (factor_min > 1)",
        {"factor_min": 2.0, "factor_max": 1.5},
        ["factor_min must be", "got 2.0", "(0.0, 1.0]", "factor_min <= 1 <= factor_max"],
    ),
    (
        OneBitLamb,
        "factor_min > factor_max (factor_max < 1)",
        {"factor_min": 0.9, "factor_max": 0.8},
        ["factor_max must be", "got 0.8", "[1.0, inf]", "factor_min <= 1 <= factor_max"],
    ),
    (OneBitLamb, "coeff_beta = 1", {"coeff_beta": 1.0}, ["coeff_beta must be", "[0.0, 1.0)"]),
    (
        OneBitLamb,
        "factor_threshold < 0",
        {"factor_threshold": -0.1},
        ["factor_threshold must be", "got -0.1", "[0.0, inf]"],
    ),
]


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [(kw, exp) for _, kw, exp in _COMMON_ROWS],
    ids=[name for name, _, _ in _COMMON_ROWS],
)
def test_optimizer_constructor_rejects(cls: type, kwargs: dict, expected: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        cls(_param(), **kwargs)
    _assert_names(str(err.value), expected)


@pytest.mark.parametrize(
    ("cls", "kwargs", "expected"),
    [(cls, kw, exp) for cls, _, kw, exp in _SPECIFIC_ROWS],
    ids=[f"{cls.__name__}: {name}" for cls, name, _, _ in _SPECIFIC_ROWS],
)
def test_optimizer_specific_hyperparameters_are_rejected(
    cls: type, kwargs: dict, expected: list[str]
) -> None:
    with pytest.raises(ValueError) as err:
        cls(_param(), **kwargs)
    _assert_names(str(err.value), expected)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    ("group", "expected"),
    [
        ({"lr": -1.0}, ["param group", "lr must be", "got -1.0", "[0.0, inf)", "that group"]),
        ({"eps": 0.0}, ["param group", "eps must be", "got 0.0", "(0.0, inf)", "e.g. 1e-8"]),
        ({"betas": (0.9, 1.0)}, ["param group", "betas[1] must be", "got 1.0", "[0.0, 1.0)"]),
        ({"amsgrad": True}, ["param group", "has amsgrad=True", "set amsgrad=False"]),
        ({"capturable": True}, ["param group", "has capturable=True", "CUDA graph"]),
        ({"differentiable": True}, ["param group", "has differentiable=True"]),
        ({"maximize": "yes"}, ["param group", "maximize must be True or False"]),
    ],
    ids=["lr", "eps", "betas", "amsgrad", "capturable", "differentiable", "maximize"],
)
def test_param_group_overrides_and_add_param_group_are_validated(
    cls: type, group: dict, expected: list[str]
) -> None:
    with pytest.raises(ValueError) as err:  # in the constructor's groups
        cls([{"params": _param(), **group}])
    _assert_names(str(err.value), expected)
    opt = cls(_param())
    with pytest.raises(ValueError) as err:  # added later
        opt.add_param_group({"params": _param(), **group})
    _assert_names(str(err.value), expected)
    assert len(opt.param_groups) == 1, "a refused param group stayed in the optimizer"


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    ("param", "expected"),
    [
        (
            lambda: torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64)),
            ["parameter 0 of param group 0", "dtype torch.complex64", "is complex", "float32"],
        ),
        (
            lambda: torch.nn.Parameter(torch.eye(3).to_sparse()),
            ["parameter 0 of param group 0", "layout torch.sparse_coo", "torch.strided"],
        ),
        (
            lambda: torch.zeros(3, dtype=torch.int64),
            ["parameter 0 of param group 0", "dtype torch.int64", "floating point"],
        ),
    ],
    ids=["complex", "sparse-layout", "integer"],
)
def test_unsupported_parameter_kinds_are_rejected(cls: type, param: Any, expected: list) -> None:
    with pytest.raises(ValueError) as err:
        cls([param()])
    _assert_names(str(err.value), expected)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_sparse_gradients_without_a_strategy_fail_at_the_first_step(cls: type) -> None:
    """Without Lightning the optimizer cannot see the module, only the gradient: the first
    step refuses it, before it changes anything (under OneBitStrategy: at setup, see below)."""
    emb = torch.nn.Embedding(10, 3, sparse=True)
    before = emb.weight.detach().clone()
    opt = cls(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match=r"sparse gradients.*sparse=False"):
        opt.step()
    assert torch.equal(emb.weight, before)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_lr_zero_is_allowed_and_keeps_the_group_fixed(cls: type) -> None:
    """lr = 0 is accepted, as a setting (a group kept fixed by its lr) and as an LR scheduler's
    current value (a warmup from 0); the group's parameters do not move."""
    opt = cls(_param(), lr=1e-3)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: step / 10)  # sets lr = 0 now
    assert opt.param_groups[0]["lr"] == 0.0
    cls([{"params": _param(), "lr": 0.0, "initial_lr": 0.0}])  # accepted
    fixed, trained = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    before = fixed.detach().clone()
    opt = cls([{"params": [fixed], "lr": 0.0}, {"params": [trained]}], lr=1e-2)
    for _ in range(3):
        for p in (fixed, trained):
            p.grad = torch.randn(3)
        opt.step()
    assert torch.equal(fixed.detach(), before)
    with pytest.raises(ValueError) as err:
        cls([{"params": _param(), "lr": -1.0, "initial_lr": 0.0}])
    _assert_names(str(err.value), ["param group 0", "lr must be", "got -1.0"])


# --------------------------------------------------------------------------- strategy constructor

_STRATEGY_ROWS: list[tuple[str, dict[str, Any], list[str]]] = [
    (
        "unknown algorithm",
        {"algorithm": "onebit_sgd"},
        ["algorithm must be one of", "'onebit_sgd'", "onebit_adam", "zero_one_adam", "onebit_lamb"],
    ),
    ("freeze_step < 0", {"freeze_step": -1}, ["freeze_step must be >= 0", "got -1"]),
    ("freeze_step fraction >= 1", {"freeze_step": 1.5}, ["freeze_step=1.5", "(0, 1)"]),
    ("freeze_step fraction 0", {"freeze_step": 0.0}, ["freeze_step=0.0", "(0, 1)"]),
    ("freeze_step a string", {"freeze_step": "10"}, ["freeze_step must be an int", "'10'"]),
    ("freeze_window < 1", {"freeze_window": 0}, ["freeze_window", "got 0", ">= 1"]),
    ("freeze_threshold <= 0", {"freeze_threshold": 0.0}, ["freeze_threshold", "got 0.0", "> 0"]),
    *(
        (
            f"{name} < 1 ({algorithm})",
            {"algorithm": algorithm, name: 0},
            [f"{name} must be", "got 0", ">= 1"],
        )
        for name in ("var_update_scaler", "local_step_scaler", "local_step_clipper")
        # also refused when the chosen algorithm ignores the option
        for algorithm in ("zero_one_adam", "onebit_adam")
    ),
    (
        "min_coeff > max_coeff",
        {"algorithm": "onebit_lamb", "min_coeff": 5.0, "max_coeff": 1.0},
        ["min_coeff must be", "got 5.0", "(0.0, 1.0]", "max_coeff=1.0"],
    ),
    (
        "factor_min > factor_max",
        {"algorithm": "onebit_lamb", "factor_min": 2.0, "factor_max": 1.5},
        ["factor_min must be", "got 2.0", "(0.0, 1.0]", "factor_max"],
    ),
    (
        "factor_max < 1",
        {"algorithm": "onebit_lamb", "factor_max": 0.8},
        ["factor_max must be", "got 0.8", "[1.0, inf]"],
    ),
    (
        "coeff_beta = 1",
        {"algorithm": "onebit_lamb", "coeff_beta": 1.0},
        ["coeff_beta must be", "got 1.0", "[0.0, 1.0)"],
    ),
    (
        "overlap_bucket_mb <= 0",
        {"overlap_bucket_mb": 0},
        ["overlap_bucket_mb must be", "got 0", "(0, inf)"],
    ),
    (
        "timeout zero",
        {"timeout": timedelta(0)},
        ["timeout must be a datetime.timedelta > 0", "got datetime.timedelta(0)"],
    ),
    ("timeout not a timedelta", {"timeout": 30}, ["timeout must be a datetime.timedelta", "30"]),
    (
        "own DDP comm hook",
        {"ddp_comm_hook": lambda state, bucket: None},
        ["installs its own DDP communication hook", "ddp_comm_hook"],
    ),
]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [(kw, exp) for _, kw, exp in _STRATEGY_ROWS],
    ids=[name for name, _, _ in _STRATEGY_ROWS],
)
def test_strategy_constructor_rejects(kwargs: dict, expected: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        OneBitStrategy(**kwargs)
    _assert_names(str(err.value), expected)


def test_precision_64_true_is_refused_at_trainer_construction() -> None:
    """The optimizers' states and the exchange are fp32: float64 parameters would silently get
    fp32 updates (and 0/1 Adam rounds the parameters to fp32 at every synchronisation)."""
    for precision in ("64-true", "64", 64):
        with pytest.raises(ValueError) as err:
            L.Trainer(strategy=OneBitStrategy(), precision=precision, accelerator="cpu", devices=1)
        _assert_names(str(err.value), ["precision='64-true'", "float32", "'32-true'", "bf16-mixed"])


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"])
def test_supported_precisions_construct(precision: str) -> None:
    trainer = L.Trainer(
        strategy=OneBitStrategy(), precision=precision, accelerator="cpu", devices=1, logger=False
    )
    assert isinstance(trainer.strategy, OneBitStrategy)


# --------------------------------------------------------------------------- setup (one rank)


class _NoTrainingStep(Callback):
    """Records, at the first training batch, the warnings seen so far; counts batches and, at
    the end, how many compressed exchanges the optimizer made."""

    def __init__(self, seen: list[warnings.WarningMessage] | None = None) -> None:
        self.seen = seen
        self.batches = 0
        self.seen_at_first_batch: list[str] | None = None
        self.exchanges: int | None = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.exchanges = trainer.strategy.onebit_optimizer.flat.exchange.calls

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.batches == 0 and self.seen is not None:
            self.seen_at_first_batch = [str(w.message) for w in self.seen]
        self.batches += 1


class _SGD(CharModel):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _TwoOptimizers(CharModel):
    def configure_optimizers(self) -> Any:
        return [
            torch.optim.Adam(self.net[0].parameters()),
            torch.optim.Adam(self.net[2].parameters()),
        ]


class _NoOptimizer(CharModel):
    def configure_optimizers(self) -> Any:
        return None


class _Adam(CharModel):
    def __init__(self, **adam: Any) -> None:
        super().__init__()
        self.adam = adam

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), **self.adam)


class _SparseEmbedding(CharModel):
    def __init__(self) -> None:
        super().__init__()
        self.net[0] = torch.nn.Embedding(48, 16, sparse=True)


class _ComplexParameter(CharModel):
    def __init__(self) -> None:
        super().__init__()
        self.phase = torch.nn.Parameter(torch.ones(4, dtype=torch.complex64))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) + self.phase.abs().sum()


class _WarmupFromZero(CharModel):
    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, step / 3))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# (what is bad, model, exception type(s), substrings)
_SETUP_ROWS: list[tuple[str, Any, Any, list[str]]] = [
    (
        "SGD",
        _SGD,
        MisconfigurationException,
        ["cannot run SGD", "torch.optim.Adam", "AdamW", "OneBitAdam"],
    ),
    # ours, before Lightning's (which advises manual optimization, which we cannot run)
    (
        "several optimizers",
        _TwoOptimizers,
        MisconfigurationException,
        ["trains with one optimizer", "one param group per former optimizer"],
    ),
    (
        "no optimizer",
        _NoOptimizer,
        MisconfigurationException,
        ["returned none", "torch.optim.Adam"],
    ),
    ("Adam eps = 0", lambda: _Adam(eps=0.0), ValueError, ["eps must be", "got 0.0", "(0.0, inf)"]),
    ("Adam amsgrad", lambda: _Adam(amsgrad=True), MisconfigurationException, ["amsgrad=False"]),
    (
        "Adam capturable",
        lambda: _Adam(capturable=True),
        MisconfigurationException,
        ["param group 0", "capturable=True", "set capturable=False"],
    ),
    (
        "sparse embedding",
        _SparseEmbedding,
        ValueError,
        ["net.0 (Embedding) has sparse=True", "dense gradients", "sparse=False"],
    ),
    (
        "complex parameter",
        _ComplexParameter,
        ValueError,
        ["dtype torch.complex64", "is complex", "real floating-point", "view_as_real"],
    ),
]


@pytest.mark.parametrize(
    ("make", "error", "expected"),
    [(make, err, exp) for _, make, err, exp in _SETUP_ROWS],
    ids=[name for name, _, _, _ in _SETUP_ROWS],
)
def test_setup_rejects_before_the_first_step(
    tmp_path: Path, make: Any, error: Any, expected: list[str]
) -> None:
    probe = _NoTrainingStep()
    with pytest.raises(error) as err:
        _fit(
            tmp_path,
            OneBitStrategy(freeze_step=2),
            devices=1,
            steps=3,
            model=make(),
            callbacks=[probe],
        )
    _assert_names(str(err.value), expected)
    assert probe.batches == 0, "a training step ran before the error"


@pytest.mark.parametrize(
    ("strategy", "model", "expected"),
    [
        (
            lambda: OneBitStrategy(freeze_step=50),
            CharModel,
            ["freeze_step=50", "run's 6 optimizer steps"],
        ),
        (
            lambda: OneBitStrategy(freeze_step=6),
            CharModel,
            ["freeze_step=6", "run's 6 optimizer steps"],
        ),
        *(
            (
                lambda: OneBitStrategy(),  # freeze_step=None keeps the optimizer's own
                type(
                    f"Own{cls.__name__}",
                    (CharModel,),
                    {"configure_optimizers": lambda self, cls=cls: cls(self.parameters())},
                ),
                [f"{cls.__name__}.{FREEZE[cls]}=100000", "run's 6 optimizer steps"],
            )
            for cls in OPTIMIZERS
        ),
    ],
    ids=["strategy 50 > 6", "strategy 6 = 6", *(f"own {c.__name__} default" for c in OPTIMIZERS)],
)
def test_freeze_step_beyond_max_steps_warns_before_training(
    tmp_path: Path, strategy: Any, model: Any, expected: list[str]
) -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        probe = _NoTrainingStep(seen)
        records = _fit(tmp_path, strategy(), devices=1, steps=6, model=model(), callbacks=[probe])
    ours = [m for m in probe.seen_at_first_batch or [] if "phase never starts" in m]
    assert len(ours) == 1, f"no warning before the first step; saw {probe.seen_at_first_batch}"
    _assert_names(ours[0], expected)
    assert records[0]["step_count"] == 6
    # it indeed never compressed (0/1 Adam's first phase exchanges 1-bit gradients between
    # its variance steps, but in 6 steps with var_update_scaler=16 every step is one)
    assert probe.exchanges == 0


def test_no_freeze_step_warning_when_the_switch_happens(tmp_path: Path) -> None:
    """The negative control of the rows above, and a warmup from lr = 0 through the conversion."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        records = _fit(
            tmp_path, OneBitStrategy(freeze_step=5), devices=1, steps=6, model=_WarmupFromZero()
        )
    assert not [w for w in seen if "phase never starts" in str(w.message)]
    assert records[0]["phase"] == "compression" and records[0]["lr"] == [1e-3]


# --------------------------------------------------------------------------- two ranks


class _DiffersOnRank1(CharModel):
    """Rank 1 builds a wider hidden layer (rank-dependent code in ``setup``)."""

    def setup(self, stage: str) -> None:
        if self.global_rank == 1:
            self.net[2] = torch.nn.Linear(8 * 16, 65)
            self.net[4] = torch.nn.Linear(65, 48)


def test_model_that_differs_across_ranks_fails_at_setup_on_every_rank(tmp_path: Path) -> None:
    """Two fork-started ranks; the error comes from our check, before DDP's and before any step."""
    with pytest.raises(Exception) as err:
        _fit(
            tmp_path,
            OneBitStrategy(start_method="fork"),
            devices=2,
            steps=4,
            model=_DiffersOnRank1(),
        )
    message = str(err.value)
    _assert_names(
        message,
        [
            "the model differs across ranks",
            "rank 0: 5 parameters",
            "rank 1: 5 parameters",
            "'net.2.weight' has shape (64, 128) on rank 0",
            "(65, 128) on rank 1",
            "Every rank must build the same model",
        ],
    )
    assert "_verify_param_shape_across_processes" not in message
    assert not re.search(r"rank\d\.pt", " ".join(p.name for p in tmp_path.iterdir()))


class _ManualTwoOptimizers(_TwoOptimizers):
    """Lightning's advice for two optimizers followed: manual optimization."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:  # pragma: no cover - refused
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        for opt in self.optimizers():
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize(
    ("model", "trainer_kw", "found"),
    [
        (_TwoOptimizers, {}, "but configure_optimizers returned several optimizers."),
        # (Lightning refuses gradient clipping under manual optimization, before the strategy's
        # setup)
        (
            _ManualTwoOptimizers,
            {"gradient_clip_val": 1.0},
            "but this LightningModule sets `self.automatic_optimization = False`.",
        ),
    ],
    ids=["two optimizers", "manual optimization"],
)
def test_one_optimizer_message_comes_before_lightnings(
    tmp_path: Path, model: Any, trainer_kw: dict, found: str
) -> None:
    """Two fork-started ranks: what the user reads (the rank's whole traceback) is our message,
    and not Lightning's advice to turn to manual optimization, which this strategy refuses."""
    with pytest.raises(Exception) as err:
        _fit(tmp_path, OneBitStrategy(start_method="fork"), steps=3, model=model(), **trainer_kw)
    message = str(err.value)
    _assert_names(
        message,
        [
            "OneBitStrategy trains with one optimizer, with automatic optimization",
            found,
            "one param group per former optimizer",
            "let training_step return the loss (no `self.automatic_optimization = False`)",
        ],
    )
    assert "only supported with manual optimization" not in message  # Lightning's
    assert "not supported for manual optimization" not in message  # Lightning's
    assert message.count("Traceback") == 1  # (no chained exception before ours)


@pytest.mark.parametrize(
    ("cls", "given", "name"),
    [
        (OneBitAdam, {"variance_floor": 0.5}, "variance_floor"),
        (OneBitAdam, {"bias_correction": True}, "bias_correction"),
        (OneBitLamb, {"preconditioned_exchange": True}, "preconditioned_exchange"),
        (ZeroOneAdam, {"rescale_variance": True}, "rescale_variance"),
        (ZeroOneAdam, {"compressed_variance_phase": False}, "compressed_variance_phase"),
    ],
)
def test_deepspeed_compatible_refuses_a_contradicting_option(cls, given, name) -> None:
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match=f"deepspeed_compatible=True.*{name}.*drop one"):
        cls(p, deepspeed_compatible=True, **given)


@pytest.mark.parametrize("cls", [OneBitAdam, ZeroOneAdam, OneBitLamb])
def test_deepspeed_compatible_sets_deepspeeds_options(cls) -> None:
    p = [torch.nn.Parameter(torch.zeros(3))]
    opt = cls(p, deepspeed_compatible=True, variance_floor=0.01)  # (the default: no conflict)
    for k, v in cls.DEEPSPEED_ARITHMETIC.items():
        assert getattr(opt, k) == v, k
    with pytest.raises(ValueError, match="deepspeed_compatible must be True or False"):
        cls(p, deepspeed_compatible="yes")
