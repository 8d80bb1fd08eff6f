#!/usr/bin/env bash
# Session 13, device call 3 (one H200): GEMM2 of 64-row blocks at 3 stages of 256 (its f32
# output buffers at 32 rows: output_buffer_rows), with and without quarter blocks and runs of 2
# tiles, against the default (2 stages, half blocks) in the same run, M=4096; compiled tests of
# the chunked store first.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 100 python3 -m pytest -q -n 4 tests/test_mgpu_gemm.py \
   -k "smaller_buffer or narrow or deepseek" > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log
grep -E "^FAILED|Error" $OUT/tests.log | head -20
C=64,256,3,2,-,64,1,128
timeout 330 python3 examples/mgpu_probe.py --m 4096 --json $OUT/m4096.json \
   --configs $C,2,-,-,-,1 $C,2,-,-,-,2 $C,3,-,-,-,1 $C,3,-,-,-,2 $C,3,-,-,2,2 $C,2,-,-,-,1 \
   > $OUT/probe.log 2>&1
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
