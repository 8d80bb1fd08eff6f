#!/usr/bin/env bash
# Session 11, device call 1 (one H200): where a call's time goes on the GPU timeline
# (examples/kernel_timeline.py: each kernel's time and the idle gaps between kernels, in the
# probe's loop), for the mgpu layer at TP=1 and the TP=8 slice; then GEMM2 at 128 features per
# warpgroup for 8-row blocks (M=16), and GEMM1 not K-split at the TP=8 slice (M=1).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
T="python3 examples/kernel_timeline.py"
timeout 200 $T --m 1 16 256 4096 --implementation mgpu --json $OUT/timeline_tp1.json \
   > $OUT/timeline.log 2>&1
timeout 100 $T --preset deepseek-v3-tp8 --m 1 16 --implementation mgpu pallas \
   --json $OUT/timeline_tp8.json >> $OUT/timeline.log 2>&1
cat $OUT/timeline.log | grep -v Warning | head -150
P="python3 examples/mgpu_probe.py"
timeout 90 $P --m 16 --configs 8,256,3,0,-,64,1,128 8,256,3,0,-,64,1,128,2 \
   --json $OUT/m16.json > $OUT/probe.log 2>&1
timeout 60 $P --preset deepseek-v3-tp8 --m 1 --configs 8,256,3,0,1 8,256,3,0,2,64,0 \
   --json $OUT/tp8.json >> $OUT/probe.log 2>&1
grep -E "layer|GEMM|backend|copy|FAILED" $OUT/probe.log
