#!/usr/bin/env bash
# Needs the row-sum code, removed after session 20's call 4: run it on commit 0018d1c.
# Session 20, call 1 (one H200, ~420 s): session 19's pending row-sum run
# (experiments/pending_s19_row_sums.sh: compiled tests, the probe at M = 1, 16, 256, sustained
# clocks and power) and the copy ceiling's own sustained power (from pending_s19_power.sh).
source experiments/_preamble.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
bash experiments/pending_s19_row_sums.sh
mv $OUT/power.log $OUT/power_row_sums.log
timeout 60 python3 experiments/power_probe.py --copy --m 16 --seconds 5 2>&1 \
   | grep -v "^WARNING" | tee $OUT/power_copy.log; echo "power copy $SECONDS s"
