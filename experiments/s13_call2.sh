#!/usr/bin/env bash
# Session 13, device call 2 (one H200): M=256 and 4096, each against the default in the same
# run: the top-k sum in GEMM2 (field 14), programs not awaiting their writes (field 15), both;
# M=256: 32-row blocks narrowed to 16 and 8 rows (one config for uniform and one-prompt
# routing); M=4096: quarter blocks.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
D=16,128,3,0,-,128,1,-,-,-,-,-,1
timeout 200 python3 examples/mgpu_probe.py --m 256 --json $OUT/m256.json \
   --configs $D,1 $D,-,0 $D,1,0 32,128,3,0,-,128,1,-,-,-,-,-,2 $D > $OUT/probe.log 2>&1
D=64,256,3,2,-,64,1,128,2,-,-,-,1
timeout 300 python3 examples/mgpu_probe.py --m 4096 --json $OUT/m4096.json \
   --configs $D,1 $D,-,0 $D,1,0 64,256,3,2,-,64,1,128,2,-,-,-,2 $D >> $OUT/probe.log 2>&1
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
