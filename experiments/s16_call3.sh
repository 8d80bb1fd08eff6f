#!/usr/bin/env bash
# Session 16, device call 3 (one H200): the code after the int8 zero points were reverted (bf16
# zero points; 128-row blocks from 64 rows per expert, GEMM2 there at 3 stages). Compiled tests
# (the layer at DeepSeek-V3 TP=1 t=1/64/4096 against 'xla', bf16 weights, the layer contract),
# the targets at M=1,16,256,4096, then where a call's time goes at M=1,16,256 with the idle time
# before each kernel (kernel_timeline.py, chained).
source experiments/_preamble.sh
compiled_tests 200 "deepseek_v3_tp1_gpu or (bf16_weights and not lower) or layer_contract"
timeout 170 python3 examples/mgpu_probe.py --m 1 16 256 4096 --json $OUT/tp1.json \
   > $OUT/probe.log 2>&1; echo "probe $SECONDS s"
timeout 100 python3 examples/kernel_timeline.py --m 1 16 256 --calls 20 --json $OUT/timeline.json \
   > $OUT/timeline.log 2>&1; echo "timeline $SECONDS s"
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
grep -v "^WARNING" $OUT/timeline.log | tail -45
