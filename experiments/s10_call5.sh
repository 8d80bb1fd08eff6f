#!/usr/bin/env bash
# Session 10, device call 5 (one H200, the session's last ~300 s): the empty pipeline's rate at
# GEMM1's M=1 size (117 MB) and at 1 GB (steady state, ramp amortized), beside XLA reading the
# same bytes (a max), two input sets per loop. Rerun (call 6): one input set, 1 GB only (two sets made the loop copy each set before the kernel).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
for mb in 1000; do
  timeout 100 python3 experiments/stream_probe.py --mbytes $mb --box-kb 16 32 --stages 2 4 \
     --programs 256 1024 >> $OUT/stream.log 2>&1
done
cat $OUT/stream.log
