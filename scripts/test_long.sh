#!/usr/bin/env bash
# The long matrices (tests marked `long`: every user model x algorithm next to DDP, the C++
# kernels under sanitizers, the multi-node layouts, and the cases of a matrix beyond the one
# scripts/test.sh keeps): CI runs them after scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
python -m pytest -q -n 2 --dist loadfile --durations=15 -m long "$@"
