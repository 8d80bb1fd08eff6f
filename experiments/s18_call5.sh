#!/usr/bin/env bash
# Session 18, call 5 (one H200): where GEMM2's time goes at M=16 against GEMM1's (GEMM2 streams
# at ~76% of copy, GEMM1 at ~85%): the in-kernel profile of both at the default (spans per
# program, the regions' shares, programs resident per SM) and ptxas' report.
source experiments/_preamble.sh
timeout 200 python3 examples/mgpu_profile.py --m 16 --regions program convert wgmma wait scale \
   store --out $OUT/profile > $OUT/profile.log 2>&1; echo "profile $SECONDS s"
grep -v "^WARNING" $OUT/profile.log | tail -40
cp $OUT/profile/summary.json $OUT/profile_summary.json 2>/dev/null; rm -rf $OUT/profile
