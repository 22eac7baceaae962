#!/usr/bin/python3
"""inception_ref.py - PyTorch reference for zps's Inception-v3 (tests/test_nn_inception.c).

Loads a zps weights file (format in docs/kernels.md) into torchvision's Inception3 by name,
runs one training-mode forward and backward several times and writes, for each, raw
little-endian float64 values: the loss, the logits (n x classes), the gradient of every
trainable variable in the file's order, the batchnorm running statistics after the step in
the file's order.
    PREFIX.f64   in float64 on the batch: the truth the test measures errors against
    PREFIX.f32   in float32 on the batch: how far float32 arithmetic alone moves each tensor
    PREFIX.pertK in float32 on the batch times (1 + p_K * u_K), u_K uniform in [-1, 1] (its
                 own draw for each K), p_K the K-th value of --perturb (comma-separated):
                 how far input noise of float32's size moves each tensor
Loss = CE(logits) + aux_weight * CE(aux_logits) when the aux head is on. Dropout is off.
Runs under Debian's /usr/bin/python3 (python3-torch, python3-torchvision).
"""
import argparse
import struct
import sys

import numpy as np
import torch
import torchvision


def read_weights(path):
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"ZPSWGT01":
        sys.exit(f"{path}: not a zps weights file")
    version, nvars, nstats = struct.unpack_from("<III", data, 8)
    if version != 1:
        sys.exit(f"{path}: version {version}")
    pos = 20
    tables = []
    for count in (nvars, nstats):
        table = []
        for _ in range(count):
            (ln,) = struct.unpack_from("<H", data, pos)
            pos += 2
            name = data[pos:pos + ln].decode()
            pos += ln
            (ndim,) = struct.unpack_from("<I", data, pos)
            pos += 4
            shape = struct.unpack_from("<" + "I" * ndim, data, pos)
            pos += 4 * ndim
            (cnt,) = struct.unpack_from("<Q", data, pos)
            pos += 8
            table.append((name, tuple(shape), cnt))
        tables.append(table)
    values = np.frombuffer(data, dtype="<f4", offset=pos)
    return tables[0], tables[1], values


def make_runs(x, perturb):
    """(input, file suffix, dtype) of each run: float64 and float32 on x, then float32 on x
    perturbed by each relative size in perturb (comma-separated), one noise draw each."""
    rng = np.random.default_rng(12345)
    runs = [(x, "f64", torch.float64), (x, "f32", torch.float32)]
    for k, p in enumerate(float(v) for v in perturb.split(",")):
        x_pert = (x * (1 + p * rng.uniform(-1, 1, size=x.shape))).astype(np.float32)
        runs.append((x_pert, f"pert{k}", torch.float32))
    return runs


def load_state(model, params, stats, values):
    """The file's variables and statistics into model's state_dict, by name and shape."""
    sd = model.state_dict()
    off = 0
    for name, shape, cnt in params + stats:
        if name not in sd:
            sys.exit(f"the reference has no variable {name}")
        if tuple(sd[name].shape) != shape:
            sys.exit(f"{name}: reference {tuple(sd[name].shape)}, file {shape}")
        sd[name].copy_(torch.from_numpy(values[off:off + cnt].reshape(shape).copy()))
        off += cnt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--labels", required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--channels", type=int, default=3)
    ap.add_argument("--classes", type=int, required=True)
    ap.add_argument("--aux", type=int, required=True)
    ap.add_argument("--aux-weight", type=float, default=0.4)
    ap.add_argument("--perturb", default="1e-6", help="comma-separated relative sizes")
    ap.add_argument("--out", required=True, help="output prefix")
    a = ap.parse_args()
    torch.set_num_threads(2)
    params, stats, values = read_weights(a.weights)
    n, s = a.batch, a.size
    x = np.fromfile(a.input, dtype="<f4").reshape(n, a.channels, s, s)
    y = torch.from_numpy(np.fromfile(a.labels, dtype="<i4").astype(np.int64))
    for xin, suffix, dtype in make_runs(x, a.perturb):
        model = torchvision.models.inception_v3(weights=None, aux_logits=bool(a.aux),
                                                init_weights=False, num_classes=a.classes,
                                                transform_input=False, dropout=0.0)
        if a.channels != 3:
            old = model.Conv2d_1a_3x3.conv
            model.Conv2d_1a_3x3.conv = torch.nn.Conv2d(a.channels, old.out_channels, 3, stride=2,
                                                       bias=False)
        load_state(model, params, stats, values)
        model = model.to(dtype)
        model.train()
        xt = torch.from_numpy(xin).to(dtype)
        out = model(xt)
        if a.aux:
            logits, aux = out.logits, out.aux_logits
            loss = (torch.nn.functional.cross_entropy(logits, y) +
                    a.aux_weight * torch.nn.functional.cross_entropy(aux, y))
        else:
            logits = out.logits if hasattr(out, "logits") else out
            loss = torch.nn.functional.cross_entropy(logits, y)
        loss.backward()
        named = dict(model.named_parameters())
        sd = model.state_dict()
        parts = [np.array([loss.item()]), logits.detach().double().numpy().ravel()]
        for name, _, _ in params:
            parts.append(named[name].grad.detach().double().numpy().ravel())
        for name, _, _ in stats:
            parts.append(sd[name].detach().double().numpy().ravel())
        np.concatenate(parts).astype("<f8").tofile(f"{a.out}.{suffix}")


if __name__ == "__main__":
    main()
