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
