#!/usr/bin/env bash
# Planned in session 17 (no device was lent after its call 1); run as session 18 call 2. For a
# device call after s18_call1.sh (one H200):
# (1) the warp-specialized GEMMs at decode (one or two consumers, exact or on bf16 weights) and
#     GEMM2 at 128-wide k-steps, each beside the default in one process, at M=1, 16, 256;
# (2) GEMM2's program shape at one token (DeepSeek-V3 TP=1 M=1), where it streams at ~45% of
#     copy against GEMM1's ~62%. A GEMM2 program there streams 64 KB in 8 k-steps of 8 KB (896
#     programs, ~3.4 per SM), a GEMM1 program 458 KB in 28 steps of 16 KB (256 programs, ~2 per
#     SM): longer GEMM2 programs with as many bytes in flight as GEMM1's, by runs of tiles (2 or
#     7 tiles: 448 or 128 programs), 128 features per program, or more stages. Only GEMM2's
#     knobs change (GEMM1 is the default's), so each row is an A/B of GEMM2 in one process;
#     --all-gemms times GEMM2 alone at each.
# Checked without a GPU (session 17): every config lowers for sm_90 at DeepSeek-V3's shapes
# (`python3 examples/mgpu_probe.py --lower-only --m ... --configs ...`, the same configs) and
# runs in the Mosaic GPU interpreter at the tiny preset.
source experiments/_preamble.sh
timeout 280 python3 examples/mgpu_probe.py --m 1 16 256 --configs \
   default:consumers=1 default:consumers=1,bf16_weights=1 \
   default:consumers=2,block_n=64,bf16_weights=1 default:down_block_k=128 \
   --json $OUT/decode_configs.json > $OUT/probe.log 2>&1; echo "configs $SECONDS s"
timeout 250 python3 examples/mgpu_probe.py --m 1 --all-gemms --configs \
   default:down_tiles_per_program=2 default:down_tiles_per_program=7,down_stages=6 \
   default:down_block_n=128,down_stages=4 default:down_block_n=128,down_tiles_per_program=2 \
   default:down_stages=6 default:consumers=2 \
   --json $OUT/m1_gemm2.json >> $OUT/probe.log 2>&1; echo "m1 gemm2 $SECONDS s"
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
