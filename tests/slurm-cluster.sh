#!/bin/sh
# tests/slurm-cluster.sh — a real single-node Slurm cluster in a temporary directory, for the
# it_slurm tests (tests/test_launch_slurm.c):
#
#   tests/slurm-cluster.sh up DIR WATCH_PID    start munged, slurmctld, slurmd; wait until the
#                                             node is idle; prints the SLURM_CONF path
#   tests/slurm-cluster.sh down DIR            cancel every job, stop the daemons by PID
#
# Everything lives under DIR: its own munge key and socket, slurm.conf (free ports picked
# here, so it collides with nothing else on the machine), state, spool, logs and pid files.
# The daemons are only ever stopped through DIR's pid files, never by name; `down` cancels
# the jobs and waits for them first, then kills what the jobs left by PID (processes whose
# environment holds SLURM_CONF=DIR/slurm.conf). A watcher
# (started by `up`) stops them too once WATCH_PID (the test) has gone, so a test killed by
# its timeout leaves no daemon behind. Needs slurm-wlm and munge (make deps) and root
# (SlurmUser=root, as the Debian packages run it here).
set -u

die() { echo "slurm-cluster.sh: $*" >&2; exit 1; }

# polls until "$@" succeeds or $deadline (seconds since the epoch) has passed
wait_for() {
    while ! "$@" >/dev/null 2>&1; do
        [ "$(date +%s)" -ge "$deadline" ] && return 1
        sleep 0.1
    done
}

stop_pidfile() { # SIGTERM, then SIGKILL after 5 s
    [ -s "$1" ] || return 0
    pid=$(cat "$1")
    kill -TERM "$pid" 2>/dev/null || return 0
    deadline=$(($(date +%s) + 5))
    wait_for sh -c "! kill -0 $pid" || kill -KILL "$pid" 2>/dev/null
    rm -f "$1"
}

# PIDs of what the jobs left: slurmstepd and everything under it carry
# SLURM_CONF=DIR/slurm.conf (this cluster's own path) in their environment. Not listed: the
# daemons (stopped by their pid files) and this script's ancestors (the test's shell, the
# watcher), which may carry it too.
leftover_pids() {
    keep=" $(cat "$1/slurmd.pid" "$1/slurmctld.pid" 2>/dev/null | tr '\n' ' ') "
    p=$$
    while [ "$p" -gt 1 ] 2>/dev/null; do
        keep="$keep$p "
        p=$(sed 's/.*) . \([0-9]*\).*/\1/' "/proc/$p/stat" 2>/dev/null) || break
    done
    for e in /proc/[0-9]*/environ; do
        p=${e#/proc/} p=${p%/environ}
        case "$keep" in *" $p "*) continue ;; esac
        { tr '\0' '\n' <"$e"; } 2>/dev/null | grep -qx "SLURM_CONF=$1/slurm.conf" && echo "$p"
    done
}

down() {
    dir=$1
    if [ -s "$dir/slurmctld.pid" ] && [ -f "$dir/slurm.conf" ]; then
        SLURM_CONF="$dir/slurm.conf" timeout 10 scancel --quiet --full --user=root 2>/dev/null
        # the daemons must outlive the jobs: a slurmstepd left without them never ends
        deadline=$(($(date +%s) + 15))
        wait_for env SLURM_CONF="$dir/slurm.conf" sh -c '[ -z "$(squeue -h -o %i)" ]'
    fi
    pids=$(leftover_pids "$dir")
    [ -n "$pids" ] && kill -KILL $pids 2>/dev/null
    stop_pidfile "$dir/slurmd.pid"
    stop_pidfile "$dir/slurmctld.pid"
    stop_pidfile "$dir/munge/munged.pid"
    [ -s "$dir/watcher.pid" ] && kill -TERM "$(cat "$dir/watcher.pid")" 2>/dev/null
    rm -f "$dir/watcher.pid"
    return 0
}

up() {
    dir=$1 watch=$2
    for t in munged slurmctld slurmd sbatch scontrol srun; do
        command -v "$t" >/dev/null || [ -x "/usr/sbin/$t" ] || die "$t not installed (make deps)"
    done
    mkdir -p "$dir/munge" "$dir/state" "$dir/spool" "$dir/log" || die "mkdir $dir"
    chmod 700 "$dir/munge"
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 2>/dev/null || die "munge key"
    chmod 400 "$dir/munge/munge.key"
    PATH=$PATH:/usr/sbin munged --force --socket="$dir/munge/sock" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" \
        --seed-file="$dir/munge/munged.seed" --key-file="$dir/munge/munge.key" ||
        die "munged did not start: $(cat "$dir/munge/munged.log")"
    ports=$(python3 -c 'import socket
s=[socket.socket() for _ in range(2)]
[x.bind(("127.0.0.1",0)) for x in s]
print(*[x.getsockname()[1] for x in s])') || die "no free ports"
    set -- $ports
    host=$(hostname -s)
    cat >"$dir/slurm.conf" <<EOF
ClusterName=zpstest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$1
SlurmdPort=$2
AuthType=auth/munge
AuthInfo=socket=$dir/munge/sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait=10
NodeName=$host NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
    export SLURM_CONF="$dir/slurm.conf"
    /usr/sbin/slurmctld -i || die "slurmctld did not start: $(tail -5 "$dir/log/slurmctld.log")"
    /usr/sbin/slurmd || die "slurmd did not start: $(tail -5 "$dir/log/slurmd.log")"
    # the watcher: stops everything once the test is gone (tail --pid waits without polling)
    setsid sh -c "tail --pid=$watch -f /dev/null; '$0' down '$dir'" </dev/null \
        >/dev/null 2>&1 &
    echo $! >"$dir/watcher.pid"
    deadline=$(($(date +%s) + 20))
    wait_for sh -c "sinfo -h -o %t | grep -qx idle" ||
        die "the node did not become idle: $(sinfo 2>&1; tail -5 "$dir/log/slurmd.log")"
    echo "$SLURM_CONF"
}

case "${1:-}" in
up) [ $# -eq 3 ] || die "usage: up DIR WATCH_PID"; up "$2" "$3" ;;
down) [ $# -eq 2 ] || die "usage: down DIR"; down "$2" ;;
*) die "usage: $0 up DIR WATCH_PID | down DIR" ;;
esac
