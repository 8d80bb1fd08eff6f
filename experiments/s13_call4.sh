#!/usr/bin/env bash
# Session 13, device call 4 (one H200): the final code's compiled tests (chunked output buffers,
# narrow blocks, the DeepSeek-V3 TP=1 layers) and its figures at the defaults: DeepSeek-V3 TP=1
# at M = 1, 16, 256 (and GEMM2 with 256 features per program there, against the default in the
# same run), 4096; the TP=8 slice at M = 1, 16.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 130 python3 -m pytest -q -n 4 tests/test_mgpu_gemm.py \
   -k "smaller_buffer or narrow or deepseek_v3_tp1" > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log
grep -E "^FAILED|Error" $OUT/tests.log | head -20
timeout 90 python3 examples/mgpu_probe.py --m 1 16 --json $OUT/tp1_decode.json > $OUT/probe.log 2>&1
timeout 60 python3 examples/mgpu_probe.py --preset deepseek-v3-tp8 --m 1 16 --json $OUT/tp8.json \
   >> $OUT/probe.log 2>&1
D=16,128,3,0,-,128,1
timeout 100 python3 examples/mgpu_probe.py --m 256 --json $OUT/m256.json \
   --configs $D,256,-,-,-,-,1 $D,-,-,-,-,-,1 >> $OUT/probe.log 2>&1
timeout 120 python3 examples/mgpu_probe.py --m 4096 --json $OUT/m4096.json >> $OUT/probe.log 2>&1
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
