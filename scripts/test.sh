#!/usr/bin/env bash
# README command 2: set up, lint, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
python -m pytest -q "$@"
