#!/usr/bin/python3
"""ssd_ref.py - PyTorch reference for zps's ssd detector model (tests/test_nn_ssd.c).

Builds the ssd network of trainer/models/ssd.h from a zps weights file: every convolution's
shape comes from the file (so any width multiplier works), strides and paddings are the
architecture's. Runs one training-mode forward, takes the class and offset outputs in the
prior order (maps in order, cells row-major, the A priors of a cell), and backpropagates
L = sum(cls * g_cls) + sum(loc * g_loc) for the fixed external gradients the C test wrote:
exactly what zps's injection of external gradients computes. Writes raw little-endian float64,
one file per run:
    L, cls (n x P x (C+1)), loc (n x P x 4), the gradient of every trainable variable in the
    file's order, the batchnorm running statistics after the step in the file's order, and
    dL/dx (n x c x s x s)
    PREFIX.f64 / .f32 / .pertK: as tests/ref/inception_ref.py (truth, float32, float32 on a
    perturbed input).
    PREFIX.kinks: one line per layer (BasicConv2d) whose ReLU input has an element so close to
    0 that float32's rounding could flip its mask, and whose flip alone would move the layer's
    bias gradient past the test's bound (see kinks()); empty for a draw the test can judge.
Runs under Debian's /usr/bin/python3 (python3-torch, python3-torchvision).
"""
import argparse

import numpy as np
import torch
import torch.nn.functional as F
from torchvision.models.inception import BasicConv2d

from inception_ref import load_state, make_runs, read_weights


class Net(torch.nn.Module):
    """Modules named as zps names its variables; shapes taken from the weights table."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes = shapes
        stem = [("Conv2d_1a_3x3", 2, 1), ("Conv2d_2a_3x3", 1, 1), ("Conv2d_3b_1x1", 1, 0),
                ("Conv2d_4a_3x3", 1, 1)]
        for name, stride, pad in stem:
            setattr(self, name, self.bc(name, stride, pad))
        for name in ("Mixed_5b", "Mixed_5c", "Mixed_6b"):
            setattr(self, name, self.block_a(name))
        self.Mixed_6a = self.block_b("Mixed_6a")
        self.extra = torch.nn.ModuleList(
            torch.nn.Sequential(self.bc(f"extra.{k}.0", 1, 0), self.bc(f"extra.{k}.1", 2, 1))
            for k in range(3))
        self.head = torch.nn.Module()
        for kind in ("classification", "regression"):
            heads = torch.nn.Module()
            heads.module_list = torch.nn.ModuleList(
                torch.nn.Conv2d(*self.conv_shape(f"head.{kind}_head.module_list.{k}.weight"),
                                padding=1) for k in range(5))
            setattr(self.head, f"{kind}_head", heads)

    def conv_shape(self, var):
        k, c, r, _ = self.shapes[var]
        return c, k, r

    def bc(self, name, stride, pad):
        c, k, r = self.conv_shape(name + ".conv.weight")
        return BasicConv2d(c, k, kernel_size=r, stride=stride, padding=pad)

    def block_a(self, name):
        b = torch.nn.Module()
        for br, pad in (("branch1x1", 0), ("branch5x5_1", 0), ("branch5x5_2", 2),
                        ("branch3x3dbl_1", 0), ("branch3x3dbl_2", 1), ("branch3x3dbl_3", 1),
                        ("branch_pool", 0)):
            setattr(b, br, self.bc(f"{name}.{br}", 1, pad))
        return b

    def block_b(self, name):
        b = torch.nn.Module()
        for br, stride, pad in (("branch3x3", 2, 1), ("branch3x3dbl_1", 1, 0),
                                ("branch3x3dbl_2", 1, 1), ("branch3x3dbl_3", 2, 1)):
            setattr(b, br, self.bc(f"{name}.{br}", stride, pad))
        return b

    @staticmethod
    def run_a(b, x):
        b5 = b.branch5x5_2(b.branch5x5_1(x))
        b3 = b.branch3x3dbl_3(b.branch3x3dbl_2(b.branch3x3dbl_1(x)))
        bp = b.branch_pool(F.avg_pool2d(x, 3, 1, 1))  # count_include_pad=True
        return torch.cat([b.branch1x1(x), b5, b3, bp], 1)

    @staticmethod
    def run_b(b, x):
        bd = b.branch3x3dbl_3(b.branch3x3dbl_2(b.branch3x3dbl_1(x)))
        return torch.cat([b.branch3x3(x), bd, F.max_pool2d(x, 3, 2, 1)], 1)

    def forward(self, x):
        x = self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x))
        x = F.max_pool2d(x, 3, 2, 1)
        x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x))
        x = F.max_pool2d(x, 3, 2, 1)
        maps = [self.run_a(self.Mixed_5c, self.run_a(self.Mixed_5b, x))]
        maps.append(self.run_a(self.Mixed_6b, self.run_b(self.Mixed_6a, maps[0])))
        for e in self.extra:
            maps.append(e(maps[-1]))
        n = x.shape[0]
        outs = []
        for heads in (self.head.classification_head, self.head.regression_head):
            rows = []
            for k, (conv, fm) in enumerate(zip(heads.module_list, maps)):
                priors = self.shapes[f"head.regression_head.module_list.{k}.weight"][0] // 4
                y = conv(fm)  # channel a * D + j: value j of the cell's prior a
                rows.append(y.permute(0, 2, 3, 1).reshape(n, -1, y.shape[1] // priors))
            outs.append(torch.cat(rows, 1))
        return outs


class KinkWatch:
    """Every BasicConv2d's ReLU input (its batchnorm's output, before the in-place ReLU) and
    the gradient arriving at its output, from one run."""

    def __init__(self, model):
        self.pre, self.grad = {}, {}
        for name, mod in model.named_modules():
            if isinstance(mod, BasicConv2d):
                mod.bn.register_forward_hook(self._pre_hook(name))
                mod.register_forward_hook(self._out_hook(name))

    def _pre_hook(self, name):
        def hook(_mod, _inp, out):
            self.pre[name] = out.detach().clone()
        return hook

    def _out_hook(self, name):
        def hook(_mod, _inp, out):
            def keep(g):
                self.grad[name] = g.detach().clone()
            out.register_hook(keep)
        return hook


def rel(a, ref):
    return float((a - ref).norm() / (ref.norm() + 1e-30))


def kinks(w64, w32, biases):
    """Layers where a ReLU mask flip would decide the test: ReLU inputs within 4x PyTorch's
    own float32 error of 0 (the layer's root mean square; zps's is 1 to 2 times that) whose
    gradients, were those masks flipped, would move the layer's bias gradient by more than
    half its bound (1e-3 + 4 x the float32 runs' deviation, as the test computes it). The
    perturbed runs flip masks of their own, which widens the bounds where flips are many; one
    flip in a small layer (extra.*: a few cells per channel) that they happen to miss would
    fail zps alone, on a difference of float32 rounding, not of arithmetic."""
    out = []
    for name, x64 in w64.pre.items():
        rms = float((w32.pre[name].double() - x64).pow(2).mean().sqrt())
        near = x64.abs() < 4 * rms
        if not bool(near.any()):
            continue
        db = biases[0][name]
        impact = float(w64.grad[name][near].norm()) / (float(db.norm()) + 1e-30)
        bound = 1e-3 + 4 * max(rel(b[name], db) for b in biases[1:])
        if impact > bound / 2:
            out.append(f"{name} {int(near.sum())} {impact:.3g} {bound:.3g}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", required=True)
    ap.add_argument("--input", required=True, help="n x c x s x s float32")
    ap.add_argument("--grads", required=True, help="g_cls then g_loc, float32")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--perturb", default="1e-6", help="comma-separated relative sizes")
    ap.add_argument("--out", required=True, help="output prefix")
    a = ap.parse_args()
    torch.set_num_threads(2)
    params, stats, values = read_weights(a.weights)
    shapes = {name: shape for name, shape, _ in params}
    n, s = a.batch, a.size
    x = np.fromfile(a.input, dtype="<f4").reshape(n, -1, s, s)
    gflat = np.fromfile(a.grads, dtype="<f4")
    watch, biases = [], []
    for xin, suffix, dtype in make_runs(x, a.perturb):
        model = Net(shapes)
        load_state(model, params, stats, values)
        model = model.to(dtype)
        if len(watch) < 2:  # float64 and float32 on the same input
            watch.append(KinkWatch(model))
        model.train()
        xt = torch.from_numpy(xin).to(dtype).requires_grad_(True)
        cls, loc = model(xt)
        g = torch.from_numpy(gflat.astype(np.float64)).to(dtype)
        g_cls, g_loc = g[:cls.numel()].reshape(cls.shape), g[cls.numel():].reshape(loc.shape)
        loss = (cls * g_cls).sum() + (loc * g_loc).sum()
        loss.backward()
        named = dict(model.named_parameters())
        biases.append({name: named[name + ".bn.bias"].grad.detach().double()
                       for name in watch[0].pre})
        sd = model.state_dict()
        parts = [np.array([loss.item()]), cls.detach().double().numpy().ravel(),
                 loc.detach().double().numpy().ravel()]
        for name, _, _ in params:
            parts.append(named[name].grad.detach().double().numpy().ravel())
        for name, _, _ in stats:
            parts.append(sd[name].detach().double().numpy().ravel())
        parts.append(xt.grad.detach().double().numpy().ravel())
        np.concatenate(parts).astype("<f8").tofile(f"{a.out}.{suffix}")
    with open(f"{a.out}.kinks", "w") as f:
        for line in kinks(watch[0], watch[1], biases):
            f.write(line + "\n")


if __name__ == "__main__":
    main()
