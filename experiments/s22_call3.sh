#!/usr/bin/env bash
# Session 22, call 3 (one H200, ~250 s): (1) one kernel for both GEMMs, empty: the empty
# pipeline in two phases shaped like GEMM1 / GEMM2 at M=1, as two kernels against one kernel
# whose phase-2 programs wait on their block's semaphore (experiments/chain_probe.py; each mode
# checked on fresh data); (2) the empty pipeline's fixed cost per kernel: 256 programs of 16 KB
# steps over 58.7 / 117.4 / 176.1 / 352.2 MB (a line's intercept); (3) GEMM2 at 128 features
# at M = 2, 4, 8 (it won at M=16 in calls 1 and 2 and lost at M=1).
source experiments/_preamble.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
timeout 150 python3 experiments/chain_probe.py --stages 3 4 2>&1 | grep -v "^WARNING" \
  | tee $OUT/chain.log
echo "chain $SECONDS s"
for mb in 58.7 117.4 176.1 352.2; do
  timeout 40 python3 experiments/stream_probe.py --mbytes $mb --box-kb 16 --stages 3 \
    --programs 256 2>&1 | grep -v "^WARNING" | sed "s/^/$mb MB: /" | tee -a $OUT/stream_sizes.log
done
echo "sizes $SECONDS s"
timeout 200 python3 examples/mgpu_probe.py --m 2 4 8 --configs default:down_block_n=128 \
  --json $OUT/down128.json > $OUT/down128.log 2>&1
echo "down128 $SECONDS s"
grep -hE "layer|backend|copy|FAILED|rror" $OUT/down128.log | sed -E 's/\(([0-9A-Za-z]+, ){12}//'
