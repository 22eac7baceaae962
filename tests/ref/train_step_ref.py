#!/usr/bin/python3
"""train_step_ref.py - PyTorch's side of `zps-bench train-step` (bench/bench_train_step.c).

Times forward + backward + SGD-momentum step on the CPU with torch.set_num_threads(THREADS),
training mode, random input; with --device cuda on the GPU instead: the batch copied each step
from pinned memory (as a DataLoader with pin_memory feeds it), cuDNN in PyTorch's defaults
(TF32 convolutions allowed, no benchmark search), the step's time taken after
torch.cuda.synchronize(); --precision bf16 runs forward and loss under bf16 autocast. Models:
  inception_v3 at width 1 with 3 channels: torchvision's Inception-v3; loss = CE + 0.4 *
      CE(aux) when the aux head is on;
  inception_v3 at another width or channel count: zps's Inception-v3 (trainer/models/models.c,
      the same blocks as torchvision's; channels scaled by --width, rounded, at least 1; no aux
      head), convolutions without bias, batchnorm eps 0.001, ReLU;
  convnet: zps's convnet (conv3x3 + BN + ReLU + 2x2 max pool twice, dense 128 ReLU, dropout
      0.25, dense CLASSES), as scripts/bench.d/peers_ddp.py builds it.
Prints one JSON line: {"model", "size", "batch", "aux", "params", "ips", "cpu_ips",
"step_s": [...]} with ips = batch / median step time over --steps timed steps after --warmup
steps, cpu_ips the same over the process's CPU time of a step (all threads); params is the
trainable parameter count (the benchmark checks it against zps's).
Run it with jemalloc preloaded (the benchmark does) as PyTorch is run at its best.
"""
import argparse
import contextlib
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def convnet(channels, classes):
    def cbr(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout, eps=1e-3),
                nn.ReLU()]
    return nn.Sequential(*cbr(channels, 32), nn.MaxPool2d(2), *cbr(32, 64), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Dropout(0.25),
                         nn.Linear(128, classes))


class Cbr(nn.Module):
    def __init__(self, cin, cout, r, s=None, stride=1, pad=None):
        super().__init__()
        s = r if s is None else s
        pad = ((r - 1) // 2, (s - 1) // 2) if pad is None else pad
        self.conv = nn.Conv2d(cin, cout, (r, s), stride, pad, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=1e-3)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)), inplace=True)


class Branches(nn.Module):
    """Parallel branches (each a list of modules run in turn; "avg"/"max" are the pools)
    whose outputs are concatenated on channels."""

    def __init__(self, branches):
        super().__init__()
        self.branches = nn.ModuleList(nn.Sequential(*b) for b in branches)

    def forward(self, x):
        return torch.cat([b(x) for b in self.branches], 1)


class Inception(nn.Module):
    """zps's Inception-v3 at a width multiplier (no aux head)."""

    def __init__(self, width, channels, classes):
        super().__init__()
        def ch(c):
            return max(1, int(width * c + 0.5))
        self.cin = channels
        layers = [self._c(ch(32), 3, stride=2, pad=0), self._c(ch(32), 3, pad=0),
                  self._c(ch(64), 3), nn.MaxPool2d(3, 2), self._c(ch(80), 1),
                  self._c(ch(192), 3, pad=0), nn.MaxPool2d(3, 2)]
        for pf in (32, 64, 64):
            layers.append(self._inc_a(ch, ch(pf)))
        layers.append(self._inc_b(ch))
        for c7 in (128, 160, 160, 192):
            layers.append(self._inc_c(ch, ch(c7)))
        layers.append(self._inc_d(ch))
        layers += [self._inc_e(ch), self._inc_e(ch)]
        self.body = nn.Sequential(*layers)
        self.fc = nn.Linear(self.cin, classes)

    def _c(self, k, r, s=None, stride=1, pad=None, cin=None):
        m = Cbr(self.cin if cin is None else cin, k, r, s, stride,
                None if pad is None else (pad, pad))
        if cin is None:
            self.cin = k
        return m

    def _seq(self, cin, spec):
        """A branch: (k, r, s, stride, pad) convolutions one after another from cin."""
        out, c = [], cin
        for k, r, s, stride, pad in spec:
            out.append(self._c(k, r, s, stride, pad, cin=c))
            c = k
        return out, c

    def _block(self, branches, pool=None, pool_out=None):
        cin, mods, cout = self.cin, [], 0
        for spec in branches:
            b, c = self._seq(cin, spec)
            mods.append(b)
            cout += c
        if pool == "avg":
            mods.append([nn.AvgPool2d(3, 1, 1), self._c(pool_out, 1, cin=cin)])
            cout += pool_out
        elif pool == "max":
            mods.append([nn.MaxPool2d(3, 2)])
            cout += cin
        self.cin = cout
        return Branches(mods)

    def _inc_a(self, ch, pf):
        return self._block([[(ch(64), 1, 1, 1, None)],
                            [(ch(48), 1, 1, 1, None), (ch(64), 5, 5, 1, None)],
                            [(ch(64), 1, 1, 1, None), (ch(96), 3, 3, 1, None),
                             (ch(96), 3, 3, 1, None)]], "avg", pf)

    def _inc_b(self, ch):
        return self._block([[(ch(384), 3, 3, 2, 0)],
                            [(ch(64), 1, 1, 1, None), (ch(96), 3, 3, 1, None),
                             (ch(96), 3, 3, 2, 0)]], "max")

    def _inc_c(self, ch, c7):
        return self._block([[(ch(192), 1, 1, 1, None)],
                            [(c7, 1, 1, 1, None), (c7, 1, 7, 1, None), (ch(192), 7, 1, 1, None)],
                            [(c7, 1, 1, 1, None), (c7, 7, 1, 1, None), (c7, 1, 7, 1, None),
                             (c7, 7, 1, 1, None), (ch(192), 1, 7, 1, None)]], "avg", ch(192))

    def _inc_d(self, ch):
        return self._block([[(ch(192), 1, 1, 1, None), (ch(320), 3, 3, 2, 0)],
                            [(ch(192), 1, 1, 1, None), (ch(192), 1, 7, 1, None),
                             (ch(192), 7, 1, 1, None), (ch(192), 3, 3, 2, 0)]], "max")

    def _inc_e(self, ch):
        return IncE(self, ch)

    def forward(self, x):
        x = self.body(x)
        x = torch.mean(x, (2, 3))
        return self.fc(F.dropout(x, 0.5, self.training))


class IncE(nn.Module):
    """Inception-E: its 3x3 branches split in two (1x3 and 3x1) and join again."""

    def __init__(self, net, ch):
        super().__init__()
        cin = net.cin
        c = net._c
        self.b1 = c(ch(320), 1, cin=cin)
        self.b3 = c(ch(384), 1, cin=cin)
        self.b3a, self.b3b = c(ch(384), 1, 3, cin=ch(384)), c(ch(384), 3, 1, cin=ch(384))
        self.d1 = c(ch(448), 1, cin=cin)
        self.d2 = c(ch(384), 3, cin=ch(448))
        self.da, self.db = c(ch(384), 1, 3, cin=ch(384)), c(ch(384), 3, 1, cin=ch(384))
        self.pool = c(ch(192), 1, cin=cin)
        net.cin = ch(320) + 4 * ch(384) + ch(192)

    def forward(self, x):
        b3, d = self.b3(x), self.d2(self.d1(x))
        return torch.cat([self.b1(x), self.b3a(b3), self.b3b(b3), self.da(d), self.db(d),
                          self.pool(F.avg_pool2d(x, 3, 1, 1))], 1)


def build(a):
    if a.model == "convnet":
        return convnet(a.channels, a.classes)
    if a.width == 1 and a.channels == 3:
        import torchvision
        return torchvision.models.inception_v3(weights=None, aux_logits=bool(a.aux),
                                               init_weights=False, num_classes=a.classes)
    return Inception(a.width, a.channels, a.classes)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="inception_v3", choices=("inception_v3", "convnet"))
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--aux", type=int, required=True)
    ap.add_argument("--width", type=float, default=1.0)
    ap.add_argument("--channels", type=int, default=3)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--precision", default="f32", choices=("f32", "bf16"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.threads == 1:
        torch.set_num_interop_threads(1)
    torch.manual_seed(0)
    cuda = a.device == "cuda"
    dev = torch.device(a.device)
    model = build(a).to(dev)
    model.train()
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
    x_host = torch.randn(a.batch, a.channels, a.size, a.size)
    if cuda:
        x_host = x_host.pin_memory()
    y = torch.randint(0, a.classes, (a.batch,)).to(dev)
    autocast = (torch.autocast(a.device, dtype=torch.bfloat16) if a.precision == "bf16"
                else contextlib.nullcontext())
    times, cpu = [], []
    for step in range(a.warmup + a.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        x = x_host.to(dev, non_blocking=True)
        opt.zero_grad(set_to_none=False)
        with autocast:
            out = model(x)
            if a.aux and hasattr(out, "aux_logits"):
                loss = (F.cross_entropy(out.logits, y) + 0.4 * F.cross_entropy(out.aux_logits, y))
            else:
                logits = out.logits if hasattr(out, "logits") else out
                loss = F.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if step >= a.warmup:
            times.append(dt)
            cpu.append(dc)
    print(json.dumps({"model": a.model, "size": a.size, "batch": a.batch, "aux": a.aux,
                      "device": a.device, "precision": a.precision,
                      "params": params, "ips": a.batch / median(times),
                      "cpu_ips": a.batch / median(cpu), "step_s": times}))


def median(v):
    s = sorted(v)
    return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])


if __name__ == "__main__":
    main()
