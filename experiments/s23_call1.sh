#!/usr/bin/env bash
# Session 23, call 1 (one H200, ~500 s): the layer with no loop. The fori-loop figures (one call
# per iteration, the sum of each output) against N calls written out in one jit, one input set
# each (benchmark.make_straight: a model step's layers), at M = 1, 16, 256 with zero points and
# at M=1 of the TP=8 slice; then the timelines of the straight runs at M = 1 and 16.
source experiments/_preamble.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
timeout 260 python3 examples/mgpu_probe.py --m 1 16 256 --straight 32 --chain \
  --json $OUT/straight.json > $OUT/straight.log 2>&1
echo "probe $SECONDS s"
grep -hE "layer|backend|straight|chained|copy|FAILED|rror" $OUT/straight.log | sed -E 's/\(([0-9A-Za-z]+, ){12}//'
timeout 80 python3 examples/mgpu_probe.py --preset deepseek-v3-tp8 --m 1 --straight 32 \
  > $OUT/straight_tp8.log 2>&1
echo "tp8 $SECONDS s"
grep -hE "layer|backend|straight|copy|FAILED|rror" $OUT/straight_tp8.log | sed -E 's/\(([0-9A-Za-z]+, ){12}//'
timeout 120 python3 examples/kernel_timeline.py --m 1 16 --loop straight --calls 32 \
  --json $OUT/timeline.json > $OUT/timeline.log 2>&1
echo "timeline $SECONDS s"
cat $OUT/timeline.log | grep -v "^\s*$" | head -40
timeout 100 python3 examples/mgpu_probe.py --m 1 --configs default:bf16_weights=1 \
  > $OUT/bf16_weights.log 2>&1
echo "bf16 weights $SECONDS s"
grep -hE "layer|GEMM|copy|FAILED|rror" $OUT/bf16_weights.log | sed -E 's/\(([0-9A-Za-z]+, ){12}//'
