#!/usr/bin/env bash
# Planned in session 17 (no device was lent after its call 1); run as session 18 call 1. For one
# device call (one H200): (1) how much of each decode figure is the timing loop's wait on the
# host (an XLA while loop reads its condition on the host once per iteration): the layer and
# the backend chained with 4 calls per iteration and with 32 (--chain-unroll 8), and the kernel
# timeline of the 32; (2) what the backend's run-time block choice (an XLA conditional, a wait
# on the host per layer) costs layers back to back at M=64 and 256 ("backend chained" against
# "mgpu chained"): the data for making the choice opt-in. The decode configs are in
# s18_call2.sh (a second call).
source experiments/_preamble.sh
timeout 330 python3 examples/mgpu_probe.py --m 1 16 64 256 --chain --chain-unroll 8 \
   --json $OUT/decode.json > $OUT/probe.log 2>&1; echo "probe $SECONDS s"
grep -E "layer|GEMM|backend|chained|copy|FAILED|rror" $OUT/probe.log
timeout 120 python3 examples/kernel_timeline.py --m 1 16 256 --calls 64 --unroll 8 \
   --json $OUT/timeline.json > $OUT/timeline.log 2>&1; echo "timeline $SECONDS s"
grep -v "^WARNING" $OUT/timeline.log | tail -45
