#!/usr/bin/env bash
# Needs the row-sum code, removed after session 20's call 4: run it on commit 0018d1c.
# Session 20, call 3 (one H200, ~330 s): the row-sum correction after its alignment fix (call 1
# faulted with a misaligned address where a k-step's sums were 64 bytes): compiled tests, the
# probe with each GEMM alone at M = 1, 16, 256, sustained at M = 16 and 256. Call 2 measured the
# zero point's subtraction at 6.7% of the M=256 layer (convert_cost_probe, "no zero point").
source experiments/_preamble.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
bash experiments/pending_s19_row_sums.sh
