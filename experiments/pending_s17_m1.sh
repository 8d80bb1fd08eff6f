#!/usr/bin/env bash
# Planned in session 17, not run (no device was lent after call 1). For a device call after
# pending_s17.sh (one H200): GEMM2's program shape at one token (DeepSeek-V3 TP=1 M=1), where it
# streams at ~45% of copy against GEMM1's ~62%. A GEMM2 program there streams 64 KB in 8 k-steps
# of 8 KB (896 programs, ~3.4 per SM), a GEMM1 program 458 KB in 28 steps of 16 KB (256
# programs, ~2 per SM): longer GEMM2 programs with as many bytes in flight as GEMM1's, by runs
# of tiles (2 or 7 tiles: 448 or 128 programs), 128 features per program, or more stages. Only
# GEMM2's knobs change (GEMM1 is the default's), so each row is an A/B of GEMM2 in one process;
# --all-gemms times GEMM2 alone at each. Then the TP=8 slice at the same knobs' default.
# Checked without a GPU (session 17): every config lowers for sm_90 at DeepSeek-V3's shapes
# (`python3 examples/mgpu_probe.py --lower-only --m 1 --configs ...`, the same configs) and
# runs in the Mosaic GPU interpreter at the tiny preset.
source experiments/_preamble.sh
timeout 300 python3 examples/mgpu_probe.py --m 1 --all-gemms --configs \
   default:down_tiles_per_program=2 default:down_tiles_per_program=7,down_stages=6 \
   default:down_block_n=128,down_stages=4 default:down_block_n=128,down_tiles_per_program=2 \
   default:down_stages=6 default:consumers=2 \
   --json $OUT/m1_gemm2.json > $OUT/probe.log 2>&1; echo "probe $SECONDS s"
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
