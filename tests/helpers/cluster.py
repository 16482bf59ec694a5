"""The emulated-cluster benchmark (``benchmarks/cluster.py``) as a module, and whether this
machine can run it (network namespaces need root and iproute2)."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cluster.py"


def cluster_module() -> ModuleType:
    """``benchmarks/cluster.py``, imported from its path (``benchmarks`` is not a package)."""
    spec = importlib.util.spec_from_file_location("_bench_cluster", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def skip_reason() -> str | None:
    """Why the emulated cluster cannot run here, or ``None`` when it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "iproute2 (ip, tc) is not installed"
    cluster = cluster_module()
    try:
        cluster.check_netns()
    except cluster.ClusterUnavailable as err:
        return f"cannot create network namespaces here: {err}"
    return None
