#!/usr/bin/env bash
# The 'triton' backend on a GPU: installs the carried jax-triton wheel (.whl/, pure Python; the
# GPU image already has jax, jaxlib, triton 3.6.0, numpy and absl-py), runs the gpu-marked tests
# of tests/test_triton_backend.py, then times pallas and triton side by side.
# Fetch the wheel first (on a machine with PyPI), so it travels with the work tree:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 -d .whl jax-triton==0.3.1
# Results land in ${OUT:-out}/.  Usage: bash examples/gpu_triton.sh [extra pytest -k expression]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
python3 -c "import jax, triton, jax_triton; print(jax.__version__, triton.__version__, jax.devices())"
python3 -m pytest -q -rs -p no:cacheprovider --durations=15 -m gpu tests/test_triton_backend.py \
    ${1:+-k "$1"} 2>&1 | tee "$OUT/gpu_triton_tests.log"
python3 examples/benchmark.py --implementations pallas triton --m ${TRITON_MS:-1 16 256 2048 4096 8192} \
    --json "$OUT/bench_triton.json" 2>&1 | tee "$OUT/bench_triton.log"
