#!/usr/bin/env bash
# Session 18, call 3 (one H200; at commit 84505f5, where the option lived, reverted after this
# call): GEMM1 prefetching GEMM2's first weights into L2 as its programs finish
# (MgpuConfig.prefetch_down, MiB; L2Prefetch in mgpu_wna16_gemm), beside the default in one
# process at M=1, 16 and 256 (the layer, and at M=1 each GEMM alone: GEMM1's cost of
# issuing the prefetches); the compiled tests of the option first (the layer with it against
# numpy, the lowering).
source experiments/_preamble.sh
compiled_tests 150 "prefetch"
timeout 300 python3 examples/mgpu_probe.py --m 1 16 256 --configs \
   default:prefetch_down=16 default:prefetch_down=32 default:prefetch_down=48 \
   --json $OUT/prefetch.json > $OUT/probe.log 2>&1; echo "probe $SECONDS s"
timeout 120 python3 examples/mgpu_probe.py --m 1 --all-gemms --configs \
   default:prefetch_down=32 --json $OUT/prefetch_gemms.json >> $OUT/probe.log 2>&1
echo "gemms $SECONDS s"
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
