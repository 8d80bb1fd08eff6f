#!/usr/bin/env bash
# Session 12, device call 3 (one H200): compiled layer tests with the automatic runs of tiles,
# the TP=8 decode figures at the new default, and GEMM2's block_n / stages / block_k at M=16
# and 256 (config fields: BM,BK,STAGES,CONSUMERS,SPLITS,BLOCK_N,FUSE,DOWN_BLOCK_N,DOWN_STAGES,
# DOWN_BLOCK_K,TILES,DOWN_TILES).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 100 python3 -m pytest -q -n 4 tests/test_mgpu_gemm.py \
   -k "tiles or fused_moe_matches or one_token or chunks_match or expert_map_and or deepseek_v3_tp1" \
   > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log
timeout 60 python3 examples/mgpu_probe.py --preset deepseek-v3-tp8 --m 1 16 --json $OUT/tp8.json \
   > $OUT/probe.log 2>&1
D="8,256,3,0,-,64,1"
timeout 150 python3 examples/mgpu_probe.py --m 16 --json $OUT/tp1_16.json --configs \
   $D,128 $D,-,4 $D,-,6 $D,-,-,512 $D,128,4 >> $OUT/probe.log 2>&1
S="16,128,3,0,-,128,1"
timeout 170 python3 examples/mgpu_probe.py --m 256 --json $OUT/tp1_256.json --configs \
   $S,-,-,256 $S,64 $S,256 $S,-,4 $S,-,2 >> $OUT/probe.log 2>&1
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
