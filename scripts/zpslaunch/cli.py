# zpslaunch.cli - the command line, the fleet it describes, and main. The docstring below is
# the usage (--help description and epilog), so it is written for users.
"""zps-launch - start a zps fleet (parameter servers + trainers), watch it, stop it, report.

  zps-launch --servers 2 --trainers 2 [--trainer-args "--mode async ..."]   # this machine
  zps-launch --servers 0 --trainers 2 --trainer-args "--mode allreduce ..."  # no servers
  zps-launch --cluster cluster.txt --launcher ssh|slurm|local [...]          # a cluster file
  zps-launch --launcher slurm [--servers-per-node N] [...]   # in sbatch: the allocation
  zps-launch --version

Every process gets its own process group and its own log in the run folder
(runs/<job>-<timestamp>/ by default): server-<i>.log, trainer-<i>.log. The command lines are
    {bin}/zps-server  --cluster FILE --index I       [--server-args]
    {bin}/zps-trainer --cluster FILE --trainer-id I  [--trainer-args]
(--server-cmd / --trainer-cmd replace the part before the pass-through arguments; {bin} is
--bin-dir, default $ZPS_BIN, else build/bin).
Pass-through arguments and command templates may use {index}, {run_dir}, {cluster}, {job},
{host}, {port}, {n_servers}, {n_trainers}, {bin}, and {restart} (0, or K in the K-th
restart's command). Every server also gets --metrics {run_dir}/server-{index}.metrics.jsonl
(--server-metrics; its K-th restart server-{index}.metrics.restart-K.jsonl).
Every process sees ZPS_RUN_DIR, ZPS_JOB, ZPS_ROLE, ZPS_INDEX and ZPS_RESTART; -x VAR
(this launcher's value) / -x VAR=VALUE adds a variable (repeatable, like mpirun -x).

--curve secures the fleet with CURVE (docs/ps.md "Security"): `zps-server --keygen` writes a
server key pair and one per trainer into RUN/keys/, RUN/keys/allow.txt lists the trainers'
public keys, each bound to its trainer id ("KEY trainer=I"), and the flags are added to
every command (after the template, before the pass-through arguments):
    servers:  --curve-key keys/server.key --curve-allow keys/allow.txt
    trainer I: --curve-server-key keys/server.pub --curve-key keys/trainer-I.key
With ssh or slurm the run folder must be on a file system the hosts share (same path).

Servers start first, then trainers. When every trainer has finished, the servers are stopped
(SIGTERM to their process groups: a server writes its final checkpoint and exits 0; SIGKILL
after --grace seconds) and the launcher exits 0.

Supervision (docs/training.md "Supervision"): a server that dies while trainers run (any
exit, even status 0, or a signal it did not get from us) is restarted with --restore, up
to --restart-servers times (default 3), after a back-off of --restart-backoff seconds
doubled at each restart of that server (0.5, 1, 2, ... capped at 30). With restarts on
every server gets --checkpoint-dir RUN/checkpoints and --checkpoint-every-versions K
(--checkpoint-every-versions, default 50; before --server-args, which win). A trainer that
dies is handled by --on-trainer-exit: restart (default; up to --restart-trainers times,
same back-off), continue (the job goes on without it), stop (the job ends). Exit 2 (usage)
and 126/127 (cannot run) are never restarted. A process whose restarts are used up ends the
job. Every death is an event: what died, when (seconds into the run), how (exit status or
signal) and what was done, printed when it happens and listed after the summary table.
On Ctrl-C / SIGTERM, or when --timeout expires, every process still running is stopped the
same way. Processes are only ever signalled through the process groups this launcher
created, never by name. Exit status: 0 all good, 1 a process failed, 2 usage error, 124
timeout, 130 interrupted. A summary table (role, index, host, pid, status, runtime, log) is
printed at the end and written, with the events, to summary.json in the run folder.
--before-stop CMD runs once every trainer has finished, before the servers are stopped
(e.g. to read the servers' STATS or export the model); a non-zero exit fails the job.

Launchers (docs/training.md says what was tested and how):
  local  run the command here (hosts in the cluster file are ignored)
  ssh    `ssh HOST sh -c 'cd DIR && VAR=... CMD'`: the ZPS_* variables (the launcher's
         own ZPS_* too) and the -x ones travel in the command line, since sshd starts a
         clean environment; one ssh per host first checks every program is there and
         executable (else nothing starts, exit 1); the launcher stops the remote process
         by closing ssh's stdin (a watcher on the remote side SIGTERMs it, SIGKILL after
         --grace; ssh returns its status), and it ends too when the connection does
  slurm  inside an allocation (sbatch/salloc) only; without --cluster the fleet comes from
         the allocation (--servers-per-node, default 1, and --trainers-per-node, default one
         per GPU, else one, on every node); each process is a step
         `srun --overlap --nodes=1 --ntasks=1 --nodelist=NODE --job-name=JOB-ROLE-I CMD`,
         stopped with `scancel --signal=TERM JOBID.STEPID` (srun itself is not signalled)
Python 3 standard library only.
"""
import argparse
import datetime
import os
import shlex
import shutil
import signal
import sys
import threading
import types

from zpslaunch import slurm
from zpslaunch.cluster import hold_free_ports, parse_cluster, write_cluster
from zpslaunch.commands import build_argv, make_curve_keys, substitute
from zpslaunch.env import fleet_env, parse_x, process_env
from zpslaunch.launchers import command
from zpslaunch.proc import EXIT_FAILED, EXIT_OK, EXIT_USAGE, Interrupted, Proc
from zpslaunch.process import stop_all
from zpslaunch.report import write_summary
from zpslaunch.ssh import check_hosts
from zpslaunch.supervise import Supervisor, supervise
from zpslaunch.version import VersionAction


def parser():
    ap = argparse.ArgumentParser(
        prog="zps-launch", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0],
        epilog="\n".join(__doc__.split("\n")[2:]))
    src = ap.add_argument_group("fleet")
    src.add_argument("--cluster", help="cluster file (docs/cluster.md)")
    src.add_argument("--servers", type=int,
                     help="N servers on 127.0.0.1 (no cluster file); 0 for an all-reduce fleet")
    src.add_argument("--trainers", type=int, help="M trainers on 127.0.0.1 (no cluster file)")
    src.add_argument("--job", help="job name (default: the cluster file's, else 'zps')")
    src.add_argument("--gpus", type=int, default=0, metavar="G",
                     help="GPUs per host: the k-th trainer of a host runs on its GPU k mod G "
                          "(CUDA_VISIBLE_DEVICES; one trainer per GPU is --trainers G); "
                          "under Slurm the allocation says (default 0: no placement)")
    ap.add_argument("--launcher", choices=("local", "ssh", "slurm"), default="local")
    ap.add_argument("--bin-dir", default=os.environ.get("ZPS_BIN") or "build/bin",
                    help="where zps-server/zps-trainer are (default $ZPS_BIN, else build/bin)")
    ap.add_argument("--run-dir", help="run folder (default runs/<job>-<timestamp>)")
    ap.add_argument("--runs-root", default="runs", help="parent of the default run folder")
    ap.add_argument("--server-args", default="", help="extra zps-server arguments (one string)")
    ap.add_argument("--trainer-args", default="", help="extra zps-trainer arguments (one string)")
    ap.add_argument("--server-cmd", default="{bin}/zps-server --cluster {cluster} --index {index}",
                    help="server command template (default: %(default)s)")
    ap.add_argument("--trainer-cmd",
                    default="{bin}/zps-trainer --cluster {cluster} --trainer-id {index}",
                    help="trainer command template (default: %(default)s)")
    ap.add_argument("--server-metrics", default="{run_dir}/server-{index}.metrics.jsonl",
                    metavar="TEMPLATE",
                    help="zps-server --metrics FILE for every server (default %(default)s; "
                         "the K-th restart writes FILE's name with .restart-K before the "
                         "extension; '' passes none)")
    ap.add_argument("--curve", action="store_true",
                    help="CURVE authentication and encryption: generate a server key pair and "
                         "one per trainer in RUN/keys (zps-server --keygen) and pass the "
                         "--curve-* flags to every process")
    sup = ap.add_argument_group("supervision")
    sup.add_argument("--restart-servers", type=int, default=3, metavar="N",
                     help="restart a dead server with --restore up to N times (default 3; "
                          "0: a dead server ends the job)")
    sup.add_argument("--on-trainer-exit", choices=("restart", "continue", "stop"),
                     default="restart",
                     help="a trainer that dies: restart it, go on without it, or end the job "
                          "(default restart)")
    sup.add_argument("--restart-trainers", type=int, default=3, metavar="N",
                     help="with --on-trainer-exit restart: at most N restarts per trainer "
                          "(default 3)")
    sup.add_argument("--restart-backoff", type=float, default=0.5, metavar="S",
                     help="wait S seconds before the first restart of a process, doubled "
                          "for each later one, at most 30 (default 0.5)")
    sup.add_argument("--checkpoint-every-versions", type=int, default=50, metavar="K",
                     help="with server restarts on: servers checkpoint into RUN/checkpoints "
                          "every K versions (default 50; 0: pass no checkpoint flags)")
    sup.add_argument("--before-stop", metavar="CMD",
                     help="run CMD (template, sh -c) once the trainers finished, before the "
                          "servers are stopped; non-zero exit fails the job")
    ap.add_argument("--timeout", type=float, default=0, help="stop everything after S seconds")
    ap.add_argument("--grace", type=float, default=10,
                    help="seconds between SIGTERM and SIGKILL when stopping (default 10)")
    ap.add_argument("--follow", action="append", default=[], metavar="ROLE:INDEX",
                    help="copy that process's log to stdout while it runs (e.g. trainer:0)")
    ap.add_argument("-x", action="append", default=[], dest="export", metavar="VAR[=VALUE]",
                    help="give every process VAR with this launcher's value, or VALUE "
                         "(repeatable, like mpirun -x; every launcher; ssh also forwards every "
                         "ZPS_* variable)")
    ap.add_argument("--ssh", default="ssh -o BatchMode=yes", help="ssh command (ssh launcher)")
    ap.add_argument("--remote-dir", help="working directory on remote hosts (default: cwd)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--quiet", action="store_true", help="only the summary table")
    ap.add_argument("--version", action=VersionAction)
    slurm.add_arguments(ap)
    return ap


def fleet_hosts(args):
    """The fleet: servers [(host, port)], trainers [host], gpu (a trainer's GPU on its node,
    or None), job (the cluster file's, or ''), alloc (the Slurm allocation it came from, or
    None). Raises ValueError (usage), RuntimeError (Slurm could not be asked) or OSError
    (no free ports)."""
    from_alloc = args.launcher == "slurm" and not args.cluster
    if args.cluster and (args.servers or args.trainers):
        raise ValueError("give --cluster or --servers/--trainers, not both")
    if from_alloc and (args.servers is not None or args.trainers is not None):
        raise ValueError("--launcher slurm takes the fleet from the allocation: give "
                         "--servers-per-node / --trainers-per-node (or --cluster FILE)")
    if not args.cluster and not from_alloc and (args.servers is None or not args.trainers):
        raise ValueError("give --cluster FILE, or --servers N --trainers M (N >= 0, M >= 1)")
    for name in ("restart_servers", "restart_trainers", "checkpoint_every_versions"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
    if args.restart_backoff < 0:
        raise ValueError("--restart-backoff must be >= 0")
    fleet = types.SimpleNamespace(gpu=None, job="", alloc=None, held=[])
    if args.cluster:
        try:
            fleet.servers, fleet.trainers, fleet.job = parse_cluster(args.cluster)
        except OSError as e:
            raise ValueError(str(e))
    elif from_alloc:
        fleet.alloc = slurm.Allocation()
        fleet.servers, fleet.trainers, fleet.gpu = slurm.place(fleet.alloc, args)
    elif args.launcher != "local":
        raise ValueError(f"--launcher {args.launcher} needs a cluster file naming hosts")
    elif args.servers < 0 or args.trainers < 1:
        raise ValueError("--servers must be >= 0 (0: an all-reduce fleet) and --trainers >= 1")
    else:
        try:
            fleet.held = hold_free_ports(args.servers)
        except OSError as e:
            raise OSError(f"cannot find {args.servers} free ports on 127.0.0.1: {e}")
        fleet.servers = [("127.0.0.1", s.getsockname()[1]) for s in fleet.held]
        fleet.trainers = ["127.0.0.1"] * args.trainers
    if args.gpus < 0:
        raise ValueError("--gpus must be >= 0")
    if args.gpus and fleet.gpu:
        raise ValueError("--gpus: under Slurm the allocation says which GPUs a node has")
    if args.gpus:  # the k-th trainer of each host on GPU k mod G
        seen = {}
        fleet.gpu = []
        for h in fleet.trainers:
            fleet.gpu.append(seen.get(h, 0) % args.gpus)
            seen[h] = seen.get(h, 0) + 1
    fleet.gpu = fleet.gpu or [None] * len(fleet.trainers)
    return fleet


def make_run_dir(args, job):
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = args.run_dir or os.path.join(args.runs_root, f"{job}-{stamp}")
    if not args.run_dir:
        base, k = run_dir, 1
        while os.path.exists(run_dir):
            k += 1
            run_dir = f"{base}.{k}"
    made = not os.path.exists(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    return run_dir, made


def server_metrics(args, values):
    """The --metrics flags of a server's first incarnation and of its restarts (a restart
    must not overwrite the records of the incarnation that died: {restart} becomes K)."""
    if not args.server_metrics:
        return [], []
    root, ext = os.path.splitext(substitute(args.server_metrics, values))
    return ["--metrics", root + ext], ["--metrics", root + ".restart-{restart}" + ext]


def node_servers(args, n_trainers):
    """zps-trainer --node-trainers G in --trainer-args: the servers expect one trainer per node
    (N / G), unless --server-args names a count itself. Raises ValueError when G does not
    divide N."""
    words = shlex.split(args.trainer_args or "")
    g = 1
    for i, w in enumerate(words):
        if w == "--node-trainers" and i + 1 < len(words):
            g = words[i + 1]
        elif w.startswith("--node-trainers="):
            g = w.split("=", 1)[1]
    try:
        g = int(g)
    except ValueError:
        return []  # zps-trainer names the bad value itself
    if g <= 1 or "--num-trainers" in (args.server_args or ""):
        return []
    if n_trainers % g:
        raise ValueError(f"--node-trainers {g} does not divide the fleet's {n_trainers} trainers")
    return ["--num-trainers", str(n_trainers // g)]


def make_procs(args, run_dir, job, fleet, curve, env):
    """The fleet's Procs (servers, then trainers) and the template values; env is the
    fleet's environment (env.fleet_env)."""
    curve_server, curve_trainer = curve
    servers, trainer_hosts = fleet.servers, fleet.trainers
    cluster = os.path.join(run_dir, "cluster.txt")
    write_cluster(cluster, job, servers, trainer_hosts)
    common = {"run_dir": os.path.abspath(run_dir), "cluster": os.path.abspath(cluster),
              "job": job, "n_servers": len(servers), "n_trainers": len(trainer_hosts),
              "bin": os.path.abspath(args.bin_dir)}
    ckpt = []
    if args.restart_servers > 0 and args.checkpoint_every_versions > 0:
        ckpt = ["--checkpoint-dir", os.path.join(common["run_dir"], "checkpoints"),
                "--checkpoint-every-versions", str(args.checkpoint_every_versions)]
    # the launcher runs a process on a node (srun --nodelist wants its Slurm name), the
    # cluster file names its address
    node = (lambda h: fleet.alloc.node_of.get(h, h)) if fleet.alloc else (lambda h: h)
    procs = []
    nodes = node_servers(args, len(trainer_hosts))
    for i, (h, port) in enumerate(servers):
        v = dict(common, index=i, host=h, port=port)
        metrics, again = server_metrics(args, v)
        argv = build_argv(args.server_cmd, args.server_args, v,
                          curve_server + ckpt + metrics + nodes)
        p = Proc("server", i, h, port, argv, os.path.join(run_dir, f"server-{i}.log"))
        p.held = fleet.held[i] if fleet.held else None
        p.own_port = p.held is not None
        p.restart_cmd = build_argv(args.server_cmd, args.server_args, v,
                                   curve_server + ckpt + again + nodes) + ["--restore"]
        procs.append(p)
    for i, h in enumerate(trainer_hosts):
        v = dict(common, index=i, host=h, port="")
        argv = build_argv(args.trainer_cmd, args.trainer_args, v, curve_trainer(i))
        if fleet.gpu[i] is not None:
            argv = slurm.gpu_argv(argv, fleet.gpu[i])
        procs.append(Proc("trainer", i, h, None, argv, os.path.join(run_dir, f"trainer-{i}.log")))
    for p in procs:
        p.pipe_stdin = args.launcher == "ssh"
        p.node, p.step = node(p.host), f"{job}-{p.role}-{p.index}"
        p.argv = command(p, args, process_env(env, p))
    return procs, common


def start_fleet(args):
    """The fleet, its job name, run folder, Procs, template values and environment, or an
    exit code (usage, Slurm, --curve) after printing why."""
    def fail(code, msg):
        print(f"zps-launch: {msg}", file=sys.stderr)
        return code
    if args.launcher == "slurm" and not (args.dry_run and args.cluster):
        why = slurm.check(args)  # before anything is made: outside an allocation, nothing
        if why:
            return fail(EXIT_USAGE, why)
    try:
        fleet = fleet_hosts(args)
        args.x_env = parse_x(args.export, os.environ)
        node_servers(args, len(fleet.trainers))  # --node-trainers must divide the fleet
    except ValueError as e:
        return fail(EXIT_USAGE, e)
    except RuntimeError as e:
        return fail(EXIT_FAILED, f"cannot read the Slurm allocation: {e}")
    except OSError as e:
        return fail(EXIT_FAILED, e)
    job = args.job or fleet.job or "zps"
    if not all(c.isalnum() or c in "_.-" for c in job) or len(job) > 63:
        return fail(EXIT_USAGE, f"bad job name '{job}' ([A-Za-z0-9_.-], up to 63 characters)")
    run_dir, args.run_dir_made = make_run_dir(args, job)
    curve = ([], lambda i: [])
    if args.curve:
        try:
            curve = make_curve_keys(os.path.abspath(run_dir), os.path.abspath(args.bin_dir),
                                    len(fleet.trainers))
        except (OSError, RuntimeError) as e:
            return fail(EXIT_FAILED, f"--curve: {e}")
    env = fleet_env(os.environ, os.path.abspath(run_dir), job, args.x_env)
    procs, common = make_procs(args, run_dir, job, fleet, curve, env)
    return fleet, job, run_dir, procs, common, env


# Options whose value is a command line of its own, so it may begin with "-": argparse would
# take "--trainer-args --eval-all" for two options, so such a value is glued to its option.
STRING_OPTIONS = ("--server-args", "--trainer-args", "--srun-args", "--ssh", "--srun")


def glue_string_options(argv):
    out, i = [], 0
    while i < len(argv):
        if argv[i] in STRING_OPTIONS and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def main(argv=None):
    args = parser().parse_args(glue_string_options(sys.argv[1:] if argv is None else argv))

    def say(msg):
        if not args.quiet:
            print(f"zps-launch: {msg}", flush=True)

    made = start_fleet(args)
    if isinstance(made, int):
        return made
    fleet, job, run_dir, procs, common, env = made
    if args.dry_run:
        for p in procs:
            print(f"{p.role} {p.index} on {p.host}: {shlex.join(p.argv)}")
        return EXIT_OK
    if args.launcher == "ssh":
        problems = check_hosts(procs, args)
        if problems:
            if args.run_dir_made:  # made by this call, holding only what it wrote
                shutil.rmtree(run_dir, ignore_errors=True)
            print("zps-launch: nothing started: the hosts cannot run the fleet:\n  "
                  + "\n  ".join(problems), file=sys.stderr)
            return EXIT_FAILED

    def on_signal(signum, frame):
        raise Interrupted(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)

    say(f"job {job}: {len(fleet.servers)} server(s), {len(fleet.trainers)} trainer(s), "
        f"launcher {args.launcher}, run folder {run_dir}"
        + (", CURVE keys in " + os.path.join(run_dir, "keys") if args.curve else ""))
    if fleet.servers:
        keys = os.path.join(run_dir, "keys")
        ctl = (f" --curve-server-key {keys}/server.pub --curve-key {keys}/ctl.key"
               if args.curve else "")
        say(f"control it with: {args.bin_dir}/zps-ctl stats|checkpoint|shutdown "
            f"--cluster {os.path.join(run_dir, 'cluster.txt')}{ctl}")
    stop_evt = threading.Event()
    sup = Supervisor(procs, args, env, say)
    extra = {"launcher": args.launcher}
    if args.launcher == "slurm":
        extra["slurm"] = slurm.attach(sup, fleet.alloc, say)
    followers = []
    code = supervise(sup, args, common, env, say, followers, stop_evt)
    # stop what is left: trainers first (after a failure), then the servers
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    sup.cancel_restarts()
    stop_all(procs, sup.trainers, args.grace, say)
    stop_all(procs, [p for p in procs if p.role == "server"], args.grace, say)
    stop_evt.set()
    for t in followers:
        t.join(timeout=2)
    if code == EXIT_OK and not all(p.ok() for p in procs):
        code = EXIT_FAILED
    if sup.ended:
        extra["slurm"]["job_state"] = sup.ended
    write_summary(procs, sup.events, job, run_dir, code, extra)
    return code
