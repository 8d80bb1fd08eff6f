#!/usr/bin/env bash
# Sets up .venv (Python 3.12) and runs the main job: a tiny DeepSeek-V3 generation on the CPU.
# Extra arguments go to examples/generate.py (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/python.sh
# Installs on the first run only (or when the package is missing): a later run starts at once
# and needs no package index.
if ! "$PY" -c "import importlib.metadata as m, wna16_jax, models; m.version('wna16_jax')" \
    2>/dev/null; then
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q -c .ci/constraints.txt -e .
fi
"$PY" examples/generate.py "$@"
