#!/usr/bin/env bash
# Not yet run (written in session 14, when no device time was left): the first GPU run of
# MgpuConfig.direct_token (one token's GEMM1 on the token's row itself, the router's ids as block
# experts): its compiled tests, then M=1 at the TP=1 and TP=8 defaults against the same configs
# with direct_token (the 15th --configs field), one process per preset.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
SECONDS=0
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 120 python3 -m pytest -q -n 4 tests/test_mgpu_gemm.py \
   -k "one_row_tile or one_token" > $OUT/tests.log 2>&1
tail -2 $OUT/tests.log; grep -E "^FAILED|Error" $OUT/tests.log | head -10; echo "tests $SECONDS s"
D8=8,256,3,0,-,64,1,-,-,-,-,-,1
timeout 90 python3 examples/mgpu_probe.py --m 1 --configs $D8,0,1 --json $OUT/tp1.json \
   > $OUT/probe.log 2>&1
timeout 60 python3 examples/mgpu_probe.py --preset deepseek-v3-tp8 --m 1 --configs $D8,0,1 \
   --json $OUT/tp8.json >> $OUT/probe.log 2>&1; echo "probes $SECONDS s"
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
