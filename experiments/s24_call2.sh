#!/usr/bin/env bash
# Session 24, call 2 (one H200, ~400 s): split-K on the TP=8 slice's GEMM1 (N=512, K=7168) timed
# as a model step runs it. Session 23 timed GEMM1 alone in a jitted loop, whose wait on the host
# (~10 us per iteration at M=1) is counted in every figure on both sides of the ratio. Here
# GEMM1 alone at M = 4, 16, 8, 1, each config in the loop and with 16 calls written out in one
# jit on 16 routings (mgpu_probe.py --gemms-only 1 --straight 16): unsplit at 2, 3, 4 stages,
# 2/4/8 splits at 3 and 2 stages.
source experiments/_preamble.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
timeout 420 python3 examples/mgpu_probe.py --preset deepseek-v3-tp8 --m 4 16 8 1 --gemms-only 1 \
  --straight 16 --configs default:splits=1 default:splits=1,stages=2 default:splits=1,stages=4 \
  default:splits=2 default:splits=4 default:splits=8 default:splits=2,stages=2 \
  default:splits=4,stages=2 --json $OUT/splitk.json > $OUT/splitk.log 2>&1
echo "split-K $SECONDS s"
grep -hE "GEMM|copy|FAILED|rror" $OUT/splitk.log | sed -E 's/, (True|False), None, None, None, None, None, .*\)/)/'
