#!/usr/bin/env bash
# Session 11, device call 2 (one H200): one token's blocks without the alignment kernel
# (mgpu_fused_moe.one_token_blocks) in the compiled tests, then the layer chained (each call's
# input the previous call's output: no per-call sum or loop counter) beside the probe's loop,
# and the kernel timeline of the chained layer.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_ALLOCATOR=platform
OUT=${OUT:-out}; mkdir -p $OUT
timeout 150 python3 -m pytest -q -n 4 tests/test_mgpu_gemm.py -k "one_token or fused_moe" \
   -k "not expert_parallel and not tensor_parallel and not ragged" > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log
unset XLA_PYTHON_CLIENT_ALLOCATOR
T="python3 examples/kernel_timeline.py"
timeout 120 $T --m 1 16 256 4096 --json $OUT/timeline_tp1.json > $OUT/timeline.log 2>&1
timeout 60 $T --preset deepseek-v3-tp8 --m 1 16 --implementation mgpu pallas \
   --json $OUT/timeline_tp8.json >> $OUT/timeline.log 2>&1
grep -v Warning $OUT/timeline.log | head -120
P="python3 examples/mgpu_probe.py --chain"
timeout 60 $P --preset deepseek-v3-tp8 --m 1 16 --json $OUT/tp8.json > $OUT/probe.log 2>&1
timeout 200 $P --m 1 16 256 --json $OUT/tp1.json >> $OUT/probe.log 2>&1
grep -E "layer|chained|GEMM|backend|copy|FAILED" $OUT/probe.log
