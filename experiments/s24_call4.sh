#!/usr/bin/env bash
# Session 24, call 4 (one H200, ~450 s): the new default (GEMM1 of 8-row blocks at 2 stages,
# GEMM2 at 3, where I >= 2048 or slots <= 128): compiled tests of the DeepSeek-V3 layers at
# their defaults (TP=1 and the TP=8 slice) against 'xla'; the benchmark at the M it
# changes (TP=1 M = 1, 16; TP=8 M = 1, 16), loop and model step; split-K on the TP=8 GEMM1
# again in a model step, now with every call's output kept (call 3's link read one element of
# each output, and XLA left a K-split GEMM's sum of partials undone but for the last call).
source experiments/_preamble.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
compiled_tests 150 "deepseek_v3_tp or matches_numpy"
timeout 120 python3 examples/benchmark.py --implementations mgpu --m 1 16 --straight 32 \
  --json $OUT/bench_tp1.json > $OUT/bench_tp1.log 2>&1
echo "tp1 $SECONDS s"; grep -v Warning $OUT/bench_tp1.log
timeout 90 python3 examples/benchmark.py --preset deepseek-v3-tp8 --implementations mgpu \
  --m 1 16 --straight 32 --json $OUT/bench_tp8.json > $OUT/bench_tp8.log 2>&1
echo "tp8 $SECONDS s"; grep -v Warning $OUT/bench_tp8.log
SPLITS="default:splits=1,stages=2 default:splits=1,stages=3 default:splits=2,stages=2
  default:splits=2,stages=3 default:splits=4,stages=2 default:splits=4,stages=3"
timeout 130 python3 examples/mgpu_probe.py --preset deepseek-v3-tp8 --m 4 1 --gemms-only 1 \
  --straight 16 --configs $SPLITS default:splits=8,stages=3 default:splits=1,stages=4 \
  --json $OUT/splitk_small.json > $OUT/splitk_small.log 2>&1
echo "split-K 1, 4: $SECONDS s"
timeout 80 python3 examples/mgpu_probe.py --preset deepseek-v3-tp8 --m 8 16 --gemms-only 1 \
  --straight 16 --configs $SPLITS --json $OUT/splitk_large.json > $OUT/splitk_large.log 2>&1
echo "split-K 8, 16: $SECONDS s"
grep -hE "GEMM1 (traced|straight|  )|copy|FAILED|rror" $OUT/splitk_small.log $OUT/splitk_large.log \
  | sed -E 's/, (True|False), None, [0-9None]+, None, None, None, [^)]*\)/)/' | cut -c1-110
