#!/usr/bin/env bash
# Needs commit b4abac5 (weight_words and experiments/weight_rows_probe.py, both removed after).
# Session 21, call 1 (one H200): do the weight copies' 32-byte TMA rows hold the mgpu GEMM back?
# The words path's compiled tests; GEMM1 / GEMM2 alone at M = 1, 16, 256 reading the int4 tiles
# or the same tiles as uint32 word rows of 32 B, 256 B, 1 KB (experiments/weight_rows_probe.py);
# the empty pipeline at TMA rows of 32-256 bytes (experiments/stream_probe.py --row-bytes).
source experiments/_preamble.sh
compiled_tests 150 "reads_the_tiles_as_words"
timeout 100 python3 experiments/stream_probe.py --mbytes 117.4 --box-kb 8 16 --stages 3 \
  --programs 256 --row-bytes 32 64 128 256 2>&1 | grep -v "^WARNING" | tee $OUT/stream_rows.log
timeout 60 python3 experiments/stream_probe.py --mbytes 58.7 --box-kb 8 --stages 3 \
  --programs 896 --row-bytes 32 128 256 2>&1 | grep -v "^WARNING" | tee -a $OUT/stream_rows.log
echo "stream $SECONDS s"
timeout 330 python3 experiments/weight_rows_probe.py --m 1 16 256 2>&1 | grep -v "^WARNING" \
  | tee $OUT/weight_rows.log
echo "weight rows $SECONDS s"
