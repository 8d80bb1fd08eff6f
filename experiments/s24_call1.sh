#!/usr/bin/env bash
# Session 24, call 1 (one H200, ~500 s; session 23's pending_s23_two_stages.sh, renamed): 2
# stages for 8-row blocks at decode, before it becomes the default. Session 23 measured the layer 2.8-9% faster at M=16 (TP=1 646.0 -> 628.0,
# TP=8 151.4 -> 137.7 and 149.9 -> 136.2), TP=1 M=64 1327.0 -> 1282.8, M=1 equal (71.3 / 70.9).
# First the compiled tests of 8-row blocks at 2 stages (never compiled-tested before: GEMM1
# gated and GEMM2-like at 2 stages; the DeepSeek-V3 TP=1 layer at t = 16, 64 against 'xla'),
# then the layer at M = 2, 4, 8, 32, 128 (TP=1) and 1, 4, 8, 32 (TP=8), default vs 2 stages.
source experiments/_preamble.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
compiled_tests 200 "deepseek_v3_tp1 or (wide_warpgroups and 256-2-) or matches_numpy"
timeout 220 python3 examples/mgpu_probe.py --m 2 4 8 32 128 --configs default:stages=2 \
  --json $OUT/stages2_tp1.json > $OUT/stages2_tp1.log 2>&1
echo "tp1 $SECONDS s"
grep -hE "mgpu layer|copy|FAILED|rror" $OUT/stages2_tp1.log | sed -E 's/\(([0-9A-Za-z]+, ){1}//'
timeout 100 python3 examples/mgpu_probe.py --preset deepseek-v3-tp8 --m 1 4 8 32 \
  --configs default:stages=2 --json $OUT/stages2_tp8.json > $OUT/stages2_tp8.log 2>&1
echo "tp8 $SECONDS s"
grep -hE "mgpu layer|backend  |copy|FAILED|rror" $OUT/stages2_tp8.log | sed -E 's/\(([0-9A-Za-z]+, ){1}//'
