#!/usr/bin/python3
"""ds_resize.py IN OUT H W C OH OW — checks zps's fused resize (datasets/image.c,
ds_image_sample with the full image, no flip, mean 0, std 1) against PyTorch's
F.interpolate(mode="bilinear", align_corners=False). IN: u8 (H, W, C); OUT: float32
(C, OH, OW). Prints the largest difference; exit 1 when it exceeds 5e-5
(float32 rounding of the source coordinate; another convention differs by ~1e-2)."""
import sys

import numpy as np
import torch
import torch.nn.functional as F

inp, out = sys.argv[1], sys.argv[2]
h, w, c, oh, ow = (int(v) for v in sys.argv[3:8])
x = np.fromfile(inp, dtype=np.uint8).reshape(h, w, c).astype(np.float32) / 255.0
t = torch.from_numpy(x).permute(2, 0, 1)[None]
ref = F.interpolate(t, size=(oh, ow), mode="bilinear", align_corners=False)[0].numpy()
got = np.fromfile(out, dtype=np.float32).reshape(c, oh, ow)
diff = float(np.abs(ref - got).max())
print(f"max |zps - torch| = {diff:.3g}")
sys.exit(0 if diff <= 5e-5 else 1)
