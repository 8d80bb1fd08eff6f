#!/usr/bin/env bash
# Session 18, call 4 (one H200): (1) compiled tests of the opt-in block choice (ByRouting) and
# the DeepSeek-V3 TP=1 layer at the new default (the block size by the token count, no XLA
# conditional); (2) the figures at the new default, M = 1, 16, 64, 256, 4096 ("mgpu backend" is
# now the default config; "backend by routing" the opt-in); (3) the same decode layers with
# XLA's command buffers off (--xla_gpu_enable_command_buffer= : every kernel launched on its
# own, no CUDA graphs; session 11 tried more of them, not none), and their kernel timeline.
source experiments/_preamble.sh
compiled_tests 150 "picks_blocks_by_routing or deepseek_v3_tp1_gpu"
timeout 250 python3 examples/mgpu_probe.py --m 1 16 64 256 4096 \
   --json $OUT/defaults.json > $OUT/probe.log 2>&1; echo "probe $SECONDS s"
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 110 python3 examples/mgpu_probe.py \
   --m 1 16 --chain --json $OUT/no_cmd_buffers.json > $OUT/probe_nocb.log 2>&1
echo "probe without command buffers $SECONDS s"
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 60 python3 examples/kernel_timeline.py \
   --m 1 16 --calls 64 --json $OUT/timeline_nocb.json > $OUT/timeline_nocb.log 2>&1
echo "timeline $SECONDS s"
grep -hE "layer|GEMM|backend|routing|chained|copy|FAILED|rror" $OUT/probe.log $OUT/probe_nocb.log
grep -v "^WARNING" $OUT/timeline_nocb.log | tail -30
