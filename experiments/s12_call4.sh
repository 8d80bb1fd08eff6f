#!/usr/bin/env bash
# Session 12, device call 4 (one H200): half blocks (blocks using at most half their rows run
# a pipeline of half the width): compiled tests, then M=4096 and M=256 with and without
# (config fields: BM,BK,STAGES,CONSUMERS,SPLITS,BLOCK_N,FUSE,DOWN_BLOCK_N,DOWN_STAGES,
# DOWN_BLOCK_K,TILES,DOWN_TILES,HALF_BLOCKS).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 100 python3 -m pytest -q -n 4 tests/test_mgpu_gemm.py \
   -k "half or fused_moe_matches or deepseek_v3_tp1" > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log
grep -E "^(FAILED|E  )" $OUT/tests.log | head -20
B="64,256,3,2,-,64,1,128,2"
timeout 200 python3 examples/mgpu_probe.py --m 4096 --json $OUT/tp1_4096.json --configs \
   $B,-,-,-,1 $B > $OUT/probe.log 2>&1
S="16,128,3,0,-,128,1"
timeout 120 python3 examples/mgpu_probe.py --m 256 --json $OUT/tp1_256.json --configs \
   $S,-,-,-,-,-,1 >> $OUT/probe.log 2>&1
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
