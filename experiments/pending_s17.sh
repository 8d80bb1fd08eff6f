#!/usr/bin/env bash
# Planned in session 17, not run: no device was lent after call 1. For the next session's first
# device call (one H200): (1) how much of each decode figure is the timing loop's
# wait on the host (an XLA while loop reads its condition on the host once per iteration): the
# layer chained with 4 calls per iteration and with 32 (--chain-unroll 8), and the kernel
# timeline of the 32; (2) the warp-specialized GEMMs at decode (one or two consumers, exact or
# on bf16 weights) and GEMM2 at 128-wide k-steps, each beside the default in one process.
# Checked without a GPU (session 17): every config lowers for sm_90 at DeepSeek-V3's shapes
# (`python3 examples/mgpu_probe.py --lower-only --m 1 16 256 --configs ...`, the same configs) and
# runs in the Mosaic GPU interpreter at the tiny preset.
source experiments/_preamble.sh
timeout 330 python3 examples/mgpu_probe.py --m 1 16 256 --chain --chain-unroll 8 --configs \
   default:consumers=1 default:consumers=1,bf16_weights=1 \
   default:consumers=2,block_n=64,bf16_weights=1 default:down_block_k=128 \
   --json $OUT/decode.json > $OUT/probe.log 2>&1; echo "probe $SECONDS s"
grep -E "layer|GEMM|backend|chained|copy|FAILED|rror" $OUT/probe.log
timeout 120 python3 examples/kernel_timeline.py --m 1 16 256 --calls 64 --unroll 8 \
   --json $OUT/timeline.json > $OUT/timeline.log 2>&1; echo "timeline $SECONDS s"
grep -v "^WARNING" $OUT/timeline.log | tail -45
