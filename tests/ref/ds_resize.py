#!/usr/bin/python3
"""ds_resize.py IN OUT H W C OH OW [IN OUT H W C OH OW ...] — checks zps's fused resize
(datasets/image.c, ds_image_sample with the full image, no flip, mean 0, std 1) against
PyTorch's F.interpolate(mode="bilinear", align_corners=False), one case per group of seven
arguments. IN: u8 (H, W, C); OUT: float32 (C, OH, OW). Prints the largest difference per
case; exit 1 when any exceeds 5e-5 (float32 rounding of the source coordinate; another
convention, e.g. align_corners=True, differs by ~1e-2)."""
import sys

import numpy as np
import torch
import torch.nn.functional as F

args = sys.argv[1:]
if not args or len(args) % 7:
    sys.exit("usage: ds_resize.py IN OUT H W C OH OW [...]")
worst = 0.0
for i in range(0, len(args), 7):
    inp, out = args[i], args[i + 1]
    h, w, c, oh, ow = (int(v) for v in args[i + 2:i + 7])
    x = np.fromfile(inp, dtype=np.uint8).reshape(h, w, c).astype(np.float32) / 255.0
    t = torch.from_numpy(x).permute(2, 0, 1)[None]
    ref = F.interpolate(t, size=(oh, ow), mode="bilinear", align_corners=False)[0].numpy()
    got = np.fromfile(out, dtype=np.float32).reshape(c, oh, ow)
    diff = float(np.abs(ref - got).max())
    print(f"{h}x{w}x{c} -> {oh}x{ow}: max |zps - torch| = {diff:.3g}")
    worst = max(worst, diff)
sys.exit(0 if worst <= 5e-5 else 1)
