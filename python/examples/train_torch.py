#!/usr/bin/env python3
"""train_torch.py — a torchvision ResNet-18 trained on the Fashion-MNIST LMDB shards against a
zps fleet (docs/training.md "PyTorch trainers"). One process is one trainer; zps-launch
starts the fleet:

    scripts/zps-launch --servers 2 --trainers 2 --server-args '--mode sync' \\
      --trainer-cmd '/usr/bin/python3 python/examples/train_torch.py --cluster {cluster}
                     --trainer-id {index} --trainers {n_trainers}' \\
      --trainer-args '--data data/fashion-mnist --mode sync --steps 200' -x ZPS_LIB

The shards (zps-data convert fashion-mnist) are read with the `lmdb` package; each record, a
packed zps.Example (proto/example.proto), is parsed by hand here (fields 1-6 and 8 of the
protobuf wire format: a dozen lines, no generated code or protobuf package needed) and its
CRC checked as docs/datasets.md says. Trainer i of N takes every N-th image of a shuffled
order (the same order in every trainer); the training loop is an ordinary PyTorch one with the
three zps.torch lines. Trainer 0 reports the test accuracy at the end.
"""
import argparse
import glob
import os
import struct
import sys
import time
import zlib

import numpy as np
import torch
import torch.nn.functional as F
import torchvision

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import lmdb  # noqa: E402
import zps.torch  # noqa: E402


def varint(buf, i):
    v = shift = 0
    while True:
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return v, i


def parse_example(buf):
    """(image bytes, height, width, channels, label) of a raw-encoded zps.Example."""
    f = {1: b"", 2: 0, 3: 0, 4: 0, 5: 0, 6: 0, 8: None}
    i = 0
    while i < len(buf):
        key, i = varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            f[field], i = varint(buf, i)
        elif wire == 2:
            n, i = varint(buf, i)
            f[field], i = buf[i:i + n], i + n
        elif wire == 5:
            f[field], i = struct.unpack_from("<I", buf, i)[0], i + 4
        else:
            raise ValueError("wire type %d in an Example" % wire)
    label = f[6] - (1 << 64) if f[6] >= 1 << 63 else f[6]  # int32 -1 travels as 10 bytes
    crc = zlib.crc32(struct.pack("<IIIIi", f[2], f[3], f[4], f[5], label), zlib.crc32(f[1]))
    if f[2] != 0 or f[8] != (crc or 1):
        raise ValueError("not a raw record, or a bad CRC")
    return f[1], f[3], f[4], f[5], label


def load_split(path):
    """(images uint8 (n, h, w), labels int64 (n,)) of every shard of a split, in key order."""
    images, labels = [], []
    for shard in sorted(glob.glob(os.path.join(path, "*-of-*"))):
        env = lmdb.open(shard, readonly=True, lock=False, subdir=True)
        with env.begin() as txn:
            for _, value in txn.cursor():
                img, h, w, c, label = parse_example(bytes(value))
                images.append(np.frombuffer(img, np.uint8).reshape(h, w, c)[..., 0])
                labels.append(label)
        env.close()
    if not images:
        raise SystemExit("no shards under %s (zps-data convert fashion-mnist --out DIR)" % path)
    return np.stack(images), np.asarray(labels, np.int64)


def servers_of(cluster):
    uris = []
    for line in open(cluster):
        line = line.split("#")[0].strip()
        if line.startswith("server") and "=" in line:
            uris.append("tcp://" + line.split("=", 1)[1].strip())
    return uris


def to_input(images):
    x = torch.from_numpy(images).float().div_(255).sub_(0.2860).div_(0.3530)
    return x.unsqueeze(1).expand(-1, 3, -1, -1).contiguous()  # gray -> the model's 3 planes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cluster", help="zps-launch's cluster file (servers)")
    ap.add_argument("--servers", help="comma-separated tcp://HOST:PORT (instead of --cluster)")
    ap.add_argument("--trainer-id", type=int, default=0)
    ap.add_argument("--trainers", type=int, default=1)
    ap.add_argument("--data", default="data/fashion-mnist")
    ap.add_argument("--mode", default="sync", choices=["sync", "async", "ssp"])
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32, help="per trainer")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--push-dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--test-images", type=int, default=2000)
    ap.add_argument("--curve-server-key")
    ap.add_argument("--curve-key")
    a = ap.parse_args()
    torch.set_num_threads(1)
    uris = a.servers.split(",") if a.servers else servers_of(a.cluster)
    t0 = time.time()
    xs, ys = load_split(os.path.join(a.data, "train"))
    print("trainer %d: %d training images from %s in %.1f s" % (a.trainer_id, len(ys), a.data,
                                                              time.time() - t0), flush=True)
    torch.manual_seed(0)  # every trainer offers the same initial model
    model = torchvision.models.resnet18(num_classes=10)
    ps = zps.torch.ParameterServer(model, uris, trainer_id=a.trainer_id,
                                   num_trainers=a.trainers, mode=a.mode,
                                   staleness=a.staleness if a.mode == "ssp" else 0,
                                   optimizer="momentum", lr=a.lr, momentum=0.9,
                                   push_dtype=a.push_dtype,
                                   client_options={"curve_server_key": a.curve_server_key,
                                                   "curve_key": a.curve_key}
                                   if a.curve_key else None)
    print("trainer %d: %s; %d parameters in %d tensors; %s" % (
        a.trainer_id, ps.job, sum(p.numel() for p in ps.params), len(ps.params),
        "initialised the servers" if ps.initialised else "joined"), flush=True)
    order = np.random.default_rng(1).permutation(len(ys))[a.trainer_id::a.trainers]
    model.train()
    t0 = time.time()
    for s in range(a.steps):
        idx = order[(s * a.batch) % len(order):][:a.batch]
        loss = F.cross_entropy(model(to_input(xs[idx])), torch.from_numpy(ys[idx]))
        loss.backward()
        ps.step()
        if s % 20 == 0 or s == a.steps - 1:
            print("trainer %d: step %d loss %.4f version %d (%.2f s/step)" % (
                a.trainer_id, s, loss.item(), ps.version, (time.time() - t0) / (s + 1)),
                flush=True)
    ps.close()
    if a.trainer_id == 0:
        xt, yt = load_split(os.path.join(a.data, "test"))
        xt, yt = xt[:a.test_images], yt[:a.test_images]
        model.eval()
        with torch.no_grad():
            pred = torch.cat([model(to_input(xt[i:i + 500])).argmax(1)
                              for i in range(0, len(yt), 500)])
        print("trainer 0: test accuracy %.4f on %d images after %d steps" % (
            (pred.numpy() == yt).mean(), len(yt), a.steps), flush=True)


if __name__ == "__main__":
    main()
