#!/usr/bin/env bash
# Session 15, device call 6 (one H200): the new M=4096 default (128-row blocks on bf16 weights)
# against its neighbours, one process, each GEMM alone too: GEMM2 at 3 stages, GEMM1 at 4 stages,
# GEMM2 at 64 features per consumer, GEMM2's rows in bf16 (the opt-in).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
SECONDS=0
B=128,128
timeout 270 python3 examples/mgpu_probe.py --m 4096 --all-gemms --json $OUT/around.json --configs \
   $B,3,2,-,64,1,128,3,-,-,-,3,0,0,1 $B,4,2,-,64,1,128,2,-,-,-,3,0,0,1 \
   $B,3,2,-,64,1,64,2,-,-,-,3,0,0,1 $B,3,2,-,64,1,128,2,-,-,-,3,1,0,1 \
   > $OUT/around.log 2>&1; echo "probe $SECONDS s"
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/around.log
