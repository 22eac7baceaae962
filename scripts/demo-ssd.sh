#!/usr/bin/env bash
# demo-ssd.sh BUILD_DIR — `DEMO_MODEL=ssd make demo`: the detector's demo.
#
# Makes the detection dataset on first use (zps-data make-detection: Fashion-MNIST items on
# 128x128 canvases, 10000 training and 2000 test canvases), then launches 2 parameter servers
# and 2 trainers on this machine in async mode, training the ssd detector for a fixed number
# of steps per trainer with the learning rate's cosine decay over exactly those steps. Shows
# trainer 0's progress (test mAP@0.5 on 256 test canvases every DEMO_EVAL steps), then the
# exported model's VOC mAP@0.5 on the whole test split, a PNG of a test canvas with the
# predicted (green) and true (red) boxes, the mAP-against-time plot and where the logs are.
#
# The work is bounded by steps, not by time: a busy machine makes the demo slower, not
# less accurate. DEMO_TIMEOUT only guards against a hang.
#
# Environment overrides (defaults: docs/training.md, "Training the detector"):
#   DEMO_WIDTH (1)  DEMO_BATCH (16)  DEMO_LR (0.001, adam)  DEMO_STEPS (300 per trainer)
#   DEMO_EVAL (50)  DEMO_TARGET (0.6, mAP@0.5)  DEMO_TIMEOUT (7200 s)
#   DEMO_DATA (data/detection)  DEMO_TRAIN (10000)  DEMO_TEST (2000)
set -eu
B=${1:-build}
BIN=$(cd "$B/bin" && pwd)
. scripts/demo-common.sh
WIDTH=${DEMO_WIDTH:-1}
BATCH=${DEMO_BATCH:-16}
LR=${DEMO_LR:-0.001}
STEPS=${DEMO_STEPS:-300}
EVAL=${DEMO_EVAL:-50}
TARGET=${DEMO_TARGET:-0.6}
TIMEOUT=${DEMO_TIMEOUT:-7200}
DATA=${DEMO_DATA:-data/detection}
TRAINERS=2
# async: the schedule's step is the servers' version, STEPS x TRAINERS of them
DECAY=$((TRAINERS * STEPS))

if [ ! -f "$DATA/train/classes.txt" ] || [ ! -f "$DATA/test/classes.txt" ]; then
  echo "making the detection dataset in $DATA (first use)"
  "$BIN/zps-data" make-detection --out "$DATA" --train "${DEMO_TRAIN:-10000}" \
    --test "${DEMO_TEST:-2000}" --force
fi
RUN=runs/demo-ssd-$(date +%Y%m%d-%H%M%S)
echo "zps demo: 2 servers + $TRAINERS trainers (async) on 127.0.0.1, the ssd detector (width $WIDTH) on"
echo "          128x128 canvases, adam lr $LR with cosine decay over $STEPS steps per trainer, batch"
echo "          $BATCH per trainer; run folder $RUN (one log per process; trainer 0 follows)"
demo_launch demo-ssd "$RUN" "--data $DATA --mode async --model ssd --width $WIDTH --batch-size $BATCH --optimizer adam --lr $LR --lr-schedule cosine --total-steps $DECAY --min-lr 0.00001 --steps $STEPS --eval-every $EVAL --eval-batches 1 --threads 1 --metrics {run_dir}/metrics-{index}.jsonl --export {run_dir}/model.zpsw"
echo
echo "zps demo: the exported detector on the whole test split:"
"$BIN/zps-trainer" --data "$DATA" --model ssd --width "$WIDTH" --batch-size "$BATCH" \
  --init-weights "$RUN/model.zpsw" --eval-only --dump-detections 0 \
  --dump-out "$RUN/detections.png" --log-level warn | tee "$RUN/final-map.txt"
map=$(sed -n 's/.*test mAP@0.5 \([0-9.]*\).*/\1/p' "$RUN/final-map.txt")
n=$(sed -n 's/.* on \([0-9]*\) test images.*/\1/p' "$RUN/final-map.txt")
if demo_reached "$map" "$TARGET"; then
  echo "zps demo: mAP@0.5 $map on the $n test canvases (target $TARGET reached)"
else
  echo "zps demo: mAP@0.5 $map on the $n test canvases, below the target $TARGET (give it more steps: DEMO_STEPS)"
fi
scripts/compare --from-runs async="$RUN" --out-dir "$RUN" --target "$TARGET" || true
echo
echo "zps demo: predicted (green) and true (red) boxes of test canvas 0: $RUN/detections.png"
echo "zps demo: logs, metrics and the weights are in $RUN; plot: $RUN/compare.png"
