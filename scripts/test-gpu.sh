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
set -uo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu}
tarball=$dir/zps-gpu.tar.xz
[ -f "$tarball" ] || { echo "test-gpu: no $tarball: run scripts/gpu-bundle on the build machine first" >&2; exit 2; }
if [ ! -f "$dir/bundle/COMMIT" ] || [ "$tarball" -nt "$dir/bundle/COMMIT" ]; then
  rm -rf "$dir/bundle" && tar -C "$dir" -xJf "$tarball" || { echo "test-gpu: cannot unpack $tarball" >&2; exit 2; }
fi
B=$(cd "$dir/bundle" && pwd)
echo "test-gpu: bundle of commit $(cut -c1-12 "$B/COMMIT"), tree at $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

# The CUDA libraries libzps_cuda.so needs, wherever this machine keeps them.
cuda_dirs=()
py=$(command -v python3 || true)
for lib in libcudnn.so.9 libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
  found=$(ldconfig -p 2>/dev/null | awk -v l="$lib" '$1 == l {print $NF; exit}')
  if [ -z "$found" ]; then
    for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/lib/x86_64-linux-gnu; do
      [ -e "$d/$lib" ] && { found=$d/$lib; break; }
    done
  fi
  if [ -z "$found" ] && [ -n "$py" ]; then
    found=$("$py" - "$lib" <<'PY' 2>/dev/null
import glob, site, sys
for p in site.getsitepackages() + [site.getusersitepackages()]:
    for f in glob.glob(p + "/nvidia/*/lib/" + sys.argv[1]):
        print(f); raise SystemExit
PY
)
  fi
  [ -n "$found" ] || { echo "test-gpu: $lib not found on this machine (loader, /usr/local/cuda, Python wheels)" >&2; exit 2; }
  cuda_dirs+=("$(dirname "$found")")
done
ld=$(printf '%s\n' "$B/sys" "${cuda_dirs[@]}" | awk '!seen[$0]++' | paste -sd:)
export LD_LIBRARY_PATH=$ld${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export ZPS_BIN=$B/bin ZPS_ROOT=$PWD ZPS_CUDA_LIB=$B/lib/libzps_cuda.so ZPS_REQUIRE_GPU=1
export ZPS_FASHION_MNIST_DIR=$B/fashion-mnist ZPS_PYTHON=${ZPS_PYTHON:-$py}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$B/bin/zps-bench" env || true

filter=${ZPS_GPU_FILTER:-'@(k_cuda|device|gpu_*|it_gpu*)/*'}
log=$(mktemp /tmp/zps-test-gpu.XXXXXX)
"$B/tests/zps-tests" -j1 --filter="$filter" ${ZPS_GPU_TEST_ARGS:-} 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
syn=$(grep -a 'Synthesis: Tested:' "$log" | tail -1)
rm -f "$log"
passed=$(sed -n 's/.*Passing: \([0-9]*\).*/\1/p' <<<"$syn"); passed=${passed:-0}
tested=$(sed -n 's/.*Tested: \([0-9]*\).*/\1/p' <<<"$syn"); tested=${tested:-0}
failed=$((tested - passed))
[ $rc -ne 0 ] && [ $failed -eq 0 ] && failed=1
[ "$tested" -gt 0 ] || { echo "test-gpu: no GPU test ran (filter $filter)"; failed=$((failed + 1)); }

if [ "${ZPS_GPU_SANITIZE:-1}" != 0 ] && command -v compute-sanitizer >/dev/null; then
  tmp=$(mktemp -d /tmp/zps-sanitize.XXXXXX)
  "$B/bin/zps-data" convert fashion-mnist --out "$tmp/fm" --limit 512 --shards 1 >/dev/null 2>&1 ||
    echo "test-gpu: cannot convert the data for the sanitizer run" >&2
  # memcheck over local training (the optimizer on the device) and a one-rank all-reduce (the
  # pinned mirrors, the copy stream and the staging thread of trainer/stage.c); racecheck once
  for run in memcheck:local memcheck:allreduce racecheck:local; do
    tool=${run%%:*} mode=${run#*:}
    if compute-sanitizer --tool "$tool" --error-exitcode 99 --target-processes all \
         "$B/bin/zps-trainer" --device cuda --data "$tmp/fm" --model convnet --mode "$mode" \
         --steps 3 --batch-size 8 --eval-batches 1 --no-progress --threads 0 \
         --job "san$$" >"$tmp/$tool-$mode.log" 2>&1; then
      echo "test-gpu: compute-sanitizer $tool, --mode $mode: clean ($(grep -c 'ERROR SUMMARY: 0' "$tmp/$tool-$mode.log") summaries)"
      passed=$((passed + 1))
    else
      echo "test-gpu: compute-sanitizer $tool, --mode $mode FAILED; last lines:"; tail -30 "$tmp/$tool-$mode.log"
      failed=$((failed + 1))
    fi
  done
  rm -rf "$tmp"
else
  echo "test-gpu: compute-sanitizer runs skipped"
fi
echo "test-gpu: $tested Criterion tests ($filter) and the sanitizer runs:"
echo "$passed passed, $failed failed"
[ $failed -eq 0 ]
