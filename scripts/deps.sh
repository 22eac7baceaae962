#!/usr/bin/env bash
# Installs, only when missing, the Debian packages zps needs (called by `make deps`).
# As root: apt-get install --no-install-recommends, with apt-get update first when a
# package has no install candidate. Not root and something missing: names it and fails.
set -u
PKGS=(
  build-essential pkg-config clang
  libzmq3-dev libprotobuf-c-dev protobuf-c-compiler
  liblmdb-dev lmdb-utils
  libdnnl-dev
  libturbojpeg0-dev libpng-dev zlib1g-dev
  libsodium-dev
  libcriterion-dev
  gnuplot-nox
  dataset-fashion-mnist
  python3 python3-numpy python3-torch python3-torchvision python3-venv
  libjemalloc2
  libclang-rt-14-dev
  slurm-wlm munge openssh-server openssh-client
  python3-pytest python3-pip python3-lmdb
)
[ -n "${ZPS_EXTRA_PKGS:-}" ] && PKGS+=(${ZPS_EXTRA_PKGS})

missing=()
for p in "${PKGS[@]}"; do
  st=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)
  [ "$st" = "install ok installed" ] || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "deps: all ${#PKGS[@]} Debian packages present"
  exit 0
fi
echo "deps: missing Debian packages: ${missing[*]}"
if [ "$(id -u)" != 0 ]; then
  echo "deps: not root: install them with" >&2
  echo "  sudo apt-get install --no-install-recommends ${missing[*]}" >&2
  exit 1
fi
need_update=0
for p in "${missing[@]}"; do
  cand=$(apt-cache policy "$p" 2>/dev/null | awk '/Candidate:/ {print $2}')
  if [ -z "$cand" ] || [ "$cand" = "(none)" ]; then need_update=1; break; fi
done
export DEBIAN_FRONTEND=noninteractive
if [ $need_update = 1 ]; then
  echo "deps: apt-get update (a package has no install candidate yet)"
  apt-get update -qq || { echo "deps: apt-get update failed" >&2; exit 1; }
fi
if ! apt-get install -y -qq --no-install-recommends "${missing[@]}" >/tmp/zps-deps.$$.log 2>&1; then
  echo "deps: apt-get install failed; last lines of its log:" >&2
  tail -20 /tmp/zps-deps.$$.log >&2
  rm -f /tmp/zps-deps.$$.log
  exit 1
fi
rm -f /tmp/zps-deps.$$.log
echo "deps: installed ${missing[*]}"
