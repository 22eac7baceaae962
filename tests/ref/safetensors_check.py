#!/usr/bin/env python3
"""safetensors_check.py — the oracle of tests/test_export_formats.c: reads a zps safetensors
export with the safetensors package (not our own parser), and

  --list OUT                 writes "name dtype shape" per tensor, sorted by name;
  --torchvision SIZE,CLASSES --input X --logits L
                             loads it into torchvision's inception_v3(num_classes=CLASSES,
                             aux_logits=False, transform_input=False) with strict=True, runs
                             the float32 input X (N x 3 x SIZE x SIZE) in eval mode, and
                             compares its logits with zps's L (N x CLASSES float32): exit 1
                             past a relative L2 error of 1e-4 (float32 against float32 through
                             ~95 layers, the op tolerance of docs/kernels.md).
"""
import argparse
import sys

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", required=True)
    ap.add_argument("--list")
    ap.add_argument("--torchvision")
    ap.add_argument("--input")
    ap.add_argument("--logits")
    a = ap.parse_args()
    if a.list:
        from safetensors.numpy import load_file
        with open(a.list, "w") as f:
            for name, t in sorted(load_file(a.file).items()):
                f.write(f"{name} {t.dtype} {','.join(str(d) for d in t.shape)}\n")
        return 0
    import torch
    import torchvision
    from safetensors.torch import load_file
    size, classes = (int(v) for v in a.torchvision.split(","))
    sd = load_file(a.file)
    model = torchvision.models.inception_v3(weights=None, num_classes=classes, aux_logits=False,
                                            transform_input=False, init_weights=False)
    model.load_state_dict(sd, strict=True)  # raises on any missing or unexpected key
    model.eval()
    x = torch.from_numpy(np.fromfile(a.input, dtype=np.float32).reshape(-1, 3, size, size))
    want = np.fromfile(a.logits, dtype=np.float32).reshape(x.shape[0], classes)
    with torch.no_grad():
        got = model(x).numpy()
    rel = float(np.linalg.norm(got - want) / (np.linalg.norm(got) + 1e-30))
    print(f"safetensors_check: {len(sd)} tensors loaded strictly; logits relative L2 error "
          f"{rel:.3g} over {got.size} values")
    return 0 if rel <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
