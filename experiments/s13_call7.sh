#!/usr/bin/env bash
# Session 13, device call 7 (one H200): ptxas' registers and spills of the layer's GEMMs at the
# defaults, M = 16, 256, 4096, as the layer compiles them (with the rows in use: a pipeline per
# width where blocks narrow), no in-kernel profiler.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
timeout 120 python3 examples/mgpu_profile.py --m 16 256 4096 --no-trace --out $OUT/ptxas \
   > $OUT/ptxas.log 2>&1
grep -vE "^$" $OUT/ptxas.log | tail -20
