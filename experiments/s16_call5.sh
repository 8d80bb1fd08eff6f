#!/usr/bin/env bash
# Session 16, device call 5 (one H200): the alignment kernel's new defaults (two launches from
# 2048 slots, 32 blocks per program in the fused launch): its compiled tests, the layer at
# DeepSeek-V3 TP=1 t=1/64/4096 against 'xla', and the targets at M=16 and 256.
source experiments/_preamble.sh
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 90 python3 -m pytest -q tests/test_align_kernel.py \
   > $OUT/align_tests.log 2>&1; tail -2 $OUT/align_tests.log; echo "align tests $SECONDS s"
compiled_tests 90 "deepseek_v3_tp1_gpu"
timeout 120 python3 examples/mgpu_probe.py --m 16 256 --json $OUT/tp1.json > $OUT/probe.log 2>&1
echo "probe $SECONDS s"
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
