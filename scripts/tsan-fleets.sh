#!/usr/bin/env bash
# tsan-fleets.sh BIN DATA — ThreadSanitizer over real fleets, where the unit suite cannot go
# (Criterion's runner does not start under TSan). BIN holds zps-server and zps-trainer built
# with SAN=thread (`make tsan` builds them); DATA a Fashion-MNIST conversion. Runs on
# 127.0.0.1:
#   1. a sync fleet: 2 servers with --apply-threads 4 (the optimizer's update over a thread
#      pool), 2 trainers, Inception-v3 w0.25 (chunks past the pool's threshold);
#   2. the same in async mode, and in ssp mode (--staleness 2);
#   3. a sync fleet of 2 --device staged trainers (the GPU path's mirrors and copy queue on
#      the CPU's stand-in for a device), and the same as one --node-trainers 2 node;
#   4. the staged sync fleet again, each trainer stopped by SIGTERM mid-run (trainer 0 goes
#      on alone for 10 steps after trainer 1 left);
#   5. two trainers in --mode allreduce (the shared-memory all-reduce's threads).
# Every process's TSan reports go to its own log under $TSAN_OUT (default build-thread/tsan);
# reports inside libzmq are suppressed (it is not instrumented: its own queues look like
# races to TSan). Each process is bounded ($TSAN_LIMIT_S, default 600 s) and stopped by PID.
# Exit status 1 when any process reported a race or failed; the last line says which.
set -u
BIN=${1:?usage: tsan-fleets.sh BIN DATA}
DATA=${2:?usage: tsan-fleets.sh BIN DATA}
OUT=${TSAN_OUT:-build-thread/tsan}
LIMIT=${TSAN_LIMIT_S:-600}
rm -rf "$OUT"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
printf 'called_from_lib:libzmq.so.5\n' > "$OUT/suppressions.txt"
export TSAN_OPTIONS="halt_on_error=0 exitcode=66 suppressions=$OUT/suppressions.txt"
# the runtime lays out its shadow memory only without address randomisation on some kernels
R=()
setarch -R true 2>/dev/null && R=(setarch -R)
servers=()
bad=()
stop_servers() {
  for p in "${servers[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${servers[@]}"; do wait "$p" 2>/dev/null; done
  servers=()
}
trap 'stop_servers' EXIT

# start_server NAME MODE: its URI into $uri (read from its first line)
start_server() {
  local log="$OUT/$1"
  timeout "$LIMIT" "${R[@]}" "$BIN/zps-server" --bind tcp://127.0.0.1:0 --mode "$2" --apply-threads 4 \
    --trainer-timeout 300 > "$log.out" 2> "$log.err" &
  servers+=($!)
  uri=""
  for _ in $(seq 1 200); do # the listening line comes once the socket is bound
    uri=$(sed -n 's/^zps-server listening on //p' "$log.out" 2>/dev/null)
    [ -n "$uri" ] && return 0
    kill -0 "${servers[-1]}" 2>/dev/null || break
    sleep 0.1
  done
  echo "tsan-fleets: server $1 did not start (see $log.err)" >&2
  return 1
}

# trainers NAME ARGS...: two trainers with ARGS, waited for by PID
trainers() {
  local name=$1
  shift
  local pids=() t
  for t in 0 1; do
    timeout "$LIMIT" "${R[@]}" "$BIN/zps-trainer" --data "$DATA" --trainer-id $t --num-trainers 2 \
      --timeout-ms 300000 --no-progress --log-level warn "$@" \
      > "$OUT/$name-trainer$t.out" 2> "$OUT/$name-trainer$t.err" &
    pids+=($!)
  done
  for t in 0 1; do
    wait "${pids[$t]}" || bad+=("$name-trainer$t (exit $?)")
  done
}

# fleet NAME MODE TRAINER-ARGS...: 2 servers in MODE, 2 trainers
fleet() {
  local name=$1 mode=$2
  shift 2
  echo "=== $name: 2 $mode servers (--apply-threads 4), 2 trainers $*"
  start_server "$name-server0" "$mode" || { bad+=("$name-server0"); stop_servers; return; }
  local s0=$uri
  start_server "$name-server1" "$mode" || { bad+=("$name-server1"); stop_servers; return; }
  trainers "$name" --mode "$mode" --servers "$s0,$uri" "$@"
  stop_servers
}

inception=(--model inception_v3 --width 0.25 --input-size 75 --batch-size 16 --steps 10
           --eval-batches 1 --optimizer adam --lr 0.002)
fleet sync sync "${inception[@]}"
fleet async async "${inception[@]}"
fleet ssp ssp --staleness 2 "${inception[@]}"
# the GPU paths on the staged back-end (a device's copy queue on a thread of its own): the
# PS mirrors and their copies (trainer/stage.c), and a node pushing through its leader
fleet staged sync --device staged --model convnet --steps 20 --eval-batches 1
fleet node sync --device staged --node-trainers 2 --job "tsan-node-$$" --model convnet \
  --steps 20 --eval-batches 1
# stop NAME: a sync fleet of 2 staged trainers, each stopped by SIGTERM mid-run (the signal
# path against the threads: the copy queue, heartbeats, LEAVE while requests are in flight)
echo "=== stop: SIGTERM to each of 2 running staged trainers of a sync fleet"
if start_server stop-server0 sync && s0=$uri && start_server stop-server1 sync; then
  spids=()
  for t in 0 1; do
    timeout "$LIMIT" "${R[@]}" "$BIN/zps-trainer" --data "$DATA" --trainer-id $t \
      --num-trainers 2 --servers "$s0,$uri" --mode sync --device staged --model convnet \
      --steps 1000000 --metrics "$OUT/stop-trainer$t.jsonl" --timeout-ms 300000 \
      --no-progress --log-level warn > "$OUT/stop-trainer$t.out" 2> "$OUT/stop-trainer$t.err" &
    spids+=($!)
  done
  # trainer 1 once both have run 20 steps, trainer 0 after 10 more steps alone (bounded)
  want0=20
  for t in 1 0; do
    for _ in $(seq 1200); do
      n0=$(grep -c '"type":"step"' "$OUT/stop-trainer0.jsonl" 2>/dev/null)
      n1=$(grep -c '"type":"step"' "$OUT/stop-trainer1.jsonl" 2>/dev/null)
      [ "${n0:-0}" -ge "$want0" ] && { [ $t = 0 ] || [ "${n1:-0}" -ge 20 ]; } && break
      kill -0 "${spids[$t]}" 2>/dev/null || break
      sleep 0.1
    done
    want0=$(( ${n0:-0} + 10 ))
    kill -TERM "${spids[$t]}" 2>/dev/null
    wait "${spids[$t]}" || bad+=("stop-trainer$t (exit $?)")
  done
else
  bad+=("stop-servers")
fi
stop_servers

echo "=== allreduce: 2 trainers"
trainers allreduce --mode allreduce --job "tsan-$$" --model convnet --steps 20 --eval-batches 1

for f in "$OUT"/*.err; do
  n=$(grep -c 'WARNING: ThreadSanitizer' "$f")
  [ "$n" -gt 0 ] && bad+=("$(basename "$f" .err): $n report(s)")
done
if [ ${#bad[@]} -gt 0 ]; then
  echo "tsan-fleets: FAILED: ${bad[*]} (logs in $OUT)" >&2
  exit 1
fi
echo "tsan-fleets: no race reported by any of the 12 servers and 14 trainers (logs in $OUT)"
