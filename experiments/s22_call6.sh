#!/usr/bin/env bash
# Session 22, call 6 (one H200, ~180 s): GEMM1 at M=1 with more k-steps in flight. Only 256
# programs (8 experts x 32 tiles) stream its 117 MB, two per SM, so the bytes in flight per SM
# are 2 x stages x 16 KB less the slot a step's math holds. (1) The empty pipeline shaped like
# GEMM1 (two 8 KB halves, 4 small copies, the rows' 4 KB box) at 3-6 stages; (2) the layer and
# each GEMM at M=1 with GEMM1 at 4, 5, 6 stages, twice (two processes).
source experiments/_preamble.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
timeout 60 python3 experiments/stream_probe.py --mbytes 117.4 --box-kb 16 --stages 3 4 5 6 \
  --programs 256 --halves 2 --small-copies 4 --shared-kb 4 2>&1 | grep -v "^WARNING" \
  | tee $OUT/stream_stages.log
for run in 1 2; do
  timeout 120 python3 examples/mgpu_probe.py --m 1 --all-gemms --configs default:stages=4 \
    default:stages=5 default:stages=6 --json $OUT/stages_$run.json > $OUT/stages_$run.log 2>&1
  echo "run $run $SECONDS s"
  grep -hE "layer|GEMM|backend|FAILED|rror" $OUT/stages_$run.log | sed -E 's/\(([0-9A-Za-z]+, ){12}//'
done
