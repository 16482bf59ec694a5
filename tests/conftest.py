"""Shared test fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    """Give every test the environment the session started with: an in-process fit leaves
    Lightning's launcher variables (``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, ...) in
    ``os.environ``, and a later test would inherit them (see ``tests._dist.script_env``)."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)
