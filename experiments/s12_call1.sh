#!/usr/bin/env bash
# Session 12, device call 1 (one H200): the A/B of rows left unwritten (zero_empty / fill, each
# alone, in one run) and 32-row blocks at M=4096 on the current grid (zero code changes).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
timeout 260 python3 experiments/empty_rows_probe.py --m 16 256 4096 > $OUT/empty_rows.log 2>&1
grep -v Warn $OUT/empty_rows.log | tail -20
timeout 200 python3 examples/mgpu_probe.py --m 4096 \
   --configs 32,256,3,2,-,64,1,128,2 32,128,4,2,-,64,1,128,2 --json $OUT/bm32.json \
   > $OUT/probe.log 2>&1
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
