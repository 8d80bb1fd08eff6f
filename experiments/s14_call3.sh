#!/usr/bin/env bash
# Session 14, device call 3 (one H200): symmetric weights with their offset of 136 made opaque to
# the compiler (_opaque_offset_row: the zero-point path's code without loading zero points),
# against the zero-point path on the same data (--zp8), M = 1 and 4096, each in its own process
# on this GPU (compiled GEMM and layer tests first); then GEMM2 in runs of tiles with deeper
# pipelines at M=4096 (f32 rows): can prefetch across a tile's end hide its fill?
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
SECONDS=0
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 120 python3 -m pytest -q -n 4 tests/test_mgpu_gemm.py \
   -k "gemm_matches_numpy or fused_moe_matches_numpy" > $OUT/tests.log 2>&1
tail -2 $OUT/tests.log; grep -E "^FAILED|Error" $OUT/tests.log | head -10; echo "tests $SECONDS s"
timeout 120 python3 examples/mgpu_probe.py --m 1 4096 --no-zp --all-gemms --json $OUT/sym.json \
   > $OUT/probe.log 2>&1; echo "sym $SECONDS s"
timeout 120 python3 examples/mgpu_probe.py --m 1 4096 --zp8 --all-gemms --json $OUT/zp8.json \
   >> $OUT/probe.log 2>&1; echo "zp8 $SECONDS s"
D=64,256,3,2,-,64,1,128
timeout 200 python3 examples/mgpu_probe.py --m 4096 --all-gemms --json $OUT/runs.json \
   --configs $D,3,-,-,2,2 $D,3,-,-,4,2 $D,4,128,-,2,2 $D,5,128,-,4,2 >> $OUT/probe.log 2>&1
echo "runs $SECONDS s"
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
