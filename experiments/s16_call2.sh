#!/usr/bin/env bash
# Session 16, device call 2 (one H200): int8 zero points in the mgpu_int4 layout (1 byte each
# instead of bf16's 2) and the new defaults (128-row blocks from 64 rows per expert, GEMM2 there
# at 3 stages). Compiled tests (the layer at DeepSeek-V3 TP=1 t=1/64/4096 against 'xla', the
# GEMMs with zero points, bf16 weights, old float zeros bit-identical to int8), then the targets
# at M=1,16,256,4096 on int8 zeros, and M=1,16,256 with the older bf16 zeros (--float-zeros), each
# in its own process.
source experiments/_preamble.sh
compiled_tests 190 "deepseek_v3_tp1_gpu or float_zeros or (matches_numpy and zp)"
timeout 170 python3 examples/mgpu_probe.py --m 1 16 256 4096 --json $OUT/int8.json \
   > $OUT/probe.log 2>&1; echo "int8 $SECONDS s"
timeout 130 python3 examples/mgpu_probe.py --m 1 16 256 --float-zeros --json $OUT/float.json \
   >> $OUT/probe.log 2>&1; echo "float $SECONDS s"
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
