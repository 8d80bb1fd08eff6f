#!/usr/bin/env bash
# Session 14, device call 2 (one H200): where GEMM2's f32 store goes at M=4096 (call 1: bf16 rows
# took GEMM2 from 2788.1 to 2499.6 us): the in-kernel profile of the store's parts alone
# (program, store_smem, store_reuse, store_wait: few regions, so no spills), f32 rows (default)
# and bf16 rows; then symmetric weights through their own path (--no-zp) and through the
# zero-point path (--zp8), M=4096, each in its own process on this GPU.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
SECONDS=0
R="program store_smem store_reuse store_wait"
D64=64,256,3,2,-,64,1,128,2,-,-,-,2
timeout 100 python3 examples/mgpu_profile.py --m 4096 --gemms GEMM2 --regions $R \
   --out $OUT/prof_f32 > $OUT/profile.log 2>&1; echo "profile f32 $SECONDS s"
timeout 100 python3 examples/mgpu_profile.py --m 4096 --gemms GEMM2 --regions $R \
   --config $D64,1 --out $OUT/prof_bf16 >> $OUT/profile.log 2>&1; echo "profile bf16 $SECONDS s"
grep -vE "^ptxas info|^$" $OUT/profile.log | grep -E "M=|ptxas|rror" | tail -12
cp $OUT/prof_f32/summary.json $OUT/prof_f32.json; cp $OUT/prof_bf16/summary.json $OUT/prof_bf16.json
rm -rf $OUT/prof_f32 $OUT/prof_bf16
timeout 130 python3 examples/mgpu_probe.py --m 4096 --no-zp --all-gemms --json $OUT/sym.json \
   > $OUT/probe.log 2>&1; echo "sym $SECONDS s"
timeout 130 python3 examples/mgpu_probe.py --m 4096 --zp8 --all-gemms --json $OUT/zp8.json \
   >> $OUT/probe.log 2>&1; echo "zp8 $SECONDS s"
grep -E "layer|GEMM|backend|copy|FAILED|rror" $OUT/probe.log
