#!/usr/bin/env bash
# Session 14, device call 4 (one H200): symmetric weights three ways, each in its own process,
# M = 1 and 4096: through zero points of 8 (--zp8), their own path copying the scales a second
# time in place of zero points (WNA16_SYM_COPY=1, an experiment hook), their own path (call 3's
# code; its processes ran first in calls 2-3, here last). Compiled tests of the hook's path
# first. Then the session's figures at the defaults: TP=1 M = 1, 16, 256 (with GEMM2's rows in
# bf16 too), 4096 (likewise), the TP=8 slice at M = 1, 16.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
SECONDS=0
WNA16_SYM_COPY=1 XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 100 python3 -m pytest -q -n 4 \
   tests/test_mgpu_gemm.py -k "gemm_matches_numpy or fused_moe_matches_numpy" > $OUT/tests.log 2>&1
tail -2 $OUT/tests.log; grep -E "^FAILED|Error" $OUT/tests.log | head -10; echo "tests $SECONDS s"
P="python3 examples/mgpu_probe.py --m 1 4096 --all-gemms"
timeout 100 $P --zp8 --json $OUT/zp8.json > $OUT/sym.log 2>&1; echo "zp8 $SECONDS s"
WNA16_SYM_COPY=1 timeout 100 $P --no-zp --json $OUT/symcopy.json >> $OUT/sym.log 2>&1
echo "symcopy $SECONDS s"
timeout 100 $P --no-zp --json $OUT/sym.json >> $OUT/sym.log 2>&1; echo "sym $SECONDS s"
grep -E "layer|GEMM|copy|FAILED|rror" $OUT/sym.log
timeout 80 python3 examples/mgpu_probe.py --m 1 16 --json $OUT/decode.json > $OUT/probe.log 2>&1
timeout 60 python3 examples/mgpu_probe.py --preset deepseek-v3-tp8 --m 1 16 --json $OUT/tp8.json \
   >> $OUT/probe.log 2>&1; echo "decode $SECONDS s"
timeout 70 python3 examples/mgpu_probe.py --m 256 --json $OUT/m256.json --configs \
   16,128,3,0,-,128,1,-,-,-,-,-,1,1 >> $OUT/probe.log 2>&1
timeout 90 python3 examples/mgpu_probe.py --m 4096 --json $OUT/m4096.json --configs \
   64,256,3,2,-,64,1,128,2,-,-,-,2,1 >> $OUT/probe.log 2>&1
echo "prefill $SECONDS s"
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
