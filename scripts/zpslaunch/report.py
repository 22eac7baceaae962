"""zpslaunch.report - the summary table printed at the end and summary.json in the run
folder (processes and events). Tests parse the table's rows, so its columns are stable:
role, index, host, pid, status, runtime, log.
"""
import json
import os
import time

def table(procs, run_dir):
    rows = [("role", "index", "host", "pid", "status", "runtime", "log")]
    for p in procs:
        rt = f"{(p.end or time.monotonic()) - p.start:.1f}s" if p.start else "-"
        rows.append((p.role, str(p.index), p.host, str(p.pid or "-"), p.describe(), rt,
                     os.path.relpath(p.log) if not os.path.isabs(run_dir) else p.log))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows)


def write_summary(procs, events, job, run_dir, code, extra=None):
    summary = [{"role": p.role, "index": p.index, "host": p.host, "pid": p.pid,
                "status": p.describe(), "exit_code": p.exit_code(), "stopped": p.stopped,
                "restarts": p.restarts, "cancelled": p.cancelled,
                "runtime_s": round((p.end or time.monotonic()) - p.start, 3) if p.start else None,
                "log": p.log, "argv": p.argv} for p in procs]
    # whole or absent: written aside, then renamed over (a reader polling for it, or a
    # launcher killed mid-write, never sees half a file)
    path = os.path.join(run_dir, "summary.json")
    with open(path + ".tmp", "w") as f:
        json.dump(dict({"job": job, "run_dir": run_dir, "exit_code": code,
                        "processes": summary, "events": events}, **(extra or {})), f, indent=1)
    os.replace(path + ".tmp", path)
    print(table(procs, run_dir), flush=True)
    if events:
        print("events:")
        for e in events:
            print(f"  {e['t_s']:8.1f} s  {e['role']} {e['index']} pid {e['pid']}: {e['how']}: "
                  f"{e['action']}")
    print(f"zps-launch: {'ok' if code == 0 else 'FAILED'} (exit {code}); run folder {run_dir}",
          flush=True)
