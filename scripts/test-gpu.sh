#!/usr/bin/env bash
# test-gpu.sh — the GPU suite (`make test-gpu`), run from a bundle made by scripts/gpu-bundle
# on a machine with an NVIDIA GPU and nothing of ours installed.
#
#   scripts/test-gpu.sh [DIR]       DIR holds zps-gpu.tar.xz (default .gpu)
#
# Unpacks the bundle into DIR/bundle, finds the machine's CUDA libraries (cuDNN 9, cuBLAS 13,
# NCCL 2: the dynamic loader's, /usr/local/cuda, or PyTorch's wheels), then runs the GPU
# suites of the test binary with ZPS_REQUIRE_GPU=1, so a GPU test that would skip fails
# instead. Then compute-sanitizer memcheck and racecheck over a short GPU training run,
# when compute-sanitizer exists. Ends with Criterion's synthesis line and one
# "N passed, N failed" line for the whole suite.
#   ZPS_GPU_FILTER   Criterion filter (default: every GPU suite)
#   ZPS_GPU_SANITIZE 0 skips the compute-sanitizer runs
#   ZPS_GPU_TEST_S   seconds the Criterion run may take (default 300), and
#   ZPS_GPU_SANITIZE_S  each sanitizer run (default 90): a hang ends there, named, and the
#                    rest still runs (device time is short: docs/gpu.md)
#   OUT              when set (a folder a remote runner copies back): the whole Criterion log
#                    (test-gpu.log, with a line per test started, so a hang is named) and every
#                    sanitizer run's log (sanitize-*.log) are written there as they grow, since
#                    a remote runner shows only the end of the output and brings back what is
#                    there even when it stops the command
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh "${1:-.gpu}" test-gpu || exit 2
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$B/bin/zps-bench" env || true
if [ -n "${OUT:-}" ]; then logs=$OUT; mkdir -p "$logs"; else logs=$(mktemp -d /tmp/zps-test-gpu.XXXXXX); fi

filter=${ZPS_GPU_FILTER:-'@(k_cuda|k_async|device|gpu_*|it_gpu*)/*'}
log=$logs/test-gpu.log
test_s=${ZPS_GPU_TEST_S:-300}
timeout --kill-after=10 "$test_s" \
  "$B/tests/zps-tests" -j1 --verbose --filter="$filter" ${ZPS_GPU_TEST_ARGS:-} 2>&1 |
  grep -av ': Test is disabled$' | tee "$log" # (--verbose lists every test the filter leaves out)
rc=${PIPESTATUS[0]}
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
  echo "test-gpu: the Criterion run passed its ${test_s} s (ZPS_GPU_TEST_S) and was stopped;" \
       "the last test started: $(grep -a '^\[RUN \]' "$log" | tail -1)"
fi
syn=$(grep -a 'Synthesis: Tested:' "$log" | tail -1)
passed=$(sed -n 's/.*Passing: \([0-9]*\).*/\1/p' <<<"$syn"); passed=${passed:-0}
tested=$(sed -n 's/.*Tested: \([0-9]*\).*/\1/p' <<<"$syn"); tested=${tested:-0}
if [ -z "$syn" ]; then # stopped: count what the log says
  passed=$(grep -ac '^\[PASS\]' "$log") tested=$((passed + $(grep -acE '^\[(FAIL|CRASH)\]' "$log")))
fi
failed=$((tested - passed))
[ $rc -ne 0 ] && [ $failed -eq 0 ] && failed=1
[ "$tested" -gt 0 ] || { echo "test-gpu: no GPU test ran (filter $filter)"; failed=$((failed + 1)); }

if [ "${ZPS_GPU_SANITIZE:-1}" != 0 ] && command -v compute-sanitizer >/dev/null; then
  tmp=$(mktemp -d /tmp/zps-sanitize.XXXXXX)
  "$B/bin/zps-data" convert fashion-mnist --out "$tmp/fm" --limit 512 --shards 1 >/dev/null 2>&1 ||
    echo "test-gpu: cannot convert the data for the sanitizer run" >&2
  # memcheck over local training (the optimizer on the device), a one-rank all-reduce (NCCL
  # on device gradients) and a sync PS run against a server started here, with bf16 compute
  # and bf16 pushes (the pinned mirrors, the copy stream and the staging thread of
  # trainer/stage.c, k_pack_bf16, the BF16 tensor-core convolutions); racecheck once
  srv_pid= uri=
  "$B/bin/zps-server" --mode sync --num-trainers 1 >"$tmp/server.log" 2>&1 &
  srv_pid=$!
  trap 'kill $srv_pid 2>/dev/null; rm -rf "$tmp"' EXIT # an interrupted run leaves nothing
  for _ in $(seq 100); do  # its endpoint, once it listens (10 s at most)
    uri=$(sed -n 's/^zps-server listening on \(tcp:[^ ]*\).*/\1/p' "$tmp/server.log" | head -1)
    [ -n "$uri" ] && break
    kill -0 $srv_pid 2>/dev/null || break
    sleep 0.1
  done
  [ -n "$uri" ] || echo "test-gpu: the server for the sync run did not start:" "$(tail -3 "$tmp/server.log")"
  for run in memcheck:local memcheck:allreduce memcheck:sync racecheck:local; do
    tool=${run%%:*} mode=${run#*:} extra=()
    [ "$mode" = sync ] && extra=(--servers "$uri" --precision bf16 --push-dtype bf16)
    slog=$logs/sanitize-$tool-$mode.log
    timeout --kill-after=10 "${ZPS_GPU_SANITIZE_S:-90}" \
      compute-sanitizer --tool "$tool" --error-exitcode 99 --target-processes all \
         "$B/bin/zps-trainer" --device cuda --data "$tmp/fm" --model convnet --mode "$mode" \
         --steps 3 --batch-size 8 --eval-batches 1 --no-progress --threads 0 \
         --job "san$$" "${extra[@]}" >"$slog" 2>&1
    src=$?
    if [ $src -eq 0 ]; then
      echo "test-gpu: compute-sanitizer $tool, --mode $mode: clean ($(grep -c 'ERROR SUMMARY: 0' "$slog") summaries)"
      passed=$((passed + 1))
    else
      [ $src -eq 124 ] || [ $src -eq 137 ] &&
        echo "test-gpu: compute-sanitizer $tool, --mode $mode passed its ${ZPS_GPU_SANITIZE_S:-90} s (ZPS_GPU_SANITIZE_S) and was stopped"
      echo "test-gpu: compute-sanitizer $tool, --mode $mode FAILED; last lines:"; tail -30 "$slog"
      grep -q "Device not supported" "$slog" &&
        echo "test-gpu: compute-sanitizer cannot use this GPU (seen on gVisor machines); run the suite on a Firecracker one (docs/gpu.md)"
      failed=$((failed + 1))
    fi
  done
  kill $srv_pid 2>/dev/null; wait $srv_pid 2>/dev/null
  [ -n "${OUT:-}" ] && cp "$tmp/server.log" "$OUT/sanitize-server.log"
  rm -rf "$tmp"
else
  echo "test-gpu: compute-sanitizer runs skipped"
fi
# the failed tests again, each with its assertion lines, where a remote runner's output tail
# shows them (at most 80 lines; the whole log is test-gpu.log)
if grep -aqE '^\[(FAIL|CRASH)\]' "$log"; then
  echo "test-gpu: the Criterion tests that failed, with what they said:"
  awk '/^\[----\]/ { held = held $0 "\n"; next }
       /^\[(FAIL|CRASH)\]/ { printf "%s%s\n", held, $0 }
       { held = "" }' "$log" | tail -80
fi
[ -n "${OUT:-}" ] || rm -rf "$logs"
echo "test-gpu: $tested Criterion tests ($filter) and the sanitizer runs:"
echo "$passed passed, $failed failed"
[ $failed -eq 0 ]
