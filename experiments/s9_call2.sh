#!/usr/bin/env bash
# Session 9, device call 2 (one H200): GEMM1 with silu * up in its epilogue (fused, the new
# default) against the unfused control (7th field 0) and block_n 128, at every M; then the
# compiled gated / wide tests.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
P="python3 examples/mgpu_probe.py"
timeout 200 $P --m 4096 --configs 64,256,3,2,-,64,0 64,256,2,2,-,128,0 64,256,2,2,-,128 \
   64,128,3,2,-,128 64,128,4,2,-,64 --json $OUT/m4096.json > $OUT/probe.log 2>&1
timeout 150 $P --m 1 16 --configs 8,256,4,0,-,64,0 8,128,4,0,-,64 8,256,3,0,-,64 8,128,4,0,-,128,0 \
   --json $OUT/m1_16.json >> $OUT/probe.log 2>&1
timeout 120 $P --m 256 --configs 16,128,4,0,-,64,0 16,128,4,0,-,128 16,128,4,0,-,128,0 \
   --json $OUT/m256.json >> $OUT/probe.log 2>&1
timeout 80 $P --preset deepseek-v3-tp8 --m 1 16 --configs 8,256,4,0,1 8,256,4,0,-,64,0 \
   --json $OUT/tp8.json >> $OUT/probe.log 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_mgpu_gemm.py \
    -k "gated or (wide and not sym) or matches_numpy" --durations=5 > $OUT/tests.log 2>&1
echo "tests rc=$?" >> $OUT/tests.log
grep -v "^$" $OUT/tests.log | tail -12
grep -E "layer|GEMM|copy|FAILED" $OUT/probe.log
