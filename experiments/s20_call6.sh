#!/usr/bin/env bash
# Session 20, call 6 (one H200, ~100 s, the session's last device seconds): what an augmented-K
# zero point (one more wgmma per group in place of the per-weight subtraction) could win at
# M=256, where call 2 measured the subtraction at 6.7% of the layer. WRONG-result variants of
# experiments/convert_cost_probe.py, short loop and 1 s sustained.
source experiments/_preamble.sh
timeout 140 python3 experiments/convert_cost_probe.py --m 256 --seconds 1 --variants default \
   "no zero point" "extra wgmma" "no zero point, extra wgmma" 2>&1 \
   | grep -v "^WARNING" | tee $OUT/convert_cost_wgmma.log; echo "convert cost $SECONDS s"
