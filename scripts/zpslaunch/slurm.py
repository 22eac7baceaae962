"""zpslaunch.slurm - the slurm launcher: the fleet from the allocation, one `srun` step per
process, stops through `scancel --signal`, and telling a cancelled job from a failure.

Inside an allocation (sbatch/salloc: SLURM_JOB_ID is set) and without --cluster, the fleet
comes from the allocation: the nodes (`scontrol show hostnames $SLURM_JOB_NODELIST`), their
tasks (SLURM_TASKS_PER_NODE, "2(x3),1") and GPUs (`scontrol show job -d` GRES IDX, else
SLURM_GPUS_ON_NODE). Every node gets --servers-per-node servers (default 1) on ports
port-base + k and --trainers-per-node trainers (default: one per GPU, else one).

Invariants:
- One step per process: `srun --overlap --nodes=1 --ntasks=1 --nodelist=HOST
  --job-name=JOB-ROLE-I CMD`. --overlap lets the steps share the allocation's CPUs (without it
  only the first step runs: the others wait "Requested nodes are busy"); one step per process
  lets the supervisor restart one dead server and report each process on its own.
- srun is never sent SIGTERM by us: srun turns a SIGTERM it receives into a SIGKILL of its
  tasks ("forcing job termination"). A stop is `scancel --signal=TERM JOBID.STEPID` (the task
  gets SIGTERM, checkpoints, exits 0 and srun returns 0); the step id is looked up by its name.
- When Slurm ends the job (scancel, time limit), slurmd SIGTERMs every step, this launcher
  included. ending() tells that from a process failing, so no restart is attempted and the
  processes are reported "stopped (job cancelled)", not "ok".
"""
import os
import re
import shlex
import shutil
import signal
import subprocess
import time

NOT_IN_ALLOCATION = ("not inside a Slurm allocation: run it from sbatch or salloc "
                     "(see docs/training.md)")
PORT_SPAN = 16  # ports per node and job with the default --port-base


def add_arguments(ap):
    g = ap.add_argument_group("slurm (--launcher slurm inside an allocation, no --cluster)")
    g.add_argument("--servers-per-node", type=int, default=1, metavar="N",
                   help="servers on every node of the allocation (default 1)")
    g.add_argument("--trainers-per-node", type=int, metavar="M",
                   help="trainers on every node (default: one per GPU of the node, else one)")
    g.add_argument("--port-base", type=int, metavar="P",
                   help="server k of a node listens on P + k (default 20000 + 16 * "
                        "(SLURM_JOB_ID mod 800): jobs sharing a node get different ports)")
    g.add_argument("--node-address", choices=("name", "addr"), default="name",
                   help="what the cluster file says for a node: its Slurm name (default) or "
                        "its NodeAddr from `scontrol show node`")
    g.add_argument("--srun", default="srun", help="srun command (slurm launcher)")
    g.add_argument("--srun-args", default="", help="extra srun arguments (one string)")


def _run(argv, timeout=15):
    """stdout of argv; raises RuntimeError with its stderr when it fails."""
    try:
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"{shlex.join(argv)}: {e}")
    if r.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} failed: {r.stderr.strip()}")
    return r.stdout


def check(args):
    """Why --launcher slurm cannot run here (None: it can). Starts nothing."""
    if not os.environ.get("SLURM_JOB_ID"):
        return NOT_IN_ALLOCATION
    missing = [t for t in (shlex.split(args.srun)[0], "scontrol", "squeue", "scancel")
               if not shutil.which(t)]
    if missing:
        return f"--launcher slurm needs {', '.join(missing)} on PATH (Slurm's client commands)"
    return None


def expand_counts(text):
    """SLURM_TASKS_PER_NODE's "2(x3),1" -> [2, 2, 2, 1]; raises ValueError."""
    out = []
    for part in filter(None, text.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ValueError(f"cannot read '{text}'")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def hostnames(nodelist):
    return _run(["scontrol", "show", "hostnames", nodelist]).split()


def _count_idx(idx):
    """GRES IDX "0-1,3" -> 3."""
    n = 0
    for part in filter(None, idx.split(",")):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n


def gpus_per_node(job_id, nodes):
    """{node: GPUs} from `scontrol show job -d` (lines "Nodes=X ... GRES=gpu:2(IDX:0-1)"),
    else SLURM_GPUS_ON_NODE for every node (the batch node's count), else 0."""
    gpus = {}
    for line in _run(["scontrol", "show", "job", "-d", job_id]).splitlines():
        m = re.search(r"\bNodes=(\S+).*\bGRES=(\S+)", line)
        if not m:
            continue
        n = sum(_count_idx(i) for i in re.findall(r"gpu[^(,]*\(IDX:([0-9,-]+)\)", m.group(2)))
        for node in hostnames(m.group(1)):
            gpus[node] = gpus.get(node, 0) + n
    if not gpus:
        try:
            n = int(os.environ.get("SLURM_GPUS_ON_NODE") or 0)
        except ValueError:
            n = 0
        gpus = dict.fromkeys(nodes, n)
    return [gpus.get(node, 0) for node in nodes]


def node_address(node):
    m = re.search(r"\bNodeAddr=(\S+)", _run(["scontrol", "show", "node", node]))
    return m.group(1) if m else node


class Allocation:
    """The allocation this launcher runs in (read once, at start)."""

    def __init__(self):
        self.job_id = os.environ["SLURM_JOB_ID"]
        self.nodes = hostnames(os.environ.get("SLURM_JOB_NODELIST") or
                               os.environ.get("SLURM_NODELIST") or "")
        if not self.nodes:
            raise RuntimeError("SLURM_JOB_NODELIST names no node")
        tasks = expand_counts(os.environ.get("SLURM_TASKS_PER_NODE") or "")
        self.tasks = tasks if len(tasks) == len(self.nodes) else [None] * len(self.nodes)
        self.gpus = gpus_per_node(self.job_id, self.nodes)
        self.node_of = {}  # the cluster file's address of a node -> its Slurm name

    def describe(self):
        return {"job_id": self.job_id, "nodes": self.nodes, "tasks_per_node": self.tasks,
                "gpus_per_node": self.gpus}


def place(alloc, args):
    """(servers [(host, port)], trainer hosts, each trainer's GPU on its node (None on a
    node without GPUs; trainers beyond the GPUs share them round robin)) for the
    allocation; raises ValueError (usage)."""
    spn, tpn = args.servers_per_node, args.trainers_per_node
    if spn < 0 or (tpn is not None and tpn < 1):
        raise ValueError("--servers-per-node must be >= 0 and --trainers-per-node >= 1")
    base = args.port_base
    if base is None:
        if spn > PORT_SPAN:
            raise ValueError(f"more than {PORT_SPAN} servers per node need --port-base")
        base = 20000 + PORT_SPAN * (int(alloc.job_id) % 800)
    if not 0 < base <= 65535 - spn:
        raise ValueError(f"--port-base {base}: ports out of range")
    servers, trainers, ranks = [], [], []
    for node, gpus in zip(alloc.nodes, alloc.gpus):
        host = node_address(node) if args.node_address == "addr" else node
        alloc.node_of[host] = node
        servers += [(host, base + k) for k in range(spn)]
        n = tpn if tpn is not None else max(gpus, 1)
        trainers += [host] * n
        ranks += [k % gpus if gpus else None for k in range(n)]
    return servers, trainers, ranks


def gpu_argv(argv, local_rank):
    """argv run with the local_rank-th of the node's GPUs only: zps-trainer takes CUDA device
    0, and the step sees every GPU of the job on the node (CUDA_VISIBLE_DEVICES as Slurm set
    it, or all of them when Slurm set none)."""
    script = ('r=$1; shift; if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then '
              'CUDA_VISIBLE_DEVICES=$(echo "$CUDA_VISIBLE_DEVICES" | cut -d, -f$((r + 1))); '
              'else CUDA_VISIBLE_DEVICES=$r; fi; export CUDA_VISIBLE_DEVICES; exec "$@"')
    return ["/bin/sh", "-c", script, "zps-gpu", str(local_rank)] + list(argv)


def wrap(argv, host, args, step):
    """The srun command that runs argv as the one-task step `step` on host."""
    return (shlex.split(args.srun) + ["--overlap", "--nodes=1", "--ntasks=1",
                                      f"--nodelist={host}", f"--job-name={step}"]
            + shlex.split(args.srun_args or "") + list(argv))


def step_ids(job_id):
    """{step name: "JOBID.STEPID"} of the job's running steps ({} when squeue fails)."""
    try:
        out = _run(["squeue", "-s", "-j", job_id, "-h", "-o", "%i %j"])
    except RuntimeError:
        return {}
    return {name: sid for sid, _, name in (ln.partition(" ") for ln in out.splitlines())}


def signaller(job_id):
    """The stop_group hook for this job's steps: the signal goes to the process's step
    through `scancel --signal` (so srun never sees a SIGTERM). True when that is all to do;
    False (the caller signals srun's group too) for SIGKILL, which must end srun whatever
    the step does, and while srun has no step yet (still starting: nothing to lose)."""
    cache = {"at": 0.0, "ids": {}}

    def lookup(name, fresh):
        # one squeue answers for every process stopped together (stop_all signals them all
        # at once); asked again for a name it lacks, a stale answer, or a retry
        if fresh or name not in cache["ids"] or time.monotonic() - cache["at"] > 1.0:
            cache["at"], cache["ids"] = time.monotonic(), step_ids(job_id)
        return cache["ids"].get(name)

    def signal_step(p, sig):
        for fresh in (False, True):  # a cached id may be a restarted process's old step
            sid = lookup(p.step, fresh)
            if sid is None:
                return False
            try:
                _run(["scancel", "--quiet", f"--signal={signal.Signals(sig).name[3:]}", sid])
            except RuntimeError:
                continue
            return sig != signal.SIGKILL
        return False
    return signal_step


def ending(job_id):
    """The job's state when Slurm is ending it (CANCELLED, TIMEOUT, COMPLETING, ...), None
    while it runs or when squeue cannot say."""
    try:
        state = _run(["squeue", "-h", "-j", job_id, "-o", "%T"]).strip()
    except RuntimeError:
        return None
    return state if state and state not in ("RUNNING", "CONFIGURING") else None


def attach(sup, alloc, say):
    """Wires the slurm stops and the job-end check into the supervisor; what summary.json
    says about the allocation."""
    job_id = os.environ["SLURM_JOB_ID"]
    hook = signaller(job_id)
    for p in sup.procs:
        p.signaller = hook
    sup.ending = lambda: ending(job_id)
    info = alloc.describe() if alloc else {"job_id": job_id}
    if alloc:
        say(f"Slurm job {job_id}: nodes {' '.join(alloc.nodes)}, tasks per node "
            f"{alloc.tasks}, GPUs per node {alloc.gpus}")
    return info
