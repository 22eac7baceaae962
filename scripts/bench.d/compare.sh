#!/usr/bin/env bash
# compare.sh BUILD_DIR — the PS-versus-all-reduce comparison of `make bench`: the small
# convnet on Fashion-MNIST under sync, async, ssp and allreduce with 2 trainers (2 servers
# for the PS modes), each stopped at 85% test accuracy or after 150 s. Writes
# BUILD_DIR/bench/compare.json and compare.png (scripts/compare).
set -eu
B=${1:-build}
BIN=$(cd "$B/bin" && pwd)
DATA=$(bash scripts/fashion-data.sh "$BIN")
exec scripts/compare --modes sync,async,ssp,allreduce --trainers 2 --servers 2 --target 0.85 \
  --bin-dir "$BIN" --out-dir "$B/bench" --timeout 400 --server-args="--trainer-timeout 10" \
  --trainer-args "--data $DATA --model convnet --batch-size 32 --optimizer momentum --lr 0.02 --epochs 3 --eval-every 50 --eval-batches 8 --eval-all --stop-accuracy 0.85 --time-limit 150 --staleness 2 --no-progress"
