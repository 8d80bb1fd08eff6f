#!/usr/bin/env bash
# Session 13, device call 1 (one H200): the top-k sum in GEMM2 (fuse_topk_sum) and programs not
# awaiting their writes (await_writes=0) compiled: their tests and the narrow blocks' (2-3 never
# ran on a GPU), then decode figures, each against the default in the same run.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 150 python3 -m pytest -q -n 4 tests/test_mgpu_gemm.py \
   -k "rows_into or one_token or expert_map or narrow or matches_numpy" > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log
grep -E "^FAILED|Error" $OUT/tests.log | head -20
D=8,256,3,0,-,64,1,-,-,-,-,-,1
timeout 170 python3 examples/mgpu_probe.py --m 1 16 --json $OUT/tp1_decode.json \
   --configs $D,1 $D,-,0 $D,1,0 $D > $OUT/probe.log 2>&1
timeout 90 python3 examples/mgpu_probe.py --preset deepseek-v3-tp8 --m 1 16 --json $OUT/tp8.json \
   --configs $D,1 $D,-,0 $D,1,0 $D >> $OUT/probe.log 2>&1
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
