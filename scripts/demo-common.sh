# demo-common.sh — what the two demos (scripts/demo.sh, scripts/demo-ssd.sh) share; sourced
# by them, after they set BIN, TRAINERS and TIMEOUT.

# demo_launch JOB RUN TRAINER_ARGS: the demo's async fleet (2 servers, TRAINERS trainers on
# this machine, trainer 0 followed); on failure says where the logs are and exits with the
# launcher's status.
demo_launch() {
  local rc
  set +e
  scripts/zps-launch --servers 2 --trainers "$TRAINERS" --job "$1" --run-dir "$2" \
    --bin-dir "$BIN" --timeout "$TIMEOUT" --follow trainer:0 \
    --server-args="--mode async --trainer-timeout 30" --trainer-args="$3"
  rc=$?
  set -e
  if [ $rc -ne 0 ]; then
    echo "zps demo: the fleet failed (exit $rc); logs in $2" >&2
    exit $rc
  fi
}

# demo_reached VALUE TARGET: exit status 0 when VALUE >= TARGET (decimal numbers).
demo_reached() {
  awk -v a="$1" -v t="$2" 'BEGIN { exit !(a >= t) }'
}
