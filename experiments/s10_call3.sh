#!/usr/bin/env bash
# Session 10, device call 3 (one H200): the compiled tests of test_mgpu_gemm.py (the DeepSeek-V3
# GEMM shapes with zero points among them; not the two-GPU cases), then an A/B in one run at
# M=256 and 4096: each sub-tile through its own output buffer (the committed code) against one
# buffer per warpgroup (the session-9 store, forced by SMEM_BYTES=0).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 230 python3 -m pytest -q -p no:cacheprovider \
    -n 4 --dist loadgroup tests/test_mgpu_gemm.py -k "not (deepseek_v3_shapes and sym) \
    and not expert_parallel and not tensor_parallel and not ragged_expert" \
    --durations=8 > $OUT/tests.log 2>&1
echo "tests rc=$?" >> $OUT/tests.log
P="python3 examples/mgpu_probe.py"
for m in 4096 256; do
  timeout 85 $P --m $m --json $OUT/m${m}_own.json > $OUT/probe_m${m}_own.log 2>&1
  timeout 85 python3 experiments/probe_one_buffer.py --m $m --json $OUT/m${m}_one.json > $OUT/probe_m${m}_one.log 2>&1
done
grep -v "^$" $OUT/tests.log | tail -14
for f in $OUT/probe_*.log; do echo "== $f"; grep -E "mgpu|copy|FAILED" $f; done
