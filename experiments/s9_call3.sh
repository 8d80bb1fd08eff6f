#!/usr/bin/env bash
# Session 9, device call 3 (one H200): fused GEMM1 with 128 features per consumer at M=4096 (the
# one-buffer store makes 2 stages of 256 fit), stages 2-3 at decode, block_n 128 at M=256, then
# the compiled gated / wide / layer tests.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
P="python3 examples/mgpu_probe.py"
timeout 150 $P --m 4096 --configs 64,256,2,2,-,128 128,128,2,2,-,128 128,128,3,2,-,64 \
   --json $OUT/m4096.json > $OUT/probe.log 2>&1
timeout 130 $P --m 1 16 --configs 8,256,3,0 8,256,2,0 8,512,2,0 8,256,3,0,-,128 \
   --json $OUT/m1_16.json >> $OUT/probe.log 2>&1
timeout 100 $P --m 256 --configs 16,128,4,0,-,128 16,128,3,0,-,128 16,256,3,0,-,128 \
   --json $OUT/m256.json >> $OUT/probe.log 2>&1
timeout 70 $P --preset deepseek-v3-tp8 --m 1 16 --configs 8,256,3,0 8,256,3,0,2 \
   --json $OUT/tp8.json >> $OUT/probe.log 2>&1
timeout 190 python3 -m pytest -q -p no:cacheprovider tests/test_mgpu_gemm.py \
    -k "test_gemm_gated or fused_moe or (deepseek_v3_wide and zp)" --durations=5 > $OUT/tests.log 2>&1
echo "tests rc=$?" >> $OUT/tests.log
grep -v "^$" $OUT/tests.log | tail -12
grep -E "layer|GEMM|copy|FAILED" $OUT/probe.log
