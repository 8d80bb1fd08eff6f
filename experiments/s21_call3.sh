#!/usr/bin/env bash
# Session 21, call 3 (one H200, the session's last device seconds): the new default, the int4
# tiles copied in TMA rows of 256 nibbles (128 bytes) in place of a tile's 64-nibble rows: the
# whole compiled test file, then the layer at M = 1, 16, 256, 4096 against the old rows
# (default:weight_row_nibbles=64) in one process, and the TP=8 slice at M = 1, 16.
source experiments/_preamble.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
compiled_tests 270 "not expert_parallel and not tensor_parallel and not ragged_expert"
grep -E "passed|failed" $OUT/tests.log | tail -1
timeout 230 python3 examples/mgpu_probe.py --m 1 16 256 4096 --configs \
  default:weight_row_nibbles=64 --json $OUT/defaults.json > $OUT/probe.log 2>&1
echo "probe $SECONDS s"
timeout 70 python3 examples/mgpu_probe.py --preset deepseek-v3-tp8 --m 1 16 --configs \
  default:weight_row_nibbles=64 --json $OUT/tp8.json > $OUT/probe_tp8.log 2>&1
echo "tp8 $SECONDS s"
grep -hE "layer|GEMM|backend|routing|copy|FAILED|rror" $OUT/probe.log $OUT/probe_tp8.log \
  | sed -E 's/\(([0-9A-Za-z]+, ){16}//'
