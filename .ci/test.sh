#!/usr/bin/env bash
# Sets up a Python 3.12 virtual environment in .venv and runs the test suite (CPU, kernels in
# the Pallas interpreter). This is the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/python.sh
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q -c .ci/constraints.txt -e ".[test]"
"$PY" -m ruff check .
# A test whose xdist worker crashes runs once more (pytest-rerunfailures); a failed assertion
# does not: --only-rerun matches no exception, so only crashed workers' tests are rerun. Seen
# in about one clean CPU run in two: a segfault inside jaxlib's CPU compiler or the Mosaic GPU
# interpreter's callbacks, in a different test each time, each of which passed alone.
"$PY" -m pytest -q -n 2 --durations=15 --reruns 1 --only-rerun "^worker crashed$" "$@"
