#!/usr/bin/env bash
# Session 24, call 3 (one H200, ~400 s). (1) Call 2's split-K sweep again with each GEMM call
# made to wait for the last: call 2's straight runs were unchained, and their split configs
# (a GEMM kernel and an XLA sum per call) came out at up to 4x below the loop (M=1 default 3.8
# us: 15 MB at the copy ceiling), as if the 16 independent calls had run at once. Now the
# GEMM's block experts depend on the last call's output (mgpu_probe._after_last_gemm), and each
# straight run is also traced (span per call and its kernels). (2) 2 stages for 8-row blocks:
# GEMM1 alone at 2 (GEMM2 at 3) against both at 2, where call 1 and session 23 differ (TP=1
# M=2, 16 gained; TP=8 M=16 gained, M=32 lost 11%).
source experiments/_preamble.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
timeout 300 python3 examples/mgpu_probe.py --preset deepseek-v3-tp8 --m 4 16 8 1 --gemms-only 1 \
  --straight 16 --configs default:splits=1 default:splits=1,stages=2 default:splits=1,stages=4 \
  default:splits=2 default:splits=4 default:splits=8 default:splits=2,stages=2 \
  default:splits=4,stages=2 --json $OUT/splitk.json > $OUT/splitk.log 2>&1
echo "split-K $SECONDS s"
grep -hE "GEMM|copy|FAILED|rror" $OUT/splitk.log | sed -E 's/, (True|False), None, None, None, None, None, [^)]*\)/)/'
timeout 110 python3 examples/mgpu_probe.py --preset deepseek-v3-tp8 --m 16 32 --all-gemms \
  --configs default:stages=2 default:stages=2,down_stages=3 --json $OUT/stages_tp8.json \
  > $OUT/stages_tp8.log 2>&1
echo "tp8 $SECONDS s"
grep -hE "layer|GEMM|copy|FAILED|rror" $OUT/stages_tp8.log | cut -c1-150
timeout 130 python3 examples/mgpu_probe.py --m 2 16 --all-gemms \
  --configs default:stages=2 default:stages=2,down_stages=3 --json $OUT/stages_tp1.json \
  > $OUT/stages_tp1.log 2>&1
echo "tp1 $SECONDS s"
grep -hE "layer|GEMM|copy|FAILED|rror" $OUT/stages_tp1.log | cut -c1-150
