#!/usr/bin/env bash
# Session 16, device call 1 (one H200): session 15's pending checks of the 128-row default
# (its experiments/pending_s16.sh, removed once run here, without the test run): GEMM2 at 3
# stages at M=4096, each GEMM alone too; the 64/128-row threshold at M=2560 and 3072; then where
# a call's time goes at M=16 and M=256 (kernel_timeline.py, chained).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
SECONDS=0
B=128,128,3,2,-,64,1,128
timeout 170 python3 examples/mgpu_probe.py --m 4096 --all-gemms --configs $B,3,-,-,-,3,0,0,1 \
   --json $OUT/stages.json > $OUT/probe.log 2>&1; echo "stages $SECONDS s"
timeout 200 python3 examples/mgpu_probe.py --m 2560 3072 --configs 64,256,3,2,-,64,1,128,2,-,-,-,2 \
   $B,2,-,-,-,3,0,0,1 --json $OUT/threshold.json >> $OUT/probe.log 2>&1; echo "threshold $SECONDS s"
timeout 150 python3 examples/kernel_timeline.py --m 16 256 --calls 20 --json $OUT/timeline.json \
   > $OUT/timeline.log 2>&1; echo "timeline $SECONDS s"
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
grep -v "^WARNING" $OUT/timeline.log | tail -30
