# Sourced by the device scripts from session 16 on (experiments/s16_call*.sh): the repository on
# the path, unbuffered output, $OUT for what comes back (at most 8 files), and a seconds counter.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
SECONDS=0

# compiled_tests <timeout s> <pytest -k expression>: tests/test_mgpu_gemm.py on the GPU into
# $OUT/tests.log (the platform allocator: the DeepSeek-V3 cases hold several GB each).
compiled_tests() {
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout "$1" python3 -m pytest -q tests/test_mgpu_gemm.py \
    -n 4 -k "$2" > "$OUT/tests.log" 2>&1
  tail -2 "$OUT/tests.log"; grep -E "^FAILED|Error" "$OUT/tests.log" | head -10
  echo "tests $SECONDS s"
}
