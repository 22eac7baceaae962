#!/usr/bin/python3
"""train_step_ref.py - PyTorch's side of `zps-bench train-step` (bench/bench_train_step.c).

Times forward + backward + SGD-momentum step of torchvision's Inception-v3 on the CPU with
torch.set_num_threads(THREADS), training mode, random input, loss = CE + 0.4 * CE(aux) when the
aux head is on. Prints one JSON line: {"size", "batch", "aux", "ips", "step_s": [...]} with
ips = batch / median step time over --steps timed steps after --warmup steps.
Run it with jemalloc preloaded (the benchmark does) as PyTorch is run at its best.
"""
import argparse
import json
import time

import torch
import torchvision


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--aux", type=int, required=True)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = torchvision.models.inception_v3(weights=None, aux_logits=bool(a.aux),
                                            init_weights=False, num_classes=a.classes)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
    x = torch.randn(a.batch, 3, a.size, a.size)
    y = torch.randint(0, a.classes, (a.batch,))
    times = []
    for step in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        out = model(x)
        if a.aux:
            loss = (torch.nn.functional.cross_entropy(out.logits, y) +
                    0.4 * torch.nn.functional.cross_entropy(out.aux_logits, y))
        else:
            logits = out.logits if hasattr(out, "logits") else out
            loss = torch.nn.functional.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        if step >= a.warmup:
            times.append(dt)
    med = sorted(times)[len(times) // 2] if len(times) % 2 else \
        0.5 * (sorted(times)[len(times) // 2 - 1] + sorted(times)[len(times) // 2])
    print(json.dumps({"size": a.size, "batch": a.batch, "aux": a.aux, "ips": a.batch / med,
                      "step_s": times}))


if __name__ == "__main__":
    main()
