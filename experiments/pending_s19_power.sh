#!/usr/bin/env bash
# Planned in session 19 for the next session's first call (one H200, ~380 s): how much of the
# energy that holds the clock down at M >= 16 is the dequantization's? (1) the copy ceiling's own
# clocks and power, sustained (is "% of copy" itself power-capped?); (2) the layer at M = 16 and
# 256 with copies of the GEMM missing the zero-point subtraction or the group scale (WRONG
# results: a timing probe only), short loop and sustained, with the clock and power. If "no zero
# point" raises the clock and shortens the layer, the row-sum correction (subtract (128 + z) x
# the group's row sums after the products) is worth building.
source experiments/_preamble.sh
timeout 60 python3 experiments/power_probe.py --copy --m 16 --seconds 5 2>&1 \
   | grep -v "^WARNING" | tee $OUT/power.log; echo "power $SECONDS s"
timeout 270 python3 experiments/convert_cost_probe.py --m 16 256 --seconds 3 2>&1 \
   | grep -v "^WARNING" | tee $OUT/convert_cost.log; echo "convert cost $SECONDS s"
