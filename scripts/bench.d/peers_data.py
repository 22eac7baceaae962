# peers_data.py — Fashion-MNIST for the peers of scripts/bench.d/tf-peers, read straight from
# the Debian package's IDX files (the same files `zps-data convert fashion-mnist` turns into
# zps's LMDB shards). numpy only, so both TF's venv and Debian's torch python can use it.
import gzip
import os

import numpy as np

DIRS = ("/usr/share/datasets/fashion-mnist", "/usr/share/dataset-fashion-mnist")


def _idx(path, offset):
    with gzip.open(path, "rb") as f:
        return np.frombuffer(f.read(), np.uint8, offset=offset)


def load_fashion(split="train"):
    """(images uint8 [N,28,28], labels uint8 [N]) of the training (or "t10k") split."""
    for d in [os.environ.get("PEERS_FASHION_DIR", "")] + list(DIRS):
        img = os.path.join(d, f"{split}-images-idx3-ubyte.gz")
        if d and os.path.exists(img):
            x = _idx(img, 16).reshape(-1, 28, 28)
            y = _idx(os.path.join(d, f"{split}-labels-idx1-ubyte.gz"), 8)
            return x, y
    raise SystemExit("peers: Fashion-MNIST IDX files not found (apt install dataset-fashion-mnist"
                     " or set PEERS_FASHION_DIR)")
