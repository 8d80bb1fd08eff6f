#!/usr/bin/env bash
# Session 14, device call 5 (one H200): symmetric weights with their offset computed from a loaded
# row (136 - 0 * scale, as a zero point's offset is) against the zero-point path on the same data
# (--zp8), M = 1 and 4096, each in its own process on this GPU; compiled GEMM and layer tests
# (symmetric cases among them) first.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
SECONDS=0
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 80 python3 -m pytest -q -n 4 tests/test_mgpu_gemm.py \
   -k "gemm_matches_numpy or fused_moe_matches_numpy" > $OUT/tests.log 2>&1
tail -2 $OUT/tests.log; grep -E "^FAILED|Error" $OUT/tests.log | head -10; echo "tests $SECONDS s"
P="python3 examples/mgpu_probe.py --m 1 4096 --all-gemms"
timeout 90 $P --no-zp --json $OUT/sym.json > $OUT/sym.log 2>&1; echo "sym $SECONDS s"
timeout 90 $P --zp8 --json $OUT/zp8.json >> $OUT/sym.log 2>&1; echo "zp8 $SECONDS s"
grep -E "layer|GEMM|copy|FAILED|rror" $OUT/sym.log
