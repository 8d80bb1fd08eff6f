#!/usr/bin/env bash
# Session 10, device call 4 (one H200): GEMM2's own k-step (MgpuConfig.down_block_k) at M=4096
# (128-wide steps, 4 stages), at decode (512 or 128) and at M=256 (256); then the final
# figures not taken in calls 1-3: symmetric weights at every M, the TP=8 slice, M=1 and 16.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
P="python3 examples/mgpu_probe.py"
timeout 130 $P --m 4096 --configs 64,256,3,2,-,64,1,128,4,128 64,128,4,2,-,64,1,128,4 \
   --json $OUT/m4096.json > $OUT/probe.log 2>&1
timeout 90 $P --m 1 16 --configs 8,256,3,0,-,64,1,-,2,512 8,256,3,0,-,64,1,-,4,128 \
   --json $OUT/decode.json >> $OUT/probe.log 2>&1
timeout 70 $P --m 256 --configs 16,128,3,0,-,128,1,-,3,256 16,128,3,0,-,128,1,-,2,256 \
   --json $OUT/m256.json >> $OUT/probe.log 2>&1
timeout 120 $P --m 1 16 256 4096 --no-zp --json $OUT/tp1_sym.json >> $OUT/probe.log 2>&1
timeout 60 $P --preset deepseek-v3-tp8 --m 1 16 --json $OUT/tp8.json >> $OUT/probe.log 2>&1
grep -E "layer|GEMM|backend|copy|FAILED" $OUT/probe.log
