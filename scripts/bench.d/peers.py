# peers.py — the driver of scripts/bench.d/tf-peers: zps's fleets against TensorFlow's
# ParameterServerStrategy and MultiWorkerMirroredStrategy and PyTorch's DDP (gloo), on this
# machine, in alternating runs. Python 3 standard library only (the peers run in their own
# interpreters: peers_tf.py under the TF venv, peers_ddp.py under Debian's torch python).
#
#   python3 peers.py --bin-dir build/bin --data DIR --tf-python PY [--torch-python PY]
#                    [--out build/bench/peers.json]
#   python3 peers.py --steady-rate RUN_DIR WORKERS WARMUP   # zps's figure of one run folder
#
# Comparisons (2 workers each, batch 32 per worker, momentum 0.9 SGD, one thread per process):
#   ps-convnet, ps-inception    zps async PS (2 servers, 2 trainers) vs TF PSS (2 PS, 2 workers,
#                               a coordinator)
#   ar-convnet, ar-inception    zps --mode allreduce (2 trainers) vs TF MWMS (ring)
#   ddp-convnet                 the same zps all-reduce runs vs PyTorch DDP (gloo)
# Each group runs zps, then its peers, PEERS_PAIRS times (default 3). Every side runs
# warm-up + steady steps per worker and reports the fleet's images per second over the steady
# steps only. Writes --out (JSON) and prints the table. Exit 1 when a run failed or when the
# two sides' parameter counts differ.
import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LR = 0.01
MOMENTUM = 0.9
BATCH = 32
WORKERS = 2
# steady steps per worker, warm-up steps per worker (multiples of the TF steps per call)
MODELS = {
    "convnet": {"width": 1.0, "size": 28, "steps": 200, "warmup": 40},
    "inception_v3": {"width": 0.25, "size": 75, "steps": 40, "warmup": 10},
}
TF_STEPS_PER_CALL = 10


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def loadavg():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def child_env(extra=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="passive",
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=HERE, PYTHONDONTWRITEBYTECODE="1")
    env.update(extra or {})
    return env


LIVE = []  # every process group started, so that an interrupted driver can end them


def start(argv, env, log):
    p = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)
    LIVE.append(p)
    return p


def stop(procs):
    """Ends the process groups this driver started (each child leads its own)."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def wait_all(procs, timeout):
    end = time.time() + timeout
    for p in procs:
        try:
            p.wait(max(1, end - time.time()))
        except subprocess.TimeoutExpired:
            stop(procs)
            return False
    return all(p.returncode == 0 for p in procs)


def peers_line(path):
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("PEERS "):
                return json.loads(line[6:])
    return None


def zps_steady_rate(run_dir, workers, warmup):
    """The fleet's steady img/s from the trainers' metrics files (trainer/metrics.h): per
    trainer, the images of the steps after the first `warmup` over the time from the end of
    step `warmup` to the end of the last step; summed over trainers. Also the git hashes."""
    rate, hashes = 0.0, set()
    for i in range(workers):
        with open(os.path.join(run_dir, f"metrics-{i}.jsonl")) as f:
            recs = [json.loads(x) for x in f if x.strip()]
        st = sorted((r for r in recs if r.get("type") == "step"), key=lambda r: r["step"])
        hashes.update(r.get("git_hash") for r in recs if r.get("type") == "start")
        steady = [r for r in st if r["step"] > warmup]
        t0 = next(r["time"] for r in st if r["step"] == warmup)
        rate += sum(r["images"] for r in steady) / (steady[-1]["time"] - t0)
    return rate, hashes


class Bench:
    def __init__(self, a):
        self.a = a
        self.runs = a.work_dir
        os.makedirs(self.runs, exist_ok=True)
        self.n = 0

    def log(self, name):
        self.n += 1
        return os.path.join(self.runs, f"{self.n:02d}-{name}.log")

    def margs(self, model):
        m = MODELS[model]
        s = self.a.scale
        steps = max(TF_STEPS_PER_CALL, int(m["steps"] * s) // TF_STEPS_PER_CALL * TF_STEPS_PER_CALL)
        return {"model": model, "width": m["width"], "size": m["size"], "steps": steps,
                "warmup": m["warmup"], "workers": WORKERS, "lr": LR, "momentum": MOMENTUM,
                "steps_per_call": TF_STEPS_PER_CALL}

    # ---- zps
    def zps(self, mode, model):
        m = self.margs(model)
        run_dir = os.path.join(self.runs, f"{self.n + 1:02d}-zps-{mode}-{model}")
        targs = (f"--data {self.a.data} --mode {mode} --model {model} --batch-size {BATCH} "
                 f"--optimizer momentum --momentum {MOMENTUM} --lr {LR} "
                 f"--steps {m['warmup'] + m['steps']} --eval-batches 1 --threads 1 --no-progress "
                 "--metrics {run_dir}/metrics-{index}.jsonl")
        if model == "inception_v3":
            targs += f" --width {m['width']} --input-size {m['size']}"
        argv = [sys.executable, os.path.join(ROOT, "scripts", "zps-launch"),
                "--servers", "2" if mode != "allreduce" else "0", "--trainers", str(WORKERS),
                "--bin-dir", self.a.bin_dir, "--run-dir", run_dir, "--timeout", "600",
                "--trainer-args", targs]
        with open(self.log(f"zps-{mode}-{model}"), "w") as log:
            ok = wait_all([start(argv, child_env(), log)], 700)
        if not ok:
            return None
        rate, hashes = zps_steady_rate(run_dir, WORKERS, m["warmup"])
        text = open(os.path.join(run_dir, "trainer-0.log"), errors="replace").read()
        mm = re.search(r"(\d+) variables, (\d+) parameters", text)
        return {"img_s": rate, "params": int(mm.group(2)) if mm else None,
                "variables": int(mm.group(1)) if mm else None, "git_hash": min(hashes)}

    # ---- TensorFlow
    def tf_pss(self, model):
        ports = free_ports(2 * WORKERS + 1)
        cluster = {"chief": [f"127.0.0.1:{ports[0]}"],
                   "worker": [f"127.0.0.1:{p}" for p in ports[1:1 + WORKERS]],
                   "ps": [f"127.0.0.1:{p}" for p in ports[1 + WORKERS:]]}
        py = [self.a.tf_python, os.path.join(HERE, "peers_tf.py")]
        servers = []
        with open(self.log(f"tf-pss-{model}"), "w") as log:
            for job in ("ps", "worker"):
                for i in range(len(cluster[job])):
                    tfc = json.dumps({"cluster": cluster, "task": {"type": job, "index": i}})
                    servers.append(start(py + ["pss-server"], child_env({"TF_CONFIG": tfc}), log))
            tfc = json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}})
            coord = start(py + ["pss-coordinator", json.dumps(self.margs(model))],
                          child_env({"TF_CONFIG": tfc}), log)
            ok = wait_all([coord], 600)
            stop(servers)
        return peers_line(log.name) if ok else None

    def tf_mwms(self, model):
        ports = free_ports(WORKERS)
        cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
        py = [self.a.tf_python, os.path.join(HERE, "peers_tf.py"), "mwms-worker",
              json.dumps(self.margs(model))]
        with open(self.log(f"tf-mwms-{model}"), "w") as log:
            procs = [start(py, child_env({"TF_CONFIG": json.dumps(
                {"cluster": cluster, "task": {"type": "worker", "index": i}})}), log)
                for i in range(WORKERS)]
            ok = wait_all(procs, 600)
        return peers_line(log.name) if ok else None

    # ---- PyTorch
    def ddp(self, model):
        port = free_ports(1)[0]
        with open(self.log(f"torch-ddp-{model}"), "w") as log:
            procs = [start([self.a.torch_python, os.path.join(HERE, "peers_ddp.py"), str(r),
                            str(port), json.dumps(self.margs(model))], child_env(), log)
                     for r in range(WORKERS)]
            ok = wait_all(procs, 600)
        return peers_line(log.name) if ok else None


def timed(fn, *args):
    """One run with the machine's 1-minute load average before and after it."""
    l0, t0 = loadavg(), time.time()
    r = fn(*args)
    rec = dict(r or {"img_s": None})
    rec.update({"load_before": l0, "load_after": loadavg(), "wall_s": round(time.time() - t0, 1)})
    return rec


# (group, model, zps mode, [(comparison name, label, peer side)])
GROUPS = [
    ("ps-convnet", "convnet", "async", [("ps-convnet", "async PS (2 servers, 2 trainers) vs "
                                         "TF ParameterServerStrategy, convnet", "tf_pss")]),
    ("ps-inception", "inception_v3", "async", [("ps-inception", "the same, Inception-v3 w0.25 "
                                                "at 75", "tf_pss")]),
    ("ar-convnet", "convnet", "allreduce", [
        ("ar-convnet", "`--mode allreduce` (2 trainers) vs TF MultiWorkerMirroredStrategy "
         "(ring), convnet", "tf_mwms"),
        ("ddp-convnet", "`--mode allreduce` (2 trainers) vs PyTorch DDP (gloo), convnet", "ddp")]),
    ("ar-inception", "inception_v3", "allreduce", [("ar-inception", "the same as ar-convnet, "
                                                    "Inception-v3 w0.25 at 75", "tf_mwms")]),
]


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def run_group(b, g, pairs, out):
    name, model, mode, comps = g
    zr, pr = [], {c[0]: [] for c in comps}
    for i in range(pairs):
        print(f"peers: {name} pair {i + 1}/{pairs}: zps {mode} ...", flush=True)
        zr.append(timed(b.zps, mode, model))
        for cname, _, side in comps:
            if side == "ddp" and not b.a.torch_python:
                continue
            print(f"peers: {name} pair {i + 1}/{pairs}: {side} ...", flush=True)
            pr[cname].append(timed(getattr(b, side), model))
    for cname, label, side in comps:
        runs = pr[cname]
        if not runs:
            print(f"peers: {cname} skipped (no torch python)")
            continue
        ratios = [z["img_s"] / p["img_s"] for z, p in zip(zr, runs)
                  if z.get("img_s") and p.get("img_s")]
        out.append({"name": cname, "comparison": label, "model": model, "zps_mode": mode,
                    "peer": side, "settings": b.margs(model),
                    "zps": {"runs": zr, "img_s": [r["img_s"] for r in zr],
                            "median": med(r["img_s"] for r in zr)},
                    "peer_runs": {"runs": runs, "img_s": [r["img_s"] for r in runs],
                                  "median": med(r["img_s"] for r in runs)},
                    "params": {"zps": zr[0].get("params"), "peer": runs[0].get("params")},
                    "variables": {"zps": zr[0].get("variables"), "peer": runs[0].get("variables")},
                    "ratios": ratios, "ratio_median": med(ratios),
                    "load": [max(r["load_before"], r["load_after"]) for r in zr + runs]})


def git_head():
    """The checkout's commit (zps_git_hash is the one the binaries were built from)."""
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def fmt(x, nd=0):
    return "-" if x is None else f"{x:,.{nd}f}"


def table(comps):
    lines = ["| comparison | zps img/s | peer img/s | zps / peer | params (zps = peer) | "
             "load (1-min, max) |", "| --- | --- | --- | --- | --- | --- |"]
    for c in comps:
        p = c["params"]
        same = "yes" if p["zps"] == p["peer"] and p["zps"] else "NO"
        lines.append(f"| {c['name']}: {c['comparison']} | {fmt(c['zps']['median'])} | "
                     f"{fmt(c['peer_runs']['median'])} | {fmt(c['ratio_median'], 2)} | "
                     f"{fmt(p['zps'])} / {fmt(p['peer'])} {same} | {fmt(max(c['load']), 1)} |")
    return "\n".join(lines)


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--steady-rate":  # RUN_DIR WORKERS WARMUP (tests)
        rate, _ = zps_steady_rate(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        print(json.dumps({"img_s": rate}))
        return 0
    ap = argparse.ArgumentParser(description="zps against TF and PyTorch fleets")
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--tf-python", required=True)
    ap.add_argument("--torch-python", default="")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work-dir", required=True, help="logs and zps run folders")
    ap.add_argument("--pairs", type=int, default=int(os.environ.get("PEERS_PAIRS", "3")))
    ap.add_argument("--scale", type=float, default=float(os.environ.get("PEERS_SCALE", "1")),
                    help="multiplies the steady steps of every run (PEERS_SCALE)")
    ap.add_argument("--only", default=os.environ.get("PEERS_ONLY", ""),
                    help="comma list of groups: ps-convnet,ps-inception,ar-convnet,ar-inception")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run(a)
    finally:
        stop(LIVE)


def run(a):
    b = Bench(a)
    only = set(filter(None, a.only.split(",")))
    comps = []
    t0 = time.time()
    for g in GROUPS:
        if not only or g[0] in only:
            run_group(b, g, a.pairs, comps)
    versions = {"repo_git_hash": git_head(), "zps_git_hash": next((r.get("git_hash") for c in comps for r in c["zps"]["runs"]
                                      if r.get("git_hash")), None)}
    for c in comps:
        for r in c["peer_runs"]["runs"]:
            for k in ("tf", "torch"):
                if r.get(k):
                    versions[k] = r[k]
    res = {"cores": os.cpu_count(), "pairs": a.pairs, "wall_s": round(time.time() - t0, 1),
           "batch_per_worker": BATCH, "workers": WORKERS, "lr": LR, "momentum": MOMENTUM,
           "threads_per_process": 1, "tf_steps_per_call": TF_STEPS_PER_CALL,
           "versions": versions, "comparisons": comps}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(table(comps))
    print(f"peers: {a.out} ({res['wall_s']:.0f} s; versions {versions})")
    bad = [c["name"] for c in comps if c["params"]["zps"] != c["params"]["peer"]
           or not c["params"]["zps"]]
    failed = [c["name"] for c in comps
              if None in c["zps"]["img_s"] or None in c["peer_runs"]["img_s"]]
    if bad:
        print(f"peers: parameter counts differ (or are missing) in: {', '.join(bad)}",
              file=sys.stderr)
    if failed:
        print(f"peers: runs failed in: {', '.join(failed)} (logs in {a.work_dir})",
              file=sys.stderr)
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
