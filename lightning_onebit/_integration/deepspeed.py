"""DeepSpeed JSON configs of the 1-bit optimizers, read into the 1-bit strategies' options.

DeepSpeed (up to 0.19.6) configured its 1-bit optimizers in the ``"optimizer"`` section of its
JSON config: ``{"type": "OneBitAdam" | "ZeroOneAdam" | "OneBitLamb", "params": {...}}``. Every
parameter of those optimizers maps to an option here, is refused by name, or has no meaning
here (said once, with what to do instead). The rest of a DeepSpeed config belongs to the
Trainer or the Fabric loop, the DataLoader or the model; the keys with a training effect are
named with their equivalent in the user's front end (``FrontEnd``), since the
strategy does not apply them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lightning_onebit._integration.front_end import FrontEnd

__all__ = ["HPARAMS", "TYPES", "load", "read"]

#: DeepSpeed's optimizer type (lower-cased, as DeepSpeed compares it) -> our algorithm
TYPES = {"onebitadam": "onebit_adam", "zerooneadam": "zero_one_adam", "onebitlamb": "onebit_lamb"}

#: the optimizer hyperparameters (of every param group)
HPARAMS = ("lr", "betas", "eps", "weight_decay")

#: DeepSpeed parameter -> strategy option, per algorithm
_OPTIONS = {
    "onebit_adam": {"freeze_step": "freeze_step"},
    "zero_one_adam": {
        "var_freeze_step": "freeze_step",
        "var_update_scaler": "var_update_scaler",
        "local_step_scaler": "local_step_scaler",
        "local_step_clipper": "local_step_clipper",
    },
    "onebit_lamb": {
        "freeze_step": "freeze_step",
        "max_coeff": "max_coeff",
        "min_coeff": "min_coeff",
        "coeff_beta": "coeff_beta",
        "factor_max": "factor_max",
        "factor_min": "factor_min",
        "factor_threshold": "factor_threshold",
    },
}

#: DeepSpeed parameters that have no effect here, and why
_NO_MEANING = {
    "cuda_aware": "the transport is torch.distributed's (NCCL on GPUs, gloo on CPUs)",
    "comm_backend_name": "the backend is the process group's ({start} or torchrun decides it)",
    "bias_correction": "DeepSpeed's 1-bit optimizers accept it but never apply a bias correction, "
    "nor does deepspeed_compatible=True, which a DeepSpeed config turns on",
    "eps_inside_sqrt": "eps is added outside the square root, as DeepSpeed's 1-bit optimizers do",
    "max_grad_norm": "DeepSpeed's 1-bit optimizers ignore it; clip with {clip}",
}

#: top-level DeepSpeed keys with a training effect that the strategies do not apply, and where
#: they go instead (``{...}``: a field of the user's ``FrontEnd``)
_ELSEWHERE = {
    "train_batch_size": "{batch_size}",
    "train_micro_batch_size_per_gpu": "your DataLoader's batch_size",
    "gradient_accumulation_steps": "{accumulate}",
    "gradient_clipping": "{clip}",
    "fp16": "{fp16}",
    "bf16": "{bf16}",
    "scheduler": "{scheduler}",
    "zero_optimization": "nothing: the 1-bit optimizers keep a full optimizer state on every "
    "rank (DeepSpeed's did not support ZeRO either)",
}


def load(config: str | os.PathLike[str] | dict[str, Any]) -> dict[str, Any]:
    """A DeepSpeed config as a dict (from a JSON file path or a dict)."""
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(f"DeepSpeed config {str(path)!r} does not exist")
        return json.loads(path.read_text())
    raise TypeError(
        f"deepspeed_config must be a path to a DeepSpeed JSON config or a dict, got {type(config).__name__}"
    )


def _where(text: str, front_end: FrontEnd) -> str:
    """``text`` with the ``{...}`` fields of ``front_end`` filled in."""
    return text.format(
        fp16=front_end.precision.format("'16-mixed'"),
        bf16=front_end.precision.format("'bf16-mixed'"),
        **{k: v for k, v in vars(front_end).items() if k != "precision"},
    )


def read(
    config: str | os.PathLike[str] | dict[str, Any], front_end: FrontEnd
) -> tuple[str, dict[str, Any], dict[str, Any], list[str]]:
    """``(algorithm, strategy options, optimizer hyperparameters, notes)`` of a DeepSpeed config;
    the notes name what to do instead in ``front_end``'s terms (the Trainer's or Fabric's).

    Raises ``ValueError`` naming what cannot be run here: another optimizer type, an unknown
    parameter, ``amsgrad=True``.
    """
    cfg = load(config)
    section = cfg.get("optimizer")
    if not isinstance(section, dict) or "type" not in section:
        raise ValueError(
            'the DeepSpeed config has no "optimizer": {"type": ..., "params": {...}} section; '
            f"a 1-bit config has one of type {', '.join(_ds_names())}"
        )
    algorithm = TYPES.get(str(section["type"]).lower())
    if algorithm is None:
        raise ValueError(
            f"DeepSpeed optimizer type {section['type']!r} is not a 1-bit optimizer: "
            f"the 1-bit strategies run {', '.join(_ds_names())}; for another optimizer use "
            "strategy='ddp' (or Lightning's DeepSpeedStrategy)"
        )
    unknown_section = sorted(set(section) - {"type", "params"})
    if unknown_section:
        raise ValueError(f'unknown keys in the DeepSpeed "optimizer" section: {unknown_section}')
    params = dict(section.get("params") or {})
    options: dict[str, Any] = {"algorithm": algorithm}
    hparams: dict[str, Any] = {}
    notes: list[str] = []
    mapping = _OPTIONS[algorithm]
    for key, value in params.items():
        if key in HPARAMS:
            hparams[key] = tuple(value) if key == "betas" else value
        elif key in mapping:
            options[mapping[key]] = value
        elif key == "amsgrad":
            if value:
                raise ValueError(
                    f"amsgrad=True: {section['type']} has no AMSGrad variant (nor had DeepSpeed's)"
                )
        elif key in _NO_MEANING:
            why = _where(_NO_MEANING[key], front_end)
            notes.append(f"optimizer.params.{key}: no effect here ({why})")
        else:
            known = sorted((*HPARAMS, *mapping, "amsgrad", *_NO_MEANING))
            raise ValueError(
                f"unknown parameter {key!r} for DeepSpeed's {section['type']} (known: {known})"
            )
    for key in sorted(set(cfg) & set(_ELSEWHERE)):
        if key in ("fp16", "bf16") and not (cfg[key] or {}).get("enabled", False):
            continue
        where = _where(_ELSEWHERE[key], front_end)
        notes.append(f"{key}: not applied by the strategy; here it is {where}")
    return algorithm, options, hparams, notes


def _ds_names() -> list[str]:
    return ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"]
