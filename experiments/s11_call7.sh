#!/usr/bin/env bash
# Session 11, device call 7 (one H200, the last ~4 minutes): blocks of expert -1 write nothing
# (zero_empty=False) and gather_rows leaves padding rows unwritten (fill=False), as the layer
# reads none of them: compiled tests, then the layer at M=256 and 16.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 70 python3 -m pytest -q -n 4 \
   tests/test_gather_rows.py tests/test_mgpu_gemm.py \
   -k "gather or leaves or one_token or fused_moe_matches or expert_map_and or chunks_match or deepseek_v3_tp1" \
   > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log
timeout 100 python3 examples/mgpu_probe.py --m 256 16 --json $OUT/tp1.json > $OUT/probe.log 2>&1
grep -E "layer|GEMM|backend|copy|FAILED" $OUT/probe.log
