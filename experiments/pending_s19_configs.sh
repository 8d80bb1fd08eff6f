#!/usr/bin/env bash
# Planned in session 19 for the next session (one H200, ~200 s): under the power cap, configs that
# move fewer bytes through L2 and shared memory per weight byte (GEMM2 at 128 features: its rows'
# tile serves twice the weights; GEMM1 at 128 features) or through HBM (GEMM2's rows in bf16,
# opt-in) may win in a sustained run although they tied in the probe's short loops (sessions 9,
# 12, 14, 16). Sustained 4 s each, with the clock and power, M = 16 and 256 (at 256 the two
# 128-feature configs are the default itself: repeats of it, a measure of the spread).
source experiments/_preamble.sh
timeout 200 python3 experiments/power_probe.py --m 16 256 --seconds 4 --configs default \
   default:down_block_n=128 default:block_n=128 default:bf16_down_rows=1 2>&1 \
   | grep -v "^WARNING" | tee $OUT/power_configs.log; echo "configs $SECONDS s"
