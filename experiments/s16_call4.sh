#!/usr/bin/env bash
# Session 16, device call 4 (one H200): the final code's other rows of the table, each in its own
# process: symmetric weights at M=1,16,256,4096, the TP=8 slice at M=1 and 16, and GEMM2's rows in
# bf16 (the bf16_down_rows opt-in) at M=16 and 256 beside the default; the alignment kernel per
# AlignConfig at T=16, 64, 256 (experiments/align_probe.py).
source experiments/_preamble.sh
timeout 170 python3 examples/mgpu_probe.py --m 1 16 256 4096 --no-zp --json $OUT/sym.json \
   > $OUT/probe.log 2>&1; echo "sym $SECONDS s"
timeout 80 python3 examples/mgpu_probe.py --preset deepseek-v3-tp8 --m 1 16 --json $OUT/tp8.json \
   >> $OUT/probe.log 2>&1; echo "tp8 $SECONDS s"
timeout 120 python3 examples/mgpu_probe.py --m 16 256 --configs 8,256,3,0,-,64,1,-,-,-,-,-,1,1 \
   16,128,3,0,-,128,1,-,-,-,-,-,1,1 --json $OUT/bf16_rows.json >> $OUT/probe.log 2>&1
echo "bf16 rows $SECONDS s"
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
timeout 150 python3 experiments/align_probe.py > $OUT/align.log 2>&1; echo "align $SECONDS s"
grep -v "^WARNING" $OUT/align.log | tail -40
