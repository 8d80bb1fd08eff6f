#!/usr/bin/env bash
# Session 12, device call 5 (one H200): runs of output tiles with warp specialization at
# M=4096 (GEMM2's programs of 8 k-steps store 64 KB each with no other program on their SM):
# compiled tests, then the default (half blocks) against runs of 2, 4 and 7 GEMM2 tiles and of
# 2 GEMM1 tiles (config fields: BM,BK,STAGES,CONSUMERS,SPLITS,BLOCK_N,FUSE,DOWN_BLOCK_N,
# DOWN_STAGES,DOWN_BLOCK_K,TILES,DOWN_TILES,HALF_BLOCKS).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 90 python3 -m pytest -q -n 4 tests/test_mgpu_gemm.py \
   -k "tiles or half" > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log
grep -E "^(FAILED|E  )" $OUT/tests.log | head -20
B="64,256,3,2,-,64,1,128,2"
timeout 230 python3 examples/mgpu_probe.py --m 4096 --json $OUT/tp1_4096.json --configs \
   $B,-,-,2,1 $B,-,-,4,1 $B,-,-,7,1 $B,-,2,-,1 64,256,3,2,-,64,1,64,3,-,-,4,1 \
   > $OUT/probe.log 2>&1
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
