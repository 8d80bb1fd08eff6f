#!/usr/bin/env bash
# Sets up a Python 3.12 virtual environment in .venv and runs the test suite (CPU, kernels in
# the Pallas interpreter). This is the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/python.sh
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q -c .ci/constraints.txt -e ".[test]"
"$PY" -m ruff check .
"$PY" -m pytest -q -n 2 --durations=15 "$@"
