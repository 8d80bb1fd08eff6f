#!/usr/bin/env bash
# The GPU check in one go: the kernel tests compiled on the GPU (gpu-marked DeepSeek-V3 cases
# included), then the benchmark (table + JSON + roofline). Results land in ${OUT:-out}/.
# The 1536-case full grid of test_wna16_gemm.py (~75 min serially) runs only with FULL=1, spread
# over 8 workers.
# Usage: bash examples/gpu_suite.sh [extra pytest -k expression]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import jax; print(jax.__version__, jax.devices())"
select="not full_grid"
workers=()
if [ "${FULL:-0}" = 1 ]; then
    select="full_grid"
    workers=(-n 8)
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
fi
python3 -m pytest -q -p no:cacheprovider --durations=20 "${workers[@]}" \
    tests/test_wna16_gemm.py tests/test_fused_moe_kernels.py tests/test_align_kernel.py \
    tests/test_w8a8.py -k "$select${1:+ and ($1)}" 2>&1 | tee "$OUT/gpu_tests.log"
python3 examples/benchmark.py --m 1 16 256 4096 --stages --implementations pallas \
    --json "$OUT/bench.json" --plot "$OUT/roofline.png" 2>&1 | tee "$OUT/bench.log"
