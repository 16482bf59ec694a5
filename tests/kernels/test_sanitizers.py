"""Run the C++ kernel checks under AddressSanitizer + UBSan (scripts/sanitize.sh)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.skipif(
    not (shutil.which("cmake") and shutil.which("c++")), reason="needs cmake and a C++ compiler"
)
def test_cpu_kernels_are_clean_under_asan_and_ubsan(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "sanitize.sh"), str(tmp_path / "build")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(", 0 failures") == 2, proc.stdout
    assert "avx2" in proc.stdout or "portable" in proc.stdout
