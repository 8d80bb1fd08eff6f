#!/usr/bin/env bash
# Session 10, device calls 5-6 (one H200, the session's last ~300 s): the empty pipeline's
# rate at 1 GB (steady state, ramp amortized), against call 2's 117 MB. Call 5 ran this at
# 577b0cf with 117.4 and 1000 MB, two input sets per loop and an XLA max beside: the loop's
# index into the stacked sets copied each set before the kernel (not kernel figures). As
# committed, this is call 6: one input set, 1 GB.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
for mb in 1000; do
  timeout 100 python3 experiments/stream_probe.py --mbytes $mb --box-kb 16 32 --stages 2 4 \
     --programs 256 1024 >> $OUT/stream.log 2>&1
done
cat $OUT/stream.log
