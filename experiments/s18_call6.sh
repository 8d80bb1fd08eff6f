#!/usr/bin/env bash
# Session 18, call 6 (one H200, the session's last ~200 s): symmetric weights (no zero points)
# at the final code, M = 1, 16, 256 (the backend at 256 now runs without the run-time choice).
source experiments/_preamble.sh
timeout 140 python3 examples/mgpu_probe.py --no-zp --m 1 16 256 --json $OUT/sym.json \
   > $OUT/probe.log 2>&1; echo "probe $SECONDS s"
grep -E "layer|GEMM|backend|routing|copy|FAILED|rror" $OUT/probe.log
