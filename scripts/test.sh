#!/usr/bin/env bash
# README command 2: set up, lint, and run the test suite (all but the long matrices, which
# scripts/test_long.sh runs), on two pytest workers, each test file on one of them (files share
# their reference runs between tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
python -m pytest -q -n 2 --dist loadfile --durations=15 -m "not long" "$@"
