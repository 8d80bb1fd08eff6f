#!/usr/bin/env bash
# Session 11, device call 5 (one H200): the rows in block order by the gather_rows kernel
# (pallas_kernels/gather_rows.py) instead of XLA's gather and select: its compiled tests and
# the layer's, the two side by side alone (experiments/gather_probe.py, kernel time from a
# device trace), the layer at M=256 and 4096 with it.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 110 python3 -m pytest -q -n 4 \
   tests/test_gather_rows.py tests/test_mgpu_gemm.py \
   -k "gather or ((one_token or fused_moe) and not expert_parallel and not tensor_parallel and not ragged)" \
   > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log
timeout 60 python3 experiments/gather_probe.py > $OUT/gather.log 2>&1
grep -v Warn $OUT/gather.log | tail -8
timeout 230 python3 examples/mgpu_probe.py --m 256 4096 --json $OUT/tp1.json > $OUT/probe.log 2>&1
grep -E "layer|chained|GEMM|backend|copy|FAILED" $OUT/probe.log
