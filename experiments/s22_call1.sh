#!/usr/bin/env bash
# Session 22, call 1 (session 21's pending_s21_decode.sh, renamed; one H200, ~400 s): with
# the weight tiles now copied in 128-byte TMA rows (session 21), the decode configs that lost
# with 32-byte rows, the symmetric weights and the sustained (power-capped) figures, none
# re-measured since the change.
# (1) M = 1, 16: GEMM2 in runs of 2 tiles, at 128 features, at 4 stages; GEMM1 at 4 stages;
#     k-steps of 512 (both GEMMs, or GEMM1 only); GEMM2 at k-steps of 128 (the layer and each GEMM alone);
# (2) symmetric weights at M = 1, 16, 256; (3) the defaults after a 3 s warm-up; (4) the empty
#     pipeline at GEMM2's M=1 bytes (58.7 MB) in fewer, longer programs with 128/256-byte rows.
source experiments/_preamble.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
timeout 260 python3 examples/mgpu_probe.py --m 1 16 --all-gemms --configs \
  default:down_tiles_per_program=2 default:down_block_n=128 default:down_stages=4 \
  default:stages=4 default:block_k=512 default:block_k=512,down_block_k=256 default:down_block_k=128 \
  --json $OUT/decode_configs.json > $OUT/decode_configs.log 2>&1
echo "decode configs $SECONDS s"
timeout 120 python3 examples/mgpu_probe.py --m 1 16 256 --no-zp --json $OUT/symmetric.json \
  > $OUT/symmetric.log 2>&1
echo "symmetric $SECONDS s"
timeout 120 python3 examples/mgpu_probe.py --m 1 16 256 --warmup-s 3 --json $OUT/sustained.json \
  > $OUT/sustained.log 2>&1
echo "sustained $SECONDS s"
timeout 60 python3 experiments/stream_probe.py --mbytes 58.7 --box-kb 8 16 --stages 3 4 \
  --programs 224 448 896 --row-bytes 128 256 2>&1 | grep -v "^WARNING" | tee $OUT/stream_gemm2.log
echo "stream $SECONDS s"
grep -hE "layer|GEMM|backend|copy|FAILED|rror" $OUT/decode_configs.log $OUT/symmetric.log \
  $OUT/sustained.log | sed -E 's/\(([0-9A-Za-z]+, ){16}//'
