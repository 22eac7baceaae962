#!/usr/bin/env bash
# bench.sh BUILD_DIR — what `make bench` runs: every benchmark zps-bench knows, with its
# defaults, then the scripts in scripts/bench.d/ (comparisons that drive whole fleets), then
# scripts/bench.d/tf-peers (zps against TensorFlow and PyTorch; it says when it is skipped).
# Each writes JSON under BUILD_DIR/bench/. A failing benchmark fails the run, after the
# others have had their turn.
set -u
B=${1:-build}
export ZPS_BENCH_DIR=${ZPS_BENCH_DIR:-$B/bench}
mkdir -p "$ZPS_BENCH_DIR"
bin=$B/bin/zps-bench
failed=()
# pipeline compares itself with train-step's figure, so it runs after it
names=$("$bin" --list | grep -vx pipeline; "$bin" --list | grep -x pipeline)
for name in $names; do
  echo "=== zps-bench $name"
  if [ "$name" = train-step ]; then
    # full-width Inception-v3 against PyTorch on all cores, then the one-thread comparison
    # against TF and PyTorch (convnet, the demo's Inception-v3) added to the same JSON
    "$bin" train-step --no-tf || failed+=("train-step")
    one=(--threads 1 --pairs 5 --steps 20 --warmup 3 --append)
    "$bin" train-step "${one[@]}" --model convnet || failed+=("train-step convnet")
    "$bin" train-step "${one[@]}" --steps 10 --model inception_v3 --width 0.25 --channels 1 \
      --classes 10 --shapes 75x32 || failed+=("train-step inception_v3 w0.25")
    continue
  fi
  "$bin" "$name" || failed+=("$name")
done
for s in scripts/bench.d/*.sh; do
  [ -e "$s" ] || continue
  echo "=== $s"
  bash "$s" "$B" || failed+=("$s")
done
echo "=== scripts/bench.d/tf-peers"
bash scripts/bench.d/tf-peers "$B" || failed+=("scripts/bench.d/tf-peers")
echo "bench: JSON in $ZPS_BENCH_DIR: $(cd "$ZPS_BENCH_DIR" && ls *.json 2>/dev/null | tr '\n' ' ')"
if [ ${#failed[@]} -gt 0 ]; then
  echo "bench: failed: ${failed[*]}" >&2
  exit 1
fi
