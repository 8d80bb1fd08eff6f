#!/usr/bin/env bash
# Session 19, call 4 (one H200), run with commit a9facbb's PDL code in the working tree (restored
# for the call only): did GEMM2 start before GEMM1 ended under PDL (pdl=2), with XLA's defaults,
# with its command buffers (CUDA graphs) off, and with XLA's own PDL on? Three processes.
source experiments/_preamble.sh
for flags in "" "--xla_gpu_enable_command_buffer=" "--xla_gpu_enable_pdl=true"; do
  XLA_FLAGS="$flags" timeout 120 python3 experiments/pdl_overlap_probe.py --m 1 16 --calls 40 \
     2>&1 | grep -v "^WARNING" | tee -a $OUT/pdl_overlap.log | tail -5
  echo "flags '$flags' $SECONDS s"
done
