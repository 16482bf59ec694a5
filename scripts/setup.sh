#!/usr/bin/env bash
# Create or reuse .venv and install the project with its test, example and lint extras.
# CPU torch 2.13.0 first where torch is missing (on these machines it installs from local disk;
# a plain "torch" requirement could pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
# --no-compile: the installed modules are byte-compiled once at the end, on every core (pip
# compiles them one by one)
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q --no-compile torch==2.13.0 \
    || python -m pip install -q --no-compile torch --index-url https://download.pytorch.org/whl/cpu
fi
# Builds the C++ extension (and the CUDA kernels when nvcc is on PATH; ONEBIT_CUDA=OFF skips them);
# the test and lint tools are pyproject.toml's dependency group "dev" (pip >= 25.1).
python -m pip install -q --no-compile -e '.[examples]' --group dev
# (files already compiled are skipped; the few that do not compile, such as torch's tests for
# newer Pythons, are left out, as pip leaves them out)
python -m compileall -qq -j 0 "$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" || true
