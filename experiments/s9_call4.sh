#!/usr/bin/env bash
# Session 9, device call 4 (one H200): the final code's compiled tests (every test_mgpu_gemm.py
# case but the DeepSeek-V3 GEMM shapes, which calls 1-3 ran, and the two-GPU ones), then the
# figures at the new defaults: TP=1 with and without zero points, the TP=8 slice.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
timeout 230 python3 -m pytest -q -p no:cacheprovider tests/test_mgpu_gemm.py -k "not deepseek_v3_shapes \
    and not deepseek_v3_wide and not expert_parallel and not tensor_parallel and not ragged_expert" \
    --durations=5 > $OUT/tests.log 2>&1
echo "tests rc=$?" >> $OUT/tests.log
P="python3 examples/mgpu_probe.py"
timeout 100 $P --m 1 16 256 4096 --json $OUT/tp1_zp.json > $OUT/probe.log 2>&1
timeout 100 $P --m 1 16 256 4096 --no-zp --json $OUT/tp1_sym.json >> $OUT/probe.log 2>&1
timeout 50 $P --preset deepseek-v3-tp8 --m 1 16 --json $OUT/tp8.json >> $OUT/probe.log 2>&1
grep -v "^$" $OUT/tests.log | tail -12
grep -E "layer|GEMM|copy|FAILED" $OUT/probe.log
