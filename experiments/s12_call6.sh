#!/usr/bin/env bash
# Session 12, device call 6 (one H200): the final code's compiled tests (the layer's and the
# GEMM's, not the multi-device ones) and its figures: DeepSeek-V3 TP=1 at M = 1, 16, 256, 4096
# and the TP=8 slice at M = 1, 16.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 110 python3 -m pytest -q -n 4 \
   tests/test_gather_rows.py tests/test_mgpu_gemm.py \
   -k "not expert_parallel and not tensor_parallel and not ragged" > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log
grep -E "^FAILED" $OUT/tests.log | head
timeout 90 python3 examples/mgpu_probe.py --m 1 16 --json $OUT/tp1_decode.json > $OUT/probe.log 2>&1
timeout 60 python3 examples/mgpu_probe.py --preset deepseek-v3-tp8 --m 1 16 --json $OUT/tp8.json \
   >> $OUT/probe.log 2>&1
timeout 190 python3 examples/mgpu_probe.py --m 256 4096 --json $OUT/tp1_large.json \
   >> $OUT/probe.log 2>&1
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
