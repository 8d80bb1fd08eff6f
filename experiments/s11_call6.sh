#!/usr/bin/env bash
# Session 11, device call 6 (one H200): the final code's timeline (the gather_rows kernel in
# the layer) and the decode figures, TP=1 and the TP=8 slice.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
timeout 60 python3 examples/kernel_timeline.py --m 16 256 4096 --json $OUT/timeline_tp1.json \
   > $OUT/timeline.log 2>&1
grep -v Warn $OUT/timeline.log | head -40
timeout 80 python3 examples/mgpu_probe.py --m 1 16 --json $OUT/tp1.json > $OUT/probe.log 2>&1
timeout 50 python3 examples/mgpu_probe.py --preset deepseek-v3-tp8 --m 1 16 \
   --json $OUT/tp8.json >> $OUT/probe.log 2>&1
grep -E "layer|GEMM|backend|copy|FAILED" $OUT/probe.log
