#!/usr/bin/env bash
# The documentation site, as CI builds it: the "docs" dependency group into .venv (set up by
# scripts/setup.sh when missing), then `mkdocs build --strict` (a broken link, anchor, snippet
# or API reference fails). Extra arguments go to mkdocs build. To read the site locally:
# `pip install --group docs && mkdocs serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
. .venv/bin/activate
python -m pip install -q --group docs
NO_MKDOCS_2_WARNING=1 mkdocs build --strict "$@"
