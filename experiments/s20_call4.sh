#!/usr/bin/env bash
# Needs the row-sum code, removed after session 20's call 4: run it on commit 0018d1c.
# Session 20, call 4 (one H200, ~220 s): the row-sum correction with each group's sums loaded
# once per k-step before the products (call 3: GEMM1 at M=256 5.5% slower than the default
# while "no zero point" ran 6.7% faster in call 2), and where call 3's GPU failure
# (dropped_slots[row_sums], 3.6% error) sits: the small layer cases without an expert map too.
source experiments/_preamble.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
compiled_tests 150 "test_gemm_offset_by_row_sums or row_sums_deepseek or dropped_slots or (matches_numpy and row_sums)"
grep -E "passed|failed" $OUT/tests.log | tail -1
timeout 150 python3 examples/mgpu_probe.py --m 16 256 --configs default:offset_by_row_sums=1 \
   --all-gemms --json $OUT/row_sums.json > $OUT/probe.log 2>&1; echo "probe $SECONDS s"
grep -hE "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log | sed -E 's/\(([0-9]+, ){15}//'
