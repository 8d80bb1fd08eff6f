#!/usr/bin/env bash
# Session 13, device call 6 (one H200): the GEMMs' output buffers swizzled (SWZ=1: an experiment
# hook in mgpu_wna16_gemm at this commit) against unswizzled, each in its own process on the same
# GPU, M=256 and 4096 at the defaults (compiled tests with SWZ=1 first); then the in-kernel
# profile of GEMM2 at M=4096 (default config).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
SWZ=1 XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 90 python3 -m pytest -q -n 4 \
   tests/test_mgpu_gemm.py -k "smaller_buffer or gemm_matches_numpy or narrow_blocks" \
   > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log
grep -E "^FAILED|Error" $OUT/tests.log | head -20
timeout 110 python3 examples/mgpu_probe.py --m 256 4096 --json $OUT/plain.json > $OUT/probe.log 2>&1
SWZ=1 timeout 110 python3 examples/mgpu_probe.py --m 256 4096 --json $OUT/swizzled.json \
   > $OUT/probe_swz.log 2>&1
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log $OUT/probe_swz.log
timeout 90 python3 examples/mgpu_profile.py --m 4096 --gemms GEMM2 --out $OUT/profile \
   > $OUT/profile.log 2>&1
grep -vE "^ptxas info|^$" $OUT/profile.log | tail -8
