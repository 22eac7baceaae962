#!/usr/bin/env bash
# demo.sh BUILD_DIR — the README's main job. Until the trainer issue lands the demo fleet,
# it shows what exists: the optional parts found and the device the binaries would use.
set -eu
B=${1:-build}
echo "zps demo: the trainer and fleet are not built yet; showing the device check."
"$B/bin/zps-bench" env
