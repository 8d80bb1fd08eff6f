#!/usr/bin/env bash
# Session 22, call 5 (one H200, ~320 s): the new default (GEMM2 of 8-row blocks at 128 features
# from 64 slots where its K has 8 k-steps: DeepSeek-V3 TP=1 from M=8). Compiled tests: the
# DeepSeek-V3 TP=1 layer at t = 1, 64 (the new default), 4096, the layer cases against numpy and
# the config tests; then the figures at M = 1, 16, 64, 256 (zero points, one process).
source experiments/_preamble.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
compiled_tests 200 "deepseek_v3_tp1 or matches_numpy or default_config"
timeout 250 python3 examples/mgpu_probe.py --m 1 16 64 256 --json $OUT/defaults.json \
  > $OUT/defaults.log 2>&1
echo "probe $SECONDS s"
grep -hE "layer|GEMM|backend|copy|FAILED|rror" $OUT/defaults.log | sed -E 's/\(([0-9A-Za-z]+, ){12}//'
