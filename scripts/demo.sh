#!/usr/bin/env bash
# README command 1: set up and run the main demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python examples/compare.py "$@"
