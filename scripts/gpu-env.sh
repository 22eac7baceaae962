# gpu-env.sh — sourced by test-gpu.sh and bench-gpu.sh: unpacks the bundle that
# scripts/gpu-bundle made (DIR/zps-gpu.tar.xz into DIR/bundle, again only when the tarball is
# newer), finds the machine's CUDA libraries (cuDNN 9, cuBLAS 13, NCCL 2: the dynamic loader's,
# /usr/local/cuda, or PyTorch's wheels) and exports what the programs need: LD_LIBRARY_PATH,
# ZPS_BIN, ZPS_ROOT, ZPS_CUDA_LIB, ZPS_REQUIRE_GPU=1, ZPS_FASHION_MNIST_DIR, ZPS_PYTHON; B is
# the unpacked bundle. Returns 2 (after saying why) when something is missing.
#   source scripts/gpu-env.sh DIR WHO     (WHO names the caller in messages)
dir=$1 who=$2
tarball=$dir/zps-gpu.tar.xz
[ -f "$tarball" ] || { echo "$who: no $tarball: run scripts/gpu-bundle on the build machine first" >&2; return 2; }
if [ ! -f "$dir/bundle/COMMIT" ] || [ "$tarball" -nt "$dir/bundle/COMMIT" ]; then
  rm -rf "$dir/bundle" && tar -C "$dir" -xJf "$tarball" || { echo "$who: cannot unpack $tarball" >&2; return 2; }
fi
B=$(cd "$dir/bundle" && pwd)
echo "$who: bundle of commit $(cut -c1-12 "$B/COMMIT"), tree at $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

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
  [ -n "$found" ] || { echo "$who: $lib not found on this machine (loader, /usr/local/cuda, Python wheels)" >&2; return 2; }
  cuda_dirs+=("$(dirname "$found")")
done
ld=$(printf '%s\n' "$B/sys" "${cuda_dirs[@]}" | awk '!seen[$0]++' | paste -sd:)
export LD_LIBRARY_PATH=$ld${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export ZPS_BIN=$B/bin ZPS_ROOT=$PWD ZPS_CUDA_LIB=$B/lib/libzps_cuda.so ZPS_REQUIRE_GPU=1
export ZPS_FASHION_MNIST_DIR=$B/fashion-mnist ZPS_PYTHON=${ZPS_PYTHON:-$py}
