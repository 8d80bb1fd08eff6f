#!/usr/bin/env bash
# Session 23, call 4 (one H200, ~100 s): call 3's lead, 2 stages at decode: the TP=8 slice at
# M=16, the default against 2 stages (both GEMMs), one process.
source experiments/_preamble.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
timeout 110 python3 examples/mgpu_probe.py --preset deepseek-v3-tp8 --m 16 \
  --configs default:stages=2 --json $OUT/stages2_tp8.json > $OUT/stages2_tp8.log 2>&1
echo "tp8 $SECONDS s"
grep -hE "layer|backend  |GEMM|copy|FAILED|rror" $OUT/stages2_tp8.log | sed -E 's/\(([0-9A-Za-z]+, ){1}//'
# Ran after it on the same warm machine, as two more commands (4b, 4c; logs stages2_tp1 and
# stages2_tp1b):
#   timeout 100 python3 examples/mgpu_probe.py --m 16 --configs default:stages=2 --json $OUT/stages2_tp1.json
#   timeout 85 python3 examples/mgpu_probe.py --m 1 64 --configs default:stages=2 --json $OUT/stages2_tp1b.json
