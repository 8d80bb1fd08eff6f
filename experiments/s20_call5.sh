#!/usr/bin/env bash
# Session 20, call 5 (one H200, ~200 s): session 19's pending configs under the power cap
# (experiments/pending_s19_configs.sh: GEMM2 or GEMM1 at 128 features, GEMM2's rows in bf16,
# sustained 4 s each at M = 16 and 256 with clocks and power).
source experiments/_preamble.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
bash experiments/pending_s19_configs.sh
