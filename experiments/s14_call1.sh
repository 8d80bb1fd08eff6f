#!/usr/bin/env bash
# Session 14, device call 1 (one H200): GEMM2's rows rounded to bf16 (MgpuConfig.bf16_down_rows,
# opt-in) against f32 rows, each M in one process with the GEMMs alone at both configs
# (--all-gemms); compiled GEMM tests first (GEMM2's bf16 output path is gemm_matches_numpy's).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
SECONDS=0
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 90 python3 -m pytest -q -n 4 tests/test_mgpu_gemm.py \
   -k "gemm_matches_numpy or gemm_plan" > $OUT/tests.log 2>&1
tail -2 $OUT/tests.log; grep -E "^FAILED|Error" $OUT/tests.log | head -10; echo "tests $SECONDS s"
D64=64,256,3,2,-,64,1,128,2,-,-,-,2
timeout 170 python3 examples/mgpu_probe.py --m 4096 --all-gemms --configs $D64,1 \
   --json $OUT/m4096.json > $OUT/probe.log 2>&1; echo "m4096 $SECONDS s"
D16=16,128,3,0,-,128,1,-,-,-,-,-,1
timeout 110 python3 examples/mgpu_probe.py --m 256 --all-gemms --configs $D16,1 \
   --json $OUT/m256.json >> $OUT/probe.log 2>&1; echo "m256 $SECONDS s"
D8=8,256,3,0,-,64,1,-,-,-,-,-,1
timeout 110 python3 examples/mgpu_probe.py --m 1 16 --all-gemms --configs $D8,1 \
   --json $OUT/decode.json >> $OUT/probe.log 2>&1; echo "decode $SECONDS s"
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
