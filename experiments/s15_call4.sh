#!/usr/bin/env bash
# Session 15, device call 4 (one H200), the final code: 128-row blocks on bf16 weights are the
# default from 96 rows per expert (DeepSeek-V3 M=4096). Compiled tests (the layer at DeepSeek-V3
# TP=1 t=1/64/4096 against 'xla', bf16 weights, GEMMs), then the targets: M=1,16,256,4096 with
# zero points; M=2048 at the default (64-row blocks) against 128-row blocks on bf16 weights;
# M=4096 symmetric; each in its own process.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
SECONDS=0
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 200 python3 -m pytest -q -n 4 tests/test_mgpu_gemm.py \
   -k "bf16_weights or layer_contract or deepseek_v3 or matches_numpy or narrow" > $OUT/tests.log 2>&1
tail -2 $OUT/tests.log; grep -E "^FAILED|Error" $OUT/tests.log | head -10; echo "tests $SECONDS s"
timeout 200 python3 examples/mgpu_probe.py --m 1 16 256 4096 --json $OUT/tp1.json \
   > $OUT/probe.log 2>&1; echo "probe $SECONDS s"
timeout 90 python3 examples/mgpu_probe.py --m 2048 --configs 128,128,3,2,-,64,1,128,2,-,-,-,3,0,0,1 \
   --json $OUT/m2048.json >> $OUT/probe.log 2>&1; echo "m2048 $SECONDS s"
timeout 80 python3 examples/mgpu_probe.py --m 4096 --no-zp --json $OUT/sym.json \
   >> $OUT/probe.log 2>&1; echo "sym $SECONDS s"
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
