"""What every test shares: its markers and the fixtures that keep tests independent."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

#: The suite's markers (``-m "not slow"`` runs the fast tests; ``-m long`` the long matrices;
#: ``-m cuda`` the GPU ones).
MARKERS = {
    "slow": "multi-process tests that take more than a few seconds (still run in CI)",
    "cuda": "needs a CUDA GPU",
    "long": "long matrices (every user model x algorithm, sanitizers, multi-node layouts) and "
    "the cases of a matrix beyond the one the suite keeps: scripts/test_long.sh, which CI runs "
    "after the suite; scripts/test.sh leaves them out",
}


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers, so a misspelt one is reported rather than silently selecting nothing."""
    for name, meaning in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    """Give every test the environment the session started with: an in-process fit leaves
    Lightning's launcher variables (``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, ...) in
    ``os.environ``, and a later test would inherit them (see ``tests.helpers.dist.script_env``)."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)
