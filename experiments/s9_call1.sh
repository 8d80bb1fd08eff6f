#!/usr/bin/env bash
# Session 9, device call 1 (one H200): the probe with block_n 128/256 at M=4096, 1, 16, then the
# compiled tests of block_n (wide warpgroups).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
P="python3 examples/mgpu_probe.py"
timeout 170 $P --m 4096 --configs 64,128,4,2,-,-,128 64,256,2,2,-,-,128 128,64,3,2,-,-,128 \
   --json $OUT/m4096.json > $OUT/probe.log 2>&1
timeout 190 $P --m 1 16 --configs 8,256,4,0,-,-,128 8,256,4,0,-,-,256 8,128,4,0,-,-,128 8,256,4,0,-,3 \
   --json $OUT/m1_16.json >> $OUT/probe.log 2>&1
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_mgpu_gemm.py \
    -k "(wide and not sym) or whole_features" --durations=5 > $OUT/tests.log 2>&1
echo "tests rc=$?" >> $OUT/tests.log
grep -v "^$" $OUT/tests.log | tail -15
grep -E "layer|GEMM|copy|FAILED" $OUT/probe.log
