"""``python -m lightning_onebit.probe``: the probe's command line (``lightning_onebit.probe.cli``)."""

from __future__ import annotations

import sys

from lightning_onebit.probe.cli import main

if __name__ == "__main__":
    sys.exit(main())
