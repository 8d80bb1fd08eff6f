#!/usr/bin/env bash
# Session 22, call 2 (one H200, ~330 s): what GEMM1 at M=1 pays beyond the empty pipeline (its
# 47 us against 38-40 us for the same bytes). (1) The empty pipeline at GEMM1's M=1 shape
# (117.4 MB, 256 programs, 3 stages, 16 KB per k-step in 128-byte rows) with the GEMM's other
# copies added one kind at a time: the step's box as two halves (gate, up), 2 or 4 small copies
# of 256 bytes (scales and zero points per half), a 4 KB box every program reads (the rows'
# tile); the same at GEMM2's shape (58.7 MB, 896 programs, 8 KB). (2) The M=1 timeline at the
# defaults. (3) M=1 and 16: direct_token, GEMM1 at 4 stages, GEMM2 at 128 features (M=16 223.8
# vs 245.3 us in call 1), each GEMM alone too.
source experiments/_preamble.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
timeout 120 python3 experiments/stream_probe.py --mbytes 117.4 --box-kb 16 --stages 3 \
  --programs 256 --row-bytes 128 --halves 1 2 --small-copies 0 2 4 --shared-kb 0 4 2>&1 \
  | grep -v "^WARNING" | tee $OUT/stream.log
timeout 60 python3 experiments/stream_probe.py --mbytes 58.7 --box-kb 8 --stages 3 \
  --programs 896 --row-bytes 128 --small-copies 0 2 --shared-kb 0 4 2>&1 \
  | grep -v "^WARNING" | tee -a $OUT/stream.log
echo "stream $SECONDS s"
timeout 90 python3 examples/kernel_timeline.py --m 1 > $OUT/timeline.log 2>&1
grep -vE "^WARNING|^I[0-9]" $OUT/timeline.log | tail -15
echo "timeline $SECONDS s"
timeout 200 python3 examples/mgpu_probe.py --m 1 16 --all-gemms --configs \
  default:direct_token=1 default:stages=4 default:down_block_n=128 \
  --json $OUT/configs.json > $OUT/configs.log 2>&1
echo "configs $SECONDS s"
grep -hE "layer|GEMM|backend|copy|FAILED|rror" $OUT/configs.log | sed -E 's/\(([0-9A-Za-z]+, ){12}//'
