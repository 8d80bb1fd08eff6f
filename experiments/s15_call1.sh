#!/usr/bin/env bash
# Session 15, device call 1 (one H200): the first GPU run of MgpuConfig.direct_token (session 14's
# experiments/pending_direct_token.sh: compiled tests, M=1 TP=1 and TP=8 default vs direct), then
# the M=1 kernel timeline at the defaults (where a decode call's time goes).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
bash experiments/pending_direct_token.sh
timeout 120 python3 examples/kernel_timeline.py --m 1 --calls 50 --json $OUT/timeline.json \
   > $OUT/timeline.log 2>&1; echo "timeline $SECONDS s"
timeout 90 python3 examples/kernel_timeline.py --preset deepseek-v3-tp8 --m 1 --calls 50 \
   >> $OUT/timeline.log 2>&1; echo "timeline tp8 $SECONDS s"
cat $OUT/timeline.log | grep -v "^WARNING" | tail -40
