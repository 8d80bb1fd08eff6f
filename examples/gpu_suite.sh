#!/usr/bin/env bash
# The GPU check in one go: the test suite compiled on the GPU (gpu-marked tests included), then
# the benchmark (table + JSON + roofline). Results land in ${OUT:-out}/.
# Usage: bash examples/gpu_suite.sh [pytest -k expression]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import jax; print(jax.__version__, jax.devices())"
python3 -m pytest -q -x --durations=20 tests/test_wna16_gemm.py tests/test_fused_moe_kernels.py \
    tests/test_align_kernel.py ${1:+-k "$1"} 2>&1 | tee "$OUT/gpu_tests.log"
python3 examples/benchmark.py --stages --json "$OUT/bench.json" --plot "$OUT/roofline.png" \
    2>&1 | tee "$OUT/bench.log"
