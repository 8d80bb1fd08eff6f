#!/usr/bin/env bash
# Needs commit bd1d642 (weight_words and experiments/weight_rows_probe.py, both removed after;
# at HEAD the GEMMs alone by row width: examples/mgpu_probe.py --all-gemms --configs
# default:weight_row_nibbles=64 default:weight_row_nibbles=128).
# Session 21, call 2 (one H200): call 1 found the empty pipeline 13-20% faster with 128-byte TMA
# rows than with the int4 tiles' 32-byte rows. The int4 tiles in rows of 128 / 256 nibbles
# (weight_row_nibbles: a free reshape) and as words of 256-byte rows: their compiled tests,
# GEMM1 / GEMM2 alone at M = 1, 16, 256 (bit-for-bit against 64-nibble rows), and the layer.
source experiments/_preamble.sh
compiled_tests 150 "wide_weight_rows"
timeout 200 python3 experiments/weight_rows_probe.py --m 1 16 256 \
  --variants nibbles:64 nibbles:128 nibbles:256 words:64 2>&1 | grep -v "^WARNING" \
  | grep -v "UserWarning\|warnings.warn" | tee $OUT/weight_rows.log
echo "weight rows $SECONDS s"
timeout 230 python3 examples/mgpu_probe.py --m 1 16 256 --configs default:weight_row_nibbles=128 \
  default:weight_row_nibbles=256 --json $OUT/layer_rows.json 2>&1 | grep -v "^WARNING" \
  | tee $OUT/layer_rows.log
echo "layer $SECONDS s"
