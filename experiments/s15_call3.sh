#!/usr/bin/env bash
# Session 15, device call 3 (one H200): the GEMMs on weights rounded to bf16
# (MgpuConfig.bf16_weights, the 16th --configs field: no f32 sum per group, room for 128-row
# blocks): compiled tests, then M=4096 (zero points) at the default, the default on bf16 weights,
# 128-row blocks on bf16 weights (GEMM2 k-steps of 128 or 256) and 128-row blocks as they are
# (exact; session 10 saw ptxas spill 1000 bytes in GEMM1), each GEMM alone too; one process.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
SECONDS=0
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 150 python3 -m pytest -q -n 4 tests/test_mgpu_gemm.py \
   -k "bf16_weights" > $OUT/tests.log 2>&1
tail -2 $OUT/tests.log; grep -E "^FAILED|Error" $OUT/tests.log | head -10; echo "tests $SECONDS s"
D=64,256,3,2,-,64,1,128,2,-,-,-,2
B=128,128,3,2,-,64,1,128,2
timeout 360 python3 examples/mgpu_probe.py --m 4096 --all-gemms --json $OUT/bf16w.json \
   --configs $D,0,0,1 $B,-,-,-,3,0,0,1 $B,256,-,-,3,0,0,1 $B,-,-,-,3 \
   > $OUT/bf16w.log 2>&1; echo "probe $SECONDS s"
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/bf16w.log
