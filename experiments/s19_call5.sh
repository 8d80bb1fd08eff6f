#!/usr/bin/env bash
# Session 19, call 5 (one H200): (1) is the layer power- or clock-limited? nvidia-smi's clocks,
# power and throttle reasons while the TP=1 layer runs back to back at M = 1, 16, 256, 4096;
# (2) the alignment kernel after a memory-bound pass (the mended probe: a sum XLA cannot narrow).
source experiments/_preamble.sh
nvidia-smi -q -d CLOCK,POWER | grep -iE "max|limit|default|applications" | head -20
timeout 130 python3 experiments/power_probe.py --m 1 16 256 4096 --seconds 5 2>&1 \
   | grep -v "^WARNING" | tee $OUT/power.log; echo "power $SECONDS s"
timeout 60 python3 experiments/align_context_probe.py --calls 50 2>&1 | grep -v "^WARNING" \
   | tee $OUT/align_context.log; echo "align context $SECONDS s"
