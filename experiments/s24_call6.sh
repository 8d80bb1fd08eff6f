#!/usr/bin/env bash
# Session 24, call 6 (one H200, ~80 s): symmetric weights (no zero points) at the new default
# (GEMM1 of 8-row blocks at 2 stages), the M it changes: DeepSeek-V3 TP=1 M = 1, 16, loop and
# model step.
source experiments/_preamble.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
timeout 90 python3 examples/benchmark.py --implementations mgpu --m 1 16 --straight 32 --no-zp \
  --json $OUT/bench_sym.json > $OUT/bench_sym.log 2>&1
echo "symmetric $SECONDS s"; grep -v Warning $OUT/bench_sym.log
