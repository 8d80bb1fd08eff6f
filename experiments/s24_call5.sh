#!/usr/bin/env bash
# Session 24, call 5 (one H200, ~150 s): call 4's TP=8 M=1 model-step figure (28.2 us) against
# session 23's (18.2 us), the loop's equal (27.7 vs 25.6). Since call 4, make_straight returns
# every call's output (32 arrays) instead of the last one's sum: does the host's work per step
# now exceed the GPU's (a host-bound figure)? The same benchmark with session 23's
# benchmark.py (f359ddd; the package at HEAD), and the step's device trace (idle = the GPU
# waiting for launches).
source experiments/_preamble.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
# (experiments/benchmark_<rev>.py: uncommitted copies made for the call by
# git show <rev>:examples/benchmark.py)
for rev in HEAD f359ddd; do
  timeout 70 python3 experiments/benchmark_$rev.py --preset deepseek-v3-tp8 --implementations mgpu \
    --m 1 16 --straight 32 > $OUT/bench_tp8_$rev.log 2>&1
  echo "benchmark.py at $rev: $SECONDS s"; grep -E "step|copy ceiling" $OUT/bench_tp8_$rev.log
done
timeout 70 python3 examples/kernel_timeline.py --preset deepseek-v3-tp8 --m 1 16 --loop straight \
  --calls 32 > $OUT/timeline_tp8.log 2>&1
echo "timeline $SECONDS s"; cat $OUT/timeline_tp8.log | grep -v Warning
