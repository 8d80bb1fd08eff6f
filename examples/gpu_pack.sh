#!/usr/bin/env bash
# Packs everything under ${OUT:-out}/ into one archive, ${OUT}/results.tar.gz, and removes the
# rest: the device tool returns at most 8 files per call (16 MiB each), and a two-lane run writes
# more (session 3 lost its triton test log and tuner logs that way). Run it last:
#   bash examples/gpu_parallel.sh "bench" "triton"; bash examples/gpu_pack.sh
# Unpack here with: tar -xzf results.tar.gz
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
[ -d "$OUT" ] || exit 0
tmp=$(mktemp /tmp/results.XXXXXX.tar.gz)
tar -czf "$tmp" -C "$OUT" --exclude results.tar.gz . || exit 1
find "$OUT" -mindepth 1 -delete
mv "$tmp" "$OUT/results.tar.gz"
echo "packed into $OUT/results.tar.gz ($(du -h "$OUT/results.tar.gz" | cut -f1))"
