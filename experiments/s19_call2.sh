#!/usr/bin/env bash
# Session 19, call 2 (one H200): programmatic dependent launch (pdl=2: each GEMM waits for the
# previous kernel and lets the next start as soon as its programs have begun; pdl=1: after their
# products) on a second machine: TP=1 with zero points at M = 1, 16, 256, 4096, symmetric weights
# (session 18's pending run, now with PDL beside it), the TP=8 slice, and M = 1, 16 with XLA's own
# kernels launched with PDL too (--xla_gpu_enable_pdl, a second process).
source experiments/_preamble.sh
timeout 200 python3 examples/mgpu_probe.py --m 1 16 256 4096 --configs default:pdl=2 \
   default:pdl=1 --json $OUT/pdl.json > $OUT/probe.log 2>&1; echo "probe $SECONDS s"
timeout 110 python3 examples/mgpu_probe.py --no-zp --m 1 16 256 --configs default:pdl=2 \
   --json $OUT/sym.json > $OUT/probe_sym.log 2>&1; echo "symmetric $SECONDS s"
timeout 70 python3 examples/mgpu_probe.py --preset deepseek-v3-tp8 --m 1 16 \
   --configs default:pdl=2 --json $OUT/tp8.json > $OUT/probe_tp8.log 2>&1; echo "tp8 $SECONDS s"
XLA_FLAGS=--xla_gpu_enable_pdl=true timeout 80 python3 examples/mgpu_probe.py --m 1 16 \
   --configs default:pdl=2 --json $OUT/pdl_xla.json > $OUT/probe_xla.log 2>&1
echo "probe, XLA's PDL $SECONDS s"
grep -hE "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe*.log | sed -E 's/\(([0-9]+, ){15}//'
