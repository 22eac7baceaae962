#!/usr/bin/env bash
# run-tests.sh LOG TEST_BIN ARGS... — runs the Criterion test binary, keeping its whole output
# in LOG as well as on the terminal, and when anything failed repeats each failure (the
# [----] assertion lines and the [FAIL]/[CRASH] verdicts) after the run, then the runner's
# closing Synthesis line again last. Parallel jobs interleave a failure's lines with
# hundreds of others; a reader (or a CI page that keeps only the tail) sees them here.
# OpenMP's wait: below. Exit status: the test binary's.
set -uo pipefail
LOG=${1:?usage: run-tests.sh LOG TEST_BIN [ARGS...]}
shift
mkdir -p "$(dirname "$LOG")"
# The wait zps's own processes use (ZPS_OMP_SPINCOUNT, read from common/omp_env.h so there
# is one value), for the test binary and the Python references too: tests run two at a time
# on the cores, and with libgomp's default spin (300,000) an idle OpenMP worker of one test
# burns the core the other test needs. Both Inception-v3 comparisons with PyTorch together
# took 84 s that way, 34 s with this.
if [ -z "${OMP_WAIT_POLICY:-}" ] && [ -z "${GOMP_SPINCOUNT:-}" ]; then
  omp_h="$(dirname "$0")/../common/omp_env.h"
  spin=$(sed -n 's/^#define ZPS_OMP_SPINCOUNT "\([0-9]*\)".*/\1/p' "$omp_h" 2>/dev/null)
  if [ -z "$spin" ]; then
    echo "run-tests.sh: no ZPS_OMP_SPINCOUNT in $omp_h" >&2
    exit 2
  fi
  export GOMP_SPINCOUNT=$spin
fi
"$@" 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then
  echo "---- failures (the whole output is in $LOG) ----"
  grep -E '^\[(----|FAIL|CRASH|ERR |WARN)\]' "$LOG" || echo "(no failure line found; exit status $rc)"
  grep -E '^\[====\] Synthesis' "$LOG" | tail -1
fi
exit "$rc"
