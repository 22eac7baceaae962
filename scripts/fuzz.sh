#!/usr/bin/env bash
# fuzz.sh DIR — runs every libFuzzer target built into DIR (by `make fuzz`) for
# $FUZZ_SECONDS seconds each (default 60), corpus in DIR/corpus-NAME, findings in
# DIR/crash-*. Exit status is non-zero when a target found a crash.
set -u
D=${1:-build-fuzz}
secs=${FUZZ_SECONDS:-60}
failed=()
for t in "$D"/fuzz_*; do
  [ -x "$t" ] || continue
  n=$(basename "$t")
  mkdir -p "$D/corpus-$n"
  echo "=== $n for ${secs}s"
  "$t" -max_total_time="$secs" -max_len=65536 -timeout=10 -artifact_prefix="$D/" \
       -print_final_stats=1 "$D/corpus-$n" || failed+=("$n")
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: findings in: ${failed[*]} (see $D/crash-*)" >&2
  exit 1
fi
echo "fuzz: no findings"
