#!/usr/bin/env bash
# Session 20, call 2 (one H200, ~450 s): what the dequantization's in-register steps cost, at
# M = 1 (not power-capped: is the conversion's latency part of GEMM1's 62% of copy?), 16 and 256
# (power-capped): experiments/convert_cost_probe.py's WRONG-result timing variants.
source experiments/_preamble.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
timeout 540 python3 experiments/convert_cost_probe.py --m 1 16 256 --seconds 2 2>&1 \
   | grep -v "^WARNING" | tee $OUT/convert_cost.log; echo "convert cost $SECONDS s"
