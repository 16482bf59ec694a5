"""``lightning-onebit probe``: will 1-bit compression speed up training on this cluster?

Started like the training job, every rank measures the links, the model's compute and each
method at the model's size; rank 0 predicts each method's step and run time and recommends
``OneBitStrategy`` options or "stay with DDP". The command line and what it measures:
``python -m lightning_onebit.probe --help`` (``lightning_onebit.probe.cli``). The modules, each
importing only the ones before it:

- ``launch``: how the job was started (``detect_launch``) and ``ProbeError``;
- ``timing``: timing across ranks, the links' fit (``Link``), buckets, ``expected_slowest``;
- ``workload``: the user's model (``--model``) or a ``--step-ms`` stand-in, and the
  communication overlapped with its backward;
- ``measure``: ``probe``, what every rank measures (``Measured``);
- ``costs``: the cost model, each method's predicted step and run time;
- ``recommend``: ``predict``, the costs and the recommendation;
- ``report``: the console report;
- ``cli``: ``main`` and the ``lightning-onebit`` console script (``cli``).
"""

from __future__ import annotations

from lightning_onebit.probe.cli import cli, main
from lightning_onebit.probe.launch import LaunchInfo, ProbeError, detect_launch
from lightning_onebit.probe.measure import Measured, probe
from lightning_onebit.probe.recommend import BUCKET_CHOICES, MIN_GAIN, predict
from lightning_onebit.probe.report import report
from lightning_onebit.probe.timing import (
    FIRST_BUCKET_BYTES,
    Link,
    expected_slowest,
    fit_link,
    measure_link,
)
from lightning_onebit.probe.workload import build_model, load_model_class

__all__ = [
    "BUCKET_CHOICES",
    "FIRST_BUCKET_BYTES",
    "MIN_GAIN",
    "LaunchInfo",
    "Link",
    "Measured",
    "ProbeError",
    "build_model",
    "cli",
    "detect_launch",
    "expected_slowest",
    "fit_link",
    "load_model_class",
    "main",
    "measure_link",
    "predict",
    "probe",
    "report",
]
