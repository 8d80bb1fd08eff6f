#!/usr/bin/env bash
# Session 15, device call 5 (one H200): call 4's test run hit its 200 s limit after 64 passed
# (none failed) before the DeepSeek-V3 layer tests; this runs those alone: t = 1, 64, 4096
# against 'xla' (t=4096: the default's 128-row blocks on bf16 weights).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
SECONDS=0
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 330 python3 -m pytest -q -rA tests/test_mgpu_gemm.py \
   -k "deepseek_v3_tp1_gpu" -p no:randomly > $OUT/tests.log 2>&1
grep -E "passed|failed|PASSED|FAILED|Error" $OUT/tests.log | tail -12; echo "tests $SECONDS s"
