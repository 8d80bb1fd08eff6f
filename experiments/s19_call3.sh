#!/usr/bin/env bash
# Session 19, call 3 (one H200), at the code without PDL (reverted after calls 1-2): (1) is the
# alignment kernel slower right after a memory-bound pass than alone (the layer's timelines
# showed 14.9 / 24-28 us at M=16 / 256 against align_probe's 7.0 / 11.8)? (2) the layer's kernel
# timeline at M=16 and 256 at the current defaults (no run-time choice since session 18).
source experiments/_preamble.sh
timeout 150 python3 experiments/align_context_probe.py --calls 50 > $OUT/align_context.log 2>&1
echo "align context $SECONDS s"
timeout 150 python3 examples/kernel_timeline.py --m 16 256 --calls 40 --json $OUT/timeline.json \
   > $OUT/timeline.log 2>&1; echo "timeline $SECONDS s"
grep -v "^WARNING" $OUT/align_context.log | tail -8
grep -v "^WARNING" $OUT/timeline.log | tail -30
