#!/usr/bin/env bash
# Two lanes of gpu_suite.sh at once on a 2-GPU machine: lane 0 on GPU 0, lane 1 on GPU 1, each
# with its own output folder (${OUT:-out}/gpu0, /gpu1) and log. Each lane is one quoted list of
# steps; the lanes must not both write the package's tuned table (use INSTALL=0 for a tuning
# lane beside a benchmarking one).
#
# Usage: bash examples/gpu_parallel.sh "tests w8a16" "tune-decode tune-tp8"
#        INSTALL=0 bash examples/gpu_parallel.sh "bench" "tune-large"
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
if [ $# -ne 2 ]; then
    echo "usage: $0 \"STEPS FOR GPU 0\" \"STEPS FOR GPU 1\"" >&2
    exit 2
fi
mkdir -p "$OUT/gpu0" "$OUT/gpu1"
# shellcheck disable=SC2086  # each lane's steps are words
CUDA_VISIBLE_DEVICES=0 OUT=$OUT/gpu0 bash examples/gpu_suite.sh $1 >"$OUT/gpu0/lane.log" 2>&1 &
lane0=$!
# shellcheck disable=SC2086
CUDA_VISIBLE_DEVICES=1 OUT=$OUT/gpu1 bash examples/gpu_suite.sh $2 >"$OUT/gpu1/lane.log" 2>&1 &
lane1=$!
wait $lane0
rc0=$?
wait $lane1
rc1=$?
echo "lane 0 ($1): exit $rc0; lane 1 ($2): exit $rc1"
tail -n 30 "$OUT/gpu0/lane.log" "$OUT/gpu1/lane.log"
