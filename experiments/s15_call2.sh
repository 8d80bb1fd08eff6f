#!/usr/bin/env bash
# Session 15, device call 2 (one H200): GEMM2 with staggered consumers (mgpu_wna16_gemm's
# stagger, MgpuConfig.down_stagger, the 16th --configs field): compiled tests of the staggered
# GEMM and layer, then M=4096 (zero points) at the default against staggered runs of 4, 7 and 14
# tiles and unstaggered runs of 7, each GEMM alone too (--all-gemms); one process.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
SECONDS=0
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 150 python3 -m pytest -q -n 4 tests/test_mgpu_gemm.py \
   -k "stagger" > $OUT/tests.log 2>&1
tail -2 $OUT/tests.log; grep -E "^FAILED|Error" $OUT/tests.log | head -10; echo "tests $SECONDS s"
D=64,256,3,2,-,64,1,128,2
timeout 300 python3 examples/mgpu_probe.py --m 4096 --all-gemms --json $OUT/stagger.json \
   --configs $D,-,-,7,2 $D,-,-,4,2,0,0,1 $D,-,-,7,2,0,0,1 $D,-,-,14,2,0,0,1 \
   > $OUT/stagger.log 2>&1; echo "probe $SECONDS s"
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/stagger.log
