#!/usr/bin/env bash
# Session 11, device call 4 (one H200): the chained layer again, each call's input its set's
# random x plus 1e-30 x the last output (call 3's chain fed outputs back as they were: at
# M=4096 7242.8 vs 7792.8 us, values that grow or vanish over the calls); the final figures.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
P="python3 examples/mgpu_probe.py --chain"
timeout 50 $P --preset deepseek-v3-tp8 --m 1 16 --json $OUT/tp8.json > $OUT/probe.log 2>&1
timeout 330 $P --m 1 16 256 4096 --json $OUT/tp1.json >> $OUT/probe.log 2>&1
grep -E "layer|chained|GEMM|backend|copy|FAILED" $OUT/probe.log
