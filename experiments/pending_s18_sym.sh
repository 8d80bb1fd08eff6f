#!/usr/bin/env bash
# Planned in session 18, not run (too little device time was left to start a machine): symmetric
# weights (no zero points) at the final code, M = 1, 16, 256 (the backend at 256 now runs
# without the run-time choice).
source experiments/_preamble.sh
timeout 140 python3 examples/mgpu_probe.py --no-zp --m 1 16 256 --json $OUT/sym.json \
   > $OUT/probe.log 2>&1; echo "probe $SECONDS s"
grep -E "layer|GEMM|backend|routing|copy|FAILED|rror" $OUT/probe.log
