#!/usr/bin/env bash
# Session 23, call 2 (one H200, ~450 s): the benchmark with the model-step timing
# (benchmark.py --straight 32: 32 layer calls written out in one jit, steps queued back to back,
# the marginal time of a queued step per call) beside the loop's figure, at the targets' M:
# DeepSeek-V3 TP=1 with and without zero points, and the TP=8 slice at M=1.
source experiments/_preamble.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
timeout 240 python3 examples/benchmark.py --implementations mgpu --m 1 16 256 4096 --straight 32 \
  --json $OUT/bench_zp.json > $OUT/bench_zp.log 2>&1
echo "zp $SECONDS s"; cat $OUT/bench_zp.log | grep -v Warning
timeout 120 python3 examples/benchmark.py --implementations mgpu --m 1 16 256 --straight 32 \
  --no-zp --json $OUT/bench_sym.json > $OUT/bench_sym.log 2>&1
echo "symmetric $SECONDS s"; cat $OUT/bench_sym.log | grep -v Warning
timeout 90 python3 examples/benchmark.py --preset deepseek-v3-tp8 --implementations mgpu \
  --m 1 16 --straight 32 --json $OUT/bench_tp8.json > $OUT/bench_tp8.log 2>&1
echo "tp8 $SECONDS s"; cat $OUT/bench_tp8.log | grep -v Warning
