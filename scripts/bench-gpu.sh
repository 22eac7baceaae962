#!/usr/bin/env bash
# bench-gpu.sh — the GPU benchmarks (`make bench-gpu`), run like test-gpu.sh from the bundle
# of scripts/gpu-bundle on a machine with an NVIDIA GPU:
#
#   scripts/bench-gpu.sh [DIR]      DIR holds zps-gpu.tar.xz (default .gpu)
#
# 1. `zps-bench train-step --device cuda`: Inception-v3 (torchvision's, aux head on, 3 x 299 x
#    299, 1000 classes) at batch 32 and 128 against PyTorch eager on the same GPU in the same
#    run (the machine's python3 or $ZPS_PYTHON), f32 with TF32 convolutions on both sides,
#    medians of ZPS_GPU_PAIRS (3) alternating rounds; also the TFLOP/s the training step
#    reaches and its fraction of the GPU's TF32 peak. Then the same in bf16: zps's
#    --precision bf16 (cuDNN's BF16 tensor cores) against PyTorch's bf16 autocast.
#    JSON: BENCH_DIR/train_step.json.
# 2. A PS fleet on the GPU: one GPU trainer (Inception-v3 w1 at 299, batch 32, 3 channels from
#    Fashion-MNIST resized) with 2 sync servers, against the same trainer alone (--mode
#    local), in img/s from each run's metrics summary, ZPS_GPU_STEPS (100) steps each; the
#    goal is at least 0.9 (the per-layer copies and pushes hidden behind compute). The fleet
#    fails fast (no trainer restarts) and its servers write no checkpoints, which the lone
#    trainer does not pay for either.
#    JSON: BENCH_DIR/gpu_ps.json.
# BENCH_DIR (ZPS_BENCH_DIR): $OUT when set (a folder a remote runner copies back), else
# build/bench; the trainers' and the fleet's logs go there too (bench-gpu-*.log, and the
# fleet's run folder bench-gpu-fleet/ with each process's log).
# ZPS_GPU_SERVER_ARGS: more zps-server flags for the fleet's servers (e.g. "--apply-threads
# 4", docs/ps.md "Threads"; default none).
# ZPS_GPU_BENCH_S (default 240): seconds each of the four commands may take; a hang ends
# there, named, and the rest still runs (device time is short: docs/gpu.md).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh "${1:-.gpu}" bench-gpu || exit 2
unset ZPS_REQUIRE_GPU
bench=${OUT:-build/bench}
mkdir -p "$bench"
export ZPS_BENCH_DIR=$bench
pairs=${ZPS_GPU_PAIRS:-3} steps=${ZPS_GPU_STEPS:-100}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
rc=0
limit=${ZPS_GPU_BENCH_S:-240}
# bounded CMD...: runs CMD for at most $limit seconds; says so when it was stopped
bounded() {
  timeout --kill-after=10 "$limit" "$@"
  local st=$?
  [ $st -eq 124 ] || [ $st -eq 137 ] &&
    echo "bench-gpu: $(basename "$1") passed its $limit s (ZPS_GPU_BENCH_S) and was stopped" >&2
  return $st
}

bounded "$B/bin/zps-bench" train-step --device cuda --model inception_v3 --shapes 299x32,299x128 \
  --pairs "$pairs" --steps 10 --warmup 3 || rc=1
bounded "$B/bin/zps-bench" train-step --device cuda --model inception_v3 --shapes 299x32,299x128 \
  --pairs "$pairs" --steps 10 --warmup 3 --precision bf16 --append || rc=1

tmp=$(mktemp -d /tmp/zps-bench-gpu.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
logs=${OUT:-$tmp}
"$B/bin/zps-data" convert fashion-mnist --out "$tmp/fm" --limit 8192 --shards 2 >"$tmp/convert.log" 2>&1 ||
  { echo "bench-gpu: cannot convert Fashion-MNIST:" >&2; tail -5 "$tmp/convert.log" >&2; exit 1; }
targs="--device cuda --data $tmp/fm --model inception_v3 --in-channels 3 --input-size 299 \
--batch-size 32 --steps $steps --eval-batches 1 --no-progress --threads 8"
ips() { python3 -c 'import json,sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    if r.get("type") == "summary": print(r["img_s"])' "$1"; }
bounded "$B/bin/zps-trainer" $targs --mode local --metrics "$tmp/alone.jsonl" \
  >"$logs/bench-gpu-alone.log" 2>&1 ||
  { echo "bench-gpu: the lone trainer failed:"; tail -20 "$logs/bench-gpu-alone.log"; rc=1; }
bounded python3 scripts/zps-launch --servers 2 --trainers 1 --run-dir "$logs/bench-gpu-fleet" \
  --on-trainer-exit stop --checkpoint-every-versions 0 --server-args "${ZPS_GPU_SERVER_ARGS:-}" \
  --quiet --trainer-args "$targs --mode sync --metrics $tmp/fleet.jsonl" \
  >"$logs/bench-gpu-fleet.log" 2>&1 ||
  { echo "bench-gpu: the PS fleet failed:"; tail -20 "$logs/bench-gpu-fleet.log"; rc=1; }
alone=$(ips "$tmp/alone.jsonl" 2>/dev/null) fleet=$(ips "$tmp/fleet.jsonl" 2>/dev/null)
if [ -n "$alone" ] && [ -n "$fleet" ]; then
  python3 - "$alone" "$fleet" "$bench/gpu_ps.json" <<'PY'
import json, sys
alone, fleet = float(sys.argv[1]), float(sys.argv[2])
r = {"model": "inception_v3", "size": 299, "batch": 32, "alone_ips": alone,
     "ps_sync_2_servers_ips": fleet, "ratio": fleet / alone, "goal": 0.9}
json.dump(r, open(sys.argv[3], "w"), indent=1)
print("bench-gpu: PS fleet %.1f img/s, alone %.1f: %.3f of the lone trainer (goal 0.9)"
      % (fleet, alone, fleet / alone))
PY
else
  echo "bench-gpu: no img/s summary from the lone trainer ('$alone') or the fleet ('$fleet'):" \
       "no gpu_ps.json"
  rc=1
fi
exit $rc
