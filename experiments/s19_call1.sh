#!/usr/bin/env bash
# Session 19, call 1 (one H200): programmatic dependent launch (PDL) of the mgpu GEMMs, new:
# (1) compiled tests: two chained DeepSeek-V3 TP=1 layers with PDL equal those without bit for
# bit, and match 'xla'; (2) the layer at M = 1, 16, 256: the default against PDL with the next
# kernel let in after the products (pdl=1) or at the start (pdl=2), GEMM2 prefetching its first
# weights into L2 before its wait (down_pdl_prefetch k-steps) or not; (3) the same with XLA's own
# kernels launched with PDL too (--xla_gpu_enable_pdl), a second process.
source experiments/_preamble.sh
compiled_tests 150 "dependent_launch"
timeout 230 python3 examples/mgpu_probe.py --m 1 16 256 --configs default:pdl=1 \
   default:pdl=1,down_pdl_prefetch=8 default:pdl=2 default:pdl=2,down_pdl_prefetch=8 \
   --json $OUT/pdl.json > $OUT/probe.log 2>&1; echo "probe $SECONDS s"
XLA_FLAGS=--xla_gpu_enable_pdl=true timeout 150 python3 examples/mgpu_probe.py --m 1 16 256 \
   --configs default:pdl=1,down_pdl_prefetch=8 default:pdl=2,down_pdl_prefetch=8 \
   --json $OUT/pdl_xla.json > $OUT/probe_xla.log 2>&1; echo "probe, XLA's PDL $SECONDS s"
grep -hE "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log $OUT/probe_xla.log
