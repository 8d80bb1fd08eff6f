#!/usr/bin/env bash
# Session 23, call 3 (one H200, ~330 s): the targets not re-measured since session 5 on the
# current kernels. Split-K on the TP=8 slice's GEMM1 (N=512, K=7168) at M = 1, 4, 8, 16: the
# default (auto splits) against 1, 2, 4 and 8 splits and unsplit neighbours (2 and 4 stages),
# each GEMM timed alone (--all-gemms); the alignment kernel alone (device trace) at T = 1, 16,
# 64 (8-row blocks) and 16384 (128-row blocks, the default there; and 64).
source experiments/_preamble.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
timeout 330 python3 examples/mgpu_probe.py --preset deepseek-v3-tp8 --m 1 4 8 16 --all-gemms \
  --configs default:splits=1 default:splits=2 default:splits=4 default:splits=8 \
  default:splits=1,stages=2 default:splits=1,stages=4 --json $OUT/splitk.json > $OUT/splitk.log 2>&1
echo "split-K $SECONDS s"
grep -hE "layer|GEMM|backend|copy|FAILED|rror" $OUT/splitk.log | sed -E 's/\(([0-9A-Za-z]+, ){12}//'
timeout 120 python3 experiments/align_probe.py --sizes 1:8 16:8 64:8 16384:128 16384:64 \
  --default-only > $OUT/align.log 2>&1
echo "align $SECONDS s"; cat $OUT/align.log
