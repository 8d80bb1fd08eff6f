#!/usr/bin/env bash
# Session 17, device call 1 (one H200): GEMM2 adding its weighted rows into the tokens' rows
# (mgpu_wna16_gemm's row_targets, TMA reduce-add; the layer's fused_topk_sum). Compiled tests of
# the kernel mode, the layer against the rows path and the DeepSeek-V3 TP=1 layer (both paths)
# against 'xla'; then each M's default with and without it, and both GEMMs alone at each.
source experiments/_preamble.sh
compiled_tests 240 "adds_weighted or fused_topk_sum_matches or deepseek_v3_tp1_gpu"
timeout 250 python3 examples/mgpu_probe.py --m 1 16 256 4096 --configs default:fused_topk_sum=1 \
   --all-gemms --json $OUT/fused_sum.json > $OUT/probe.log 2>&1; echo "probe $SECONDS s"
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
# Result (docs/logs/*_s17_call1*): 26 compiled tests passed, but the layer was slower with the
# fused top-k sum at every M (81.5 -> 86.6, 770.0 -> 776.7, 1898.5 -> 1917.3, 6398.6 -> 7127.3
# us): session 13 had measured the same idea (per-row bulk reductions) with the same outcome.
# Reverted; the probe keeps its "default:field=value" configs.
