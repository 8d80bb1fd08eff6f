#!/usr/bin/env bash
# Not yet run (written in session 15, when the device time was spent): the next checks of the
# 128-row default on bf16 weights. GEMM2 at 3 stages (-0.6% on session 15's call 6, one call)
# with its compiled layer test; the threshold between 64- and 128-row blocks at M=3072 (96 rows
# per expert, the current ROWS_FOR_128) and M=2560; each in its own process.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
SECONDS=0
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 150 python3 -m pytest -q tests/test_mgpu_gemm.py \
   -k "deepseek_v3_tp1_gpu or bf16_weights" > $OUT/tests.log 2>&1
tail -2 $OUT/tests.log; grep -E "^FAILED|Error" $OUT/tests.log | head -10; echo "tests $SECONDS s"
B=128,128,3,2,-,64,1,128
timeout 150 python3 examples/mgpu_probe.py --m 4096 --all-gemms --configs $B,3,-,-,-,3,0,0,1 \
   --json $OUT/stages.json > $OUT/probe.log 2>&1; echo "stages $SECONDS s"
timeout 150 python3 examples/mgpu_probe.py --m 2560 3072 --configs 64,256,3,2,-,64,1,128,2,-,-,-,2 \
   $B,2,-,-,-,3,0,0,1 --json $OUT/threshold.json >> $OUT/probe.log 2>&1; echo "threshold $SECONDS s"
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
