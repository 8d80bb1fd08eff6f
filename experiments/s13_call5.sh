#!/usr/bin/env bash
# Session 13, device call 5 (one H200): the final defaults without zero points (symmetric
# weights) at M = 1, 16, 256, 4096 and the TP=8 slice at M=1; then with zero points at M=4096
# again (the spread between calls).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
timeout 150 python3 examples/mgpu_probe.py --no-zp --m 1 16 256 --json $OUT/sym_small.json \
   > $OUT/probe.log 2>&1
timeout 50 python3 examples/mgpu_probe.py --no-zp --preset deepseek-v3-tp8 --m 1 \
   --json $OUT/sym_tp8.json >> $OUT/probe.log 2>&1
timeout 110 python3 examples/mgpu_probe.py --no-zp --m 4096 --json $OUT/sym_4096.json \
   >> $OUT/probe.log 2>&1
timeout 110 python3 examples/mgpu_probe.py --m 4096 --json $OUT/zp_4096.json >> $OUT/probe.log 2>&1
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
