#!/usr/bin/env bash
# Session 12, device call 7 (one H200): the gpu-marked tests of the mgpu backend (DeepSeek-V3
# sized GEMMs and layers), which call 6's 110 s did not reach.
export PYTHONPATH=$PWD
OUT=${OUT:-out}; mkdir -p $OUT
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 220 python3 -m pytest -q -n 4 tests/test_mgpu_gemm.py -m gpu \
   -k "not expert_parallel and not tensor_parallel and not ragged" > $OUT/tests_gpu.log 2>&1
tail -3 $OUT/tests_gpu.log; grep -E "^FAILED" $OUT/tests_gpu.log | head
