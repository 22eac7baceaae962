# sync_vs_allreduce.py — the driver of scripts/bench.d/sync-vs-allreduce.sh: zps's sync PS
# fleet (2 servers, 2 trainers) against its own --mode allreduce (the same 2 trainers), on the
# same model, data, batch (32 per trainer), momentum SGD and fixed step counts, in alternating
# runs (sync, allreduce, sync, allreduce, ...). The fleets are started by peers.py's Bench.zps
# (scripts/zps-launch), and each run's figure is its steady img/s (peers.py zps_steady_rate:
# the steps after the warm-up). Per model: the median of the paired ratios sync / allreduce,
# with the machine's 1-minute load before and after every run, and the fleet's CPU time per step
# (all its processes: what the load does not move). Python 3 standard library.
#
#   python3 sync_vs_allreduce.py --bin-dir build/bin --data DIR --out build/bench/sync_vs_allreduce.json
#       [--pairs 3] [--models convnet,inception_v3] [--scale 3]
#
# Exit 1 when a run failed (the JSON and the table still show what exists).
import argparse
import json
import os
import resource
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402  (the fleet launcher and the steady-rate reader)


def timed_cpu(b, mode, model):
    """peers.timed, plus the CPU seconds of the whole fleet (servers, trainers, their threads,
    the launcher; reaped children) per step of one trainer: a figure the machine's load
    barely moves, unlike img/s."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    rec = peers.timed(b.zps, mode, model)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    m = b.margs(model)
    rec.update({"cpu_s": round(cpu, 2),
                "cpu_ms_per_step": round(1000 * cpu / (m["warmup"] + m["steps"]), 2)})
    return rec


def run_model(b, model, pairs):
    runs = {"sync": [], "allreduce": []}
    for i in range(pairs):
        for mode in ("sync", "allreduce"):
            print(f"sync-vs-allreduce: {model} pair {i + 1}/{pairs}: {mode} ...", flush=True)
            runs[mode].append(timed_cpu(b, mode, model))
    ratios = [s["img_s"] / a["img_s"] for s, a in zip(runs["sync"], runs["allreduce"])
              if s.get("img_s") and a.get("img_s")]
    return {"model": model, "settings": b.margs(model),
            "sync": {"runs": runs["sync"], "median": peers.med(r["img_s"] for r in runs["sync"])},
            "allreduce": {"runs": runs["allreduce"],
                          "median": peers.med(r["img_s"] for r in runs["allreduce"])},
            "ratios": ratios, "ratio_median": peers.med(ratios),
            "cpu_ms_per_step": {k: peers.med(r["cpu_ms_per_step"] for r in runs[k]) for k in runs},
            "load": [max(r["load_before"], r["load_after"])
                     for r in runs["sync"] + runs["allreduce"]]}


def table(res):
    fmt = peers.fmt
    lines = ["| model | sync PS img/s | allreduce img/s | sync / allreduce (median of pairs) "
             "| pair ratios | fleet CPU ms per step, sync / allreduce | load (1-min, max) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for m in res:
        lines.append(f"| {m['model']} | {fmt(m['sync']['median'])} | "
                     f"{fmt(m['allreduce']['median'])} | {fmt(m['ratio_median'], 3)} | "
                     f"{' '.join(f'{r:.3f}' for r in m['ratios'])} | "
                     f"{fmt(m['cpu_ms_per_step']['sync'], 1)} / "
                     f"{fmt(m['cpu_ms_per_step']['allreduce'], 1)} | "
                     f"{fmt(max(m['load']) if m['load'] else None, 1)} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description="zps sync PS against zps all-reduce")
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work-dir", required=True, help="logs and run folders")
    ap.add_argument("--pairs", type=int, default=int(os.environ.get("SYNC_AR_PAIRS", "3")))
    ap.add_argument("--scale", type=float, default=float(os.environ.get("SYNC_AR_SCALE", "3")),
                    help="multiplies peers.py's steady steps (SYNC_AR_SCALE, default 3: "
                    "600 convnet, 120 Inception)")
    ap.add_argument("--models", default=os.environ.get("SYNC_AR_MODELS", "convnet,inception_v3"))
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    b = peers.Bench(a)
    t0 = time.time()
    try:
        res = [run_model(b, m, a.pairs) for m in a.models.split(",") if m]
    finally:
        peers.stop(peers.LIVE)
    out = {"cores": os.cpu_count(), "pairs": a.pairs, "wall_s": round(time.time() - t0, 1),
           "batch_per_trainer": peers.BATCH, "trainers": peers.WORKERS, "servers": 2,
           "repo_git_hash": peers.git_head(), "models": res}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(table(res))
    print(f"sync-vs-allreduce: wrote {a.out} ({out['wall_s']:.0f} s)")
    failed = [m["model"] for m in res
              if None in [r["img_s"] for r in m["sync"]["runs"] + m["allreduce"]["runs"]]]
    if failed:
        print(f"sync-vs-allreduce: runs failed for {', '.join(failed)} (logs in {a.work_dir})",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
