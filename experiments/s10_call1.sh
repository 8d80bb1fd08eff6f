#!/usr/bin/env bash
# Planned for session 10's first device call (one H200; written in session 9, not run yet):
# GEMM2's own block_n / stages (MgpuConfig.down_block_n, down_stages, unmeasured), ptxas'
# registers and spills of the configs that lost in session 9 (fused with 128 features per
# consumer, 128-row blocks: spills suspected), and the DeepSeek-V3 GEMM shapes that call 4 left
# out.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
P="python3 examples/mgpu_probe.py"
timeout 150 $P --m 4096 --configs 64,256,3,2,-,64,1,128,2 64,256,3,2,-,64,1,-,2 \
   --json $OUT/m4096.json > $OUT/probe.log 2>&1
timeout 120 $P --m 1 16 256 --configs 8,256,3,0,-,64,1,128 8,256,3,0,-,64,1,-,2 \
   8,256,3,0,-,64,1,-,4 --json $OUT/decode.json >> $OUT/probe.log 2>&1
for cfg in 64,256,3,2 64,256,2,2,-,128 128,128,3,2; do
  timeout 50 python3 examples/mgpu_profile.py --m 4096 --config $cfg --max-programs 264 \
     --out $OUT/profile_${cfg//,/_} >> $OUT/profile.log 2>&1
done
timeout 130 python3 -m pytest -q -p no:cacheprovider tests/test_mgpu_gemm.py \
    -k "deepseek_v3_shapes and zp" --durations=5 > $OUT/tests.log 2>&1
echo "tests rc=$?" >> $OUT/tests.log
grep -v "^$" $OUT/tests.log | tail -8
grep -E "ptxas|spill|M=4096 +GEMM" $OUT/profile.log
grep -E "layer|GEMM|copy|FAILED" $OUT/probe.log
