#!/usr/bin/env bash
# Session 12, device call 2 (one H200): runs of output tiles per program (tiles_per_program,
# GEMM2's down_tiles_per_program): compiled tests, then the decode and M=256 layers at a few
# runs in one probe per M (config fields: BM,BK,STAGES,CONSUMERS,SPLITS,BLOCK_N,FUSE,
# DOWN_BLOCK_N,DOWN_STAGES,DOWN_BLOCK_K,TILES,DOWN_TILES).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 120 python3 -m pytest -q -n 4 \
   tests/test_mgpu_gemm.py tests/test_gather_rows.py \
   -k "tiles or matches_numpy or one_token or chunks_match or expert_map_and or deepseek_v3_tp1" \
   > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log
D="8,256,3,0,-,64,1"
timeout 150 python3 examples/mgpu_probe.py --m 1 16 --json $OUT/tp1_decode.json --configs \
   $D,-,-,-,1,4 $D,-,-,-,1,8 $D,-,-,-,1,16 $D,-,4,-,1,8 $D,-,-,-,2,8 8,256,4,0,-,64,1,-,-,-,4,8 \
   > $OUT/probe.log 2>&1
timeout 110 python3 examples/mgpu_probe.py --preset deepseek-v3-tp8 --m 1 16 --json $OUT/tp8.json \
   --configs $D,-,-,-,1,4 $D,-,-,-,1,8 $D,-,-,-,1,28 $D,-,4,-,1,8 $D,-,-,-,2,14 \
   >> $OUT/probe.log 2>&1
S="16,128,3,0,-,128,1"
timeout 140 python3 examples/mgpu_probe.py --m 256 --json $OUT/tp1_256.json --configs \
   $S,-,-,-,1,4 $S,-,-,-,1,8 $S,-,-,-,2,8 $S,-,4,-,1,8 >> $OUT/probe.log 2>&1
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
