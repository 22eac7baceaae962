#!/usr/bin/env bash
# demo.sh BUILD_DIR — the README's main job (`make demo`).
#
# Converts Fashion-MNIST on first use, then launches 2 parameter servers and 2 trainers on
# this machine in async mode, training a width-reduced Inception-v3 (1-channel input,
# images upscaled to the model's input) until the test accuracy reaches 85% or the time
# budget ends. Shows trainer 0's progress, then the final test accuracy of the exported
# model on the whole test split, a table and a plot, and where the logs are.
#
# Environment overrides (defaults are what the README states):
#   DEMO_WIDTH (0.25)  DEMO_SIZE (75)  DEMO_BATCH (32)  DEMO_LR (0.002, adam)
#   DEMO_TIME (360 s of training per trainer)  DEMO_TARGET (0.85)  DEMO_DECAY_STEPS (3500)
set -eu
B=${1:-build}
BIN=$(cd "$B/bin" && pwd)
WIDTH=${DEMO_WIDTH:-0.25}
SIZE=${DEMO_SIZE:-75}
BATCH=${DEMO_BATCH:-32}
LR=${DEMO_LR:-0.002}
TIME=${DEMO_TIME:-360}
TARGET=${DEMO_TARGET:-0.85}
# server versions (pushes of both trainers) over which the learning rate decays to its floor
STEPS=${DEMO_DECAY_STEPS:-3500}
# The trainers measure 2048 test images (sampling error about 0.8%); they stop at the target
# plus half a point so that the whole test split, measured at the end, is at the target.
STOP=$(awk -v t="$TARGET" 'BEGIN { printf "%.4f", t + 0.005 }')

DATA=$(bash scripts/fashion-data.sh "$BIN")
RUN=runs/demo-$(date +%Y%m%d-%H%M%S)
echo "zps demo: 2 servers + 2 trainers (async) on 127.0.0.1, Inception-v3 width $WIDTH at ${SIZE}x${SIZE}x1,"
echo "          adam lr $LR with cosine decay, batch $BATCH per trainer; stops at $TARGET test accuracy or after $TIME s"
echo "          run folder $RUN (one log per process; trainer 0 follows)"
set +e
scripts/zps-launch --servers 2 --trainers 2 --job demo --run-dir "$RUN" --bin-dir "$BIN" \
  --timeout $((TIME + 240)) --follow trainer:0 \
  --server-args="--mode async --trainer-timeout 30" \
  --trainer-args="--data $DATA --mode async --model inception_v3 --width $WIDTH --input-size $SIZE --batch-size $BATCH --optimizer adam --lr $LR --lr-schedule cosine --total-steps $STEPS --min-lr 0.00005 --epochs 20 --eval-every 200 --eval-batches 8 --eval-all --stop-accuracy $STOP --time-limit $TIME --threads 1 --metrics {run_dir}/metrics-{index}.jsonl --export {run_dir}/model.zpsw"
rc=$?
set -e
if [ $rc -ne 0 ]; then
  echo "zps demo: the fleet failed (exit $rc); logs in $RUN" >&2
  exit $rc
fi
echo
echo "zps demo: the exported model on the whole test split:"
"$BIN/zps-trainer" --data "$DATA" --model inception_v3 --width "$WIDTH" --input-size "$SIZE" \
  --init-weights "$RUN/model.zpsw" --eval-only --log-level warn | tee "$RUN/final-accuracy.txt"
acc=$(sed -n 's/.*test accuracy \([0-9.]*\).*/\1/p' "$RUN/final-accuracy.txt")
if awk -v a="$acc" -v t="$TARGET" 'BEGIN { exit !(a >= t) }'; then
  echo "zps demo: target $TARGET reached: $acc on the 10000 test images"
else
  echo "zps demo: target $TARGET NOT reached: $acc on the 10000 test images (give it more time: DEMO_TIME)"
fi
scripts/compare --from-runs async="$RUN" --out-dir "$RUN" --target "$TARGET" || true
echo
echo "zps demo: logs, metrics and the weights are in $RUN; plot: $RUN/compare.png"
