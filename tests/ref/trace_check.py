#!/usr/bin/env python3
"""trace_check.py — validates a zps-trainer --trace file against the Chrome trace-event format
(the JSON Object Format of the "Trace Event Format" document that chrome://tracing and
Perfetto implement) and checks what a zps timeline must show. Exit 1 with the reason.

Format: a top-level object with a "traceEvents" list and "displayTimeUnit" "ms" or "ns";
every event has a string "name", a known "ph", integer "pid" and "tid"; timed events a
non-negative number "ts"; "X" a non-negative "dur"; "M" (metadata) an "args" object with a
string "name"; async "b"/"e" a string "cat" and "id", each "b" closed by exactly one "e" of
the same cat, id and name, not before it. Complete events of one thread nest properly (a
viewer draws them as a stack: two that overlap without one containing the other are a bug).

zps: --steps A,B,..  the "step" spans carry exactly these step numbers (args.n);
     --overlap CAT   some async span of category CAT (push, pull, allreduce) overlaps a
                     "backward" span of the same process: transfers run during backward.
"""
import argparse
import json
import sys

PHASES = {"X", "B", "E", "b", "e", "n", "i", "I", "M", "C"}


class Bad(Exception):
    pass


def num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_event(i, e):
    if not isinstance(e, dict):
        raise Bad(f"event {i} is not an object")
    for k, t in (("name", str), ("ph", str), ("pid", int), ("tid", int)):
        if not isinstance(e.get(k), t) or isinstance(e.get(k), bool):
            raise Bad(f"event {i}: \"{k}\" missing or not {t.__name__}: {e}")
    ph = e["ph"]
    if ph not in PHASES:
        raise Bad(f"event {i}: unknown ph {ph!r}")
    if ph == "M":
        if not isinstance(e.get("args"), dict) or not isinstance(e["args"].get("name"), str):
            raise Bad(f"event {i}: metadata without args.name: {e}")
        return
    if not num(e.get("ts")) or e["ts"] < 0:
        raise Bad(f"event {i}: bad ts: {e}")
    if ph == "X" and (not num(e.get("dur")) or e["dur"] < 0):
        raise Bad(f"event {i}: complete event without a non-negative dur: {e}")
    if ph in "be" and not (isinstance(e.get("cat"), str) and isinstance(e.get("id"), str)):
        raise Bad(f"event {i}: async event without string cat and id: {e}")


def async_spans(events):
    """(pid, cat, name, begin, end) of every b/e pair; raises on unmatched ones."""
    open_, spans = {}, []
    for e in events:
        if e["ph"] not in "be":
            continue
        key = (e["pid"], e["cat"], e["id"], e["name"])
        if e["ph"] == "b":
            if key in open_:
                raise Bad(f"async span {key} begun twice")
            open_[key] = e["ts"]
        else:
            if key not in open_:
                raise Bad(f"async end without a begin: {key}")
            b = open_.pop(key)
            if e["ts"] < b:
                raise Bad(f"async span {key} ends before it begins")
            spans.append((e["pid"], e["cat"], e["name"], b, e["ts"]))
    if open_:
        raise Bad(f"{len(open_)} async spans never end, e.g. {next(iter(open_))}")
    return spans


def check_nesting(events):
    by_thread = {}
    for e in events:
        if e["ph"] == "X":
            by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    eps = 1e-3  # the file's microseconds have 3 decimals
    for key, xs in by_thread.items():
        xs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in xs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"] + eps:
                stack.pop()
            if stack and e["ts"] + e["dur"] > stack[-1]["ts"] + stack[-1]["dur"] + eps:
                raise Bad(f"thread {key}: {e['name']} at {e['ts']} overlaps "
                          f"{stack[-1]['name']} at {stack[-1]['ts']} without nesting")
            stack.append(e)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--steps")
    ap.add_argument("--overlap")
    a = ap.parse_args()
    try:
        for path in a.files:
            with open(path) as f:
                doc = json.load(f)
            if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
                raise Bad(f"{path}: no traceEvents list")
            if doc.get("displayTimeUnit") not in ("ms", "ns"):
                raise Bad(f"{path}: displayTimeUnit {doc.get('displayTimeUnit')!r}")
            ev = doc["traceEvents"]
            for i, e in enumerate(ev):
                check_event(i, e)
            spans = async_spans(ev)
            check_nesting(ev)
            steps = sorted(e.get("args", {}).get("n") for e in ev
                           if e["ph"] == "X" and e["name"] == "step")
            if a.steps and steps != [int(s) for s in a.steps.split(",")]:
                raise Bad(f"{path}: step spans {steps}, want {a.steps}")
            overlaps = 0
            if a.overlap:
                back = [(e["pid"], e["ts"], e["ts"] + e["dur"]) for e in ev
                        if e["ph"] == "X" and e["name"] == "backward"]
                overlaps = sum(1 for (p, cat, _, b, en) in spans if cat == a.overlap and any(
                    p == bp and b < be and en > bb for bp, bb, be in back))
                if not overlaps:
                    raise Bad(f"{path}: no {a.overlap} span overlaps a backward span "
                              f"({len(spans)} async spans, {len(back)} backward spans)")
            cats = sorted({s[1] for s in spans})
            print(f"trace_check: {path}: {len(ev)} events valid, steps {steps}, async "
                  f"{len(spans)} ({', '.join(cats) or 'none'}), "
                  f"{overlaps} {a.overlap or ''} spans overlapping backward")
    except (OSError, ValueError, Bad) as e:
        print(f"trace_check: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
