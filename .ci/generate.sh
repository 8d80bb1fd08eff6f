#!/usr/bin/env bash
# Sets up .venv (Python 3.12) and runs the main job: a tiny DeepSeek-V3 generation on the CPU.
# Extra arguments go to examples/generate.py (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/python.sh
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q -c .ci/constraints.txt -e .
"$PY" examples/generate.py "$@"
