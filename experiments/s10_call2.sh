#!/usr/bin/env bash
# Session 10, device call 2 (one H200): the empty-body TMA pipeline's streaming rate by box
# size, stages and programs (experiments/stream_probe.py: the ceiling of the decode structure);
# GEMM1 stages / splits at M=1 with GEMM2 at 2 stages; GEMM2's features and stages at M=256;
# GEMM2 at 3 stages or 256 features at M=4096; ptxas' registers and spills without the profiler.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
P="python3 examples/mgpu_probe.py"
timeout 100 python3 experiments/stream_probe.py --box-kb 8 16 32 --stages 2 4 8 \
   --programs 256 1024 > $OUT/stream.log 2>&1
timeout 100 $P --m 1 --configs 8,256,3,0,-,64,1,-,2 8,256,4,0,-,64,1,-,2 8,256,5,0,-,64,1,-,2 \
   8,512,2,0,-,64,1,-,2 8,256,3,0,2,64,1,-,2 --json $OUT/m1.json > $OUT/probe.log 2>&1
timeout 100 $P --m 256 --configs 16,128,3,0,-,128,1,64 16,128,3,0,-,128,1,-,2 \
   16,128,3,0,-,128,1,-,4 16,256,3,0,-,128 --json $OUT/m256.json >> $OUT/probe.log 2>&1
timeout 130 $P --m 4096 --configs 64,256,3,2,-,64,1,128,3 64,256,3,2,-,64,1,256,2 \
   --json $OUT/m4096.json >> $OUT/probe.log 2>&1
for cfg in 64,256,3,2,-,64,1,128,2 64,256,3,2,-,128 128,128,3,2; do
  timeout 40 python3 examples/mgpu_profile.py --m 4096 --config $cfg --max-programs 264 \
     --no-trace --out $OUT/profile_${cfg//,/_} >> $OUT/profile.log 2>&1
done
cat $OUT/stream.log
grep -E "ptxas|Error" $OUT/profile.log | sort | uniq -c | head -30
grep -E "layer|GEMM|copy|FAILED|Error" $OUT/probe.log
