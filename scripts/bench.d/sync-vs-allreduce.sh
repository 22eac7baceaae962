#!/usr/bin/env bash
# sync-vs-allreduce.sh BUILD_DIR — `make bench`'s sync PS against zps's own all-reduce: the
# convnet and Inception-v3 w0.25 at 75 on Fashion-MNIST, `--mode sync` (2 servers, 2
# trainers) and `--mode allreduce` (2 trainers), fixed step counts, alternating runs, median of
# the paired ratios and the load during each run (scripts/bench.d/sync_vs_allreduce.py).
# Writes BUILD_DIR/bench/sync_vs_allreduce.json and prints the table. Runs alone too:
#   bash scripts/bench.d/sync-vs-allreduce.sh build
# SYNC_AR_PAIRS (3), SYNC_AR_SCALE (3: times peers.py's steady steps), SYNC_AR_MODELS (convnet,inception_v3).
set -eu
B=${1:-build}
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=$(cd "$B/bin" && pwd)
DATA=$(bash scripts/fashion-data.sh "$BIN")
BENCH_DIR=${ZPS_BENCH_DIR:-$B/bench}
exec python3 "$HERE/sync_vs_allreduce.py" --bin-dir "$BIN" --data "$DATA" \
  --out "$BENCH_DIR/sync_vs_allreduce.json" --work-dir "$B/sync-ar-runs/$(date +%Y%m%d-%H%M%S)"
