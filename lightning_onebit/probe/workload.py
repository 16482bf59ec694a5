"""What the probe times as a training step's compute: the user's module (``--model
module:Class`` with its ``example_input_array``) or a stand-in of ``--step-ms``, and the
communication overlapped with its backward as the strategies run it."""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from lightning_onebit.probe.launch import ProbeError
from lightning_onebit.probe.timing import sync

__all__ = ["Compute", "build_model", "load_model_class", "overlapped"]


def load_model_class(spec: str) -> type:
    """``module:Class`` (the current directory importable, as for ``python -m``).

    Raises:
        ProbeError: not of that form, the module does not import, or no such class.
    """
    mod_name, sep, cls_name = spec.partition(":")
    if not sep or not mod_name or not cls_name:
        raise ProbeError(f"--model {spec!r}: expected module:Class, e.g. mypkg.models:LitGPT")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except Exception as err:  # any error while importing the user's module
        raise ProbeError(
            f"--model {spec!r}: importing {mod_name!r} failed ({type(err).__name__}: {err}); "
            "run the probe from the directory your training script runs from, or install the "
            "package"
        ) from err
    obj = module
    for part in cls_name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ProbeError(f"--model {spec!r}: {mod_name!r} has no attribute {cls_name!r}")
    if not isinstance(obj, type) or not issubclass(obj, torch.nn.Module):
        raise ProbeError(f"--model {spec!r}: {cls_name!r} is not a LightningModule/nn.Module")
    return obj


def _as_args(example: Any) -> tuple[tuple, dict]:
    if isinstance(example, dict):
        return (), example
    if isinstance(example, (tuple, list)):
        return tuple(example), {}
    return (example,), {}


def _to(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


def _scalar(out: Any) -> torch.Tensor:
    """A scalar to call backward on from a forward's output (a loss, logits, a dict/tuple)."""
    if isinstance(out, dict):
        out = out.get("loss", next(iter(out.values()), None))
    if isinstance(out, (tuple, list)):
        out = next((o for o in out if isinstance(o, torch.Tensor) and o.requires_grad), None)
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        raise ProbeError(
            "the model's forward(*example_input_array) returned no tensor that requires grad: "
            "return the loss or the outputs, or pass --step-ms"
        )
    return out if out.numel() == 1 else out.float().sum()


def build_model(spec: str, kwargs: dict[str, Any], device: torch.device) -> Any:
    """The user's module on ``device`` and its ``example_input_array`` there.

    Raises:
        ProbeError: the class does not construct, or has no ``example_input_array``.
    """
    cls = load_model_class(spec)
    try:
        model = cls(**kwargs)
    except Exception as err:
        raise ProbeError(f"--model {spec!r}: {cls.__name__}(**{kwargs}) failed: {err}") from err
    example = getattr(model, "example_input_array", None)
    if example is None:
        raise ProbeError(
            f"--model {spec!r}: {cls.__name__} has no example_input_array; set "
            "self.example_input_array to one batch of inputs (one rank's batch) in __init__ so "
            "that the probe can time forward/backward, or pass --step-ms"
        )
    return model.to(device).train(), _to(example, device)


class Compute:
    """One forward/backward of the user's model, or a stand-in of the given duration (a matmul
    loop calibrated alone): what the communication overlaps with."""

    def __init__(
        self, device: torch.device, model: Any = None, example: Any = None, seconds: float = 0.0
    ) -> None:
        self.device, self.model, self.example = device, model, example
        self.seconds, self.iters = seconds, 0
        if model is None and seconds > 0:
            self._a = torch.randn(256, 256, device=device)
            t0, n = time.perf_counter(), 0
            while time.perf_counter() - t0 < 0.05:
                self._mm(8)
                n += 8
            sync(device)
            per = (time.perf_counter() - t0) / n
            self.iters = max(1, round(seconds / per))

    def _mm(self, k: int) -> None:
        for _ in range(k):
            self._a = torch.tanh(self._a @ self._a)

    def forward(self) -> torch.Tensor | None:
        """The model's forward to a scalar to call backward on (``None``: the stand-in)."""
        if self.model is None:
            return None
        self.model.zero_grad(set_to_none=True)
        args, kwargs = _as_args(self.example)
        return _scalar(self.model(*args, **kwargs))

    def backward(self, loss: torch.Tensor | None) -> None:
        """Backward from ``loss``, or the stand-in's calibrated matmul loop."""
        if loss is not None:
            loss.backward()
        elif self.iters:
            self._mm(self.iters)

    def step(self) -> None:
        """One forward and backward."""
        self.backward(self.forward())


def overlapped(
    compute: Compute, comm: Callable[[slice], None], sizes: list[int]
) -> Callable[[], None]:
    """Forward + backward with ``comm`` of every bucket but the last started on a thread when
    backward starts (as the strategies' overlap and DDP do once a bucket is complete) and the
    last bucket after backward."""
    total = sum(sizes) // 4
    head = total - sizes[-1] // 4

    def on_thread(sl: slice) -> None:
        if compute.device.type == "cuda":  # a new thread's current device is 0
            torch.cuda.set_device(compute.device)
            # its own stream, after the work so far, as the strategies' communication thread
            stream = torch.cuda.Stream(compute.device)
            stream.wait_stream(torch.cuda.default_stream(compute.device))
            with torch.cuda.stream(stream):
                comm(sl)
            stream.synchronize()
            return
        comm(sl)

    def run() -> None:
        loss = compute.forward()
        worker = None
        if head:
            worker = threading.Thread(target=on_thread, args=(slice(0, head),))
            worker.start()
        compute.backward(loss)
        if worker is not None:
            worker.join()
        comm(slice(head, total))

    return run
