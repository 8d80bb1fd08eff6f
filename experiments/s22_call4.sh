#!/usr/bin/env bash
# Session 22, call 4 (one H200, on call 3's machine while warm, ~165 s): GEMM2 at 128 features
# at M = 32, 64, 128 (TP=1) and at M = 8, 16 on the TP=8 slice (GEMM2's K = 256: one k-step).
source experiments/_preamble.sh
timeout 250 python3 examples/mgpu_probe.py --m 32 64 128 --configs default:down_block_n=128 \
  > $OUT/down128_large.log 2>&1
timeout 150 python3 examples/mgpu_probe.py --preset deepseek-v3-tp8 --m 8 16 \
  --configs default:down_block_n=128 > $OUT/down128_tp8.log 2>&1
echo "$SECONDS s"
grep -hE "layer|backend|copy|FAILED|rror" $OUT/down128_*.log | sed -E 's/\(([0-9A-Za-z]+, ){12}//'
