#!/usr/bin/python3
"""optim_step.py - the peer of `zps-bench optim`: one PyTorch optimizer step on the CPU.

Runs under Debian's /usr/bin/python3 (python3-torch). For each optimizer in --kinds and each
size in --sizes (float32 elements), builds one parameter tensor with a gradient and times
--reps calls of optimizer.step() after --warmup untimed ones, on --threads intra-op threads.
The hyperparameters are those zps-bench gives zps (lr 0.01, weight decay 1e-4, momentum 0.9,
rmsprop decay 0.9 and eps 1.0 (Inception-v3's recipe), adam betas 0.9 / 0.999 and eps 1e-8,
adagrad initial accumulator 0.1). torch's rmsprop puts eps outside the square root and
applies lr to the momentum's update, zps's (TensorFlow's) inside and before: the same passes
over memory and the same operations per element, in another order. Prints one JSON list:
    [{"kind": K, "floats": N, "median_ms": T, "times_ms": [...]}, ...]
"""
import argparse
import json
import statistics
import time


def make(torch, kind, p):
    o = torch.optim
    if kind == "sgd":
        return o.SGD([p], lr=0.01, weight_decay=1e-4)
    if kind == "momentum":
        return o.SGD([p], lr=0.01, momentum=0.9, weight_decay=1e-4)
    if kind == "rmsprop":
        return o.RMSprop([p], lr=0.01, alpha=0.9, eps=1.0, momentum=0.9, weight_decay=1e-4)
    if kind == "adam":
        return o.Adam([p], lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4)
    if kind == "adagrad":
        return o.Adagrad([p], lr=0.01, initial_accumulator_value=0.1, eps=1e-10,
                         weight_decay=1e-4)
    raise SystemExit(f"optim_step.py: unknown optimizer {kind}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default="sgd,momentum,rmsprop,adam,adagrad")
    ap.add_argument("--sizes", required=True, help="comma-separated float32 counts")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    import torch
    torch.set_num_threads(a.threads)
    out = []
    for kind in a.kinds.split(","):
        for n in (int(s) for s in a.sizes.split(",")):
            p = torch.nn.Parameter(torch.rand(n) - 0.5)
            p.grad = (torch.rand(n) - 0.5) * 0.01
            opt = make(torch, kind, p)
            times = []
            with torch.no_grad():
                for r in range(a.warmup + a.reps):
                    t0 = time.perf_counter()
                    opt.step()
                    if r >= a.warmup:
                        times.append((time.perf_counter() - t0) * 1e3)
            out.append({"kind": kind, "floats": n, "median_ms": statistics.median(times),
                        "times_ms": times})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
