#!/usr/bin/env bash
# Needs the row-sum code, removed after session 20's call 4: run it on commit 0018d1c.
# Planned in session 19 for the next session (one H200, ~330 s): the opt-in offset_by_row_sums
# (weights converted without their zero point, each group's sum corrected by the rows' sums;
# built in session 19 without a GPU). (1) compiled tests: the GEMM shapes and the DeepSeek-V3
# layer against 'xla'; (2) the layer and each GEMM alone (sums made outside the timed GEMM) at
# M = 1, 16, 256 against the default, one process; (3) the same sustained, with clock and power.
source experiments/_preamble.sh
compiled_tests 150 "test_gemm_offset_by_row_sums or row_sums_deepseek or dropped_slots"
timeout 150 python3 examples/mgpu_probe.py --m 1 16 256 --configs default:offset_by_row_sums=1 \
   --all-gemms --json $OUT/row_sums.json > $OUT/probe.log 2>&1; echo "probe $SECONDS s"
grep -hE "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log | sed -E 's/\(([0-9]+, ){15}//'
timeout 100 python3 experiments/power_probe.py --m 16 256 --seconds 4 --configs default \
   default:offset_by_row_sums=1 2>&1 | grep -v "^WARNING" | tee $OUT/power.log
echo "power $SECONDS s"
