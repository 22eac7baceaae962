"""python/examples/train_torch.py: its hand-written zps.Example reader gives back the
Fashion-MNIST IDX images and labels exactly (shards from zps-data convert, 3 shards so the
round-robin order is exercised; a flipped image byte is caught by the CRC), and the example
trains a few steps against a real server and reports its accuracy."""
import gzip
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

from conftest import HERE, ROOT, zps_bin

EXAMPLES = os.path.join(ROOT, "python", "examples")
IDX = "/usr/share/datasets/fashion-mnist"
sys.path.insert(0, EXAMPLES)


def _idx(name, offset):
    with gzip.open(os.path.join(IDX, name)) as f:
        return np.frombuffer(f.read(), np.uint8)[offset:]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    if not os.path.exists(os.path.join(IDX, "t10k-images-idx3-ubyte.gz")):
        pytest.skip("no Fashion-MNIST IDX files (dataset-fashion-mnist)")
    out = tmp_path_factory.mktemp("fmnist")
    subprocess.run([zps_bin("zps-data"), "convert", "fashion-mnist", "--out", str(out),
                    "--shards", "3", "--limit", "300", "--force"], check=True, timeout=60,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def test_reader_gives_back_the_idx_images_and_labels(dataset):
    import train_torch
    x, y = train_torch.load_split(str(dataset / "test"))
    assert x.shape == (300, 28, 28) and y.shape == (300,)
    # record g went to shard g mod 3 under key g div 3: shard by shard is that order
    g = np.concatenate([np.arange(s, 300, 3) for s in range(3)])
    want_x = _idx("t10k-images-idx3-ubyte.gz", 16).reshape(-1, 28, 28)[:300][g]
    want_y = _idx("t10k-labels-idx1-ubyte.gz", 8)[:300][g]
    assert np.array_equal(x, want_x) and np.array_equal(y, want_y)


def test_reader_rejects_a_flipped_byte():
    import train_torch
    rec = bytearray(b"\x0a\x03abc\x18\x01\x20\x03\x28\x01\x30\x02")  # image, h, w, c, label
    crc = zlib.crc32(bytes([0, 0, 0, 0, 1, 0, 0, 0, 3, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0]),
                     zlib.crc32(b"abc"))
    rec += b"\x45" + crc.to_bytes(4, "little")
    assert train_torch.parse_example(bytes(rec))[4] == 2
    rec[2] ^= 1
    with pytest.raises(ValueError, match="CRC"):
        train_torch.parse_example(bytes(rec))


def test_example_trains_against_a_server(dataset, servers):
    uri, = servers(1, "--mode", "sync", "--num-trainers", "1")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, "train_torch.py"), "--servers",
                        uri, "--data", str(dataset), "--steps", "3", "--batch", "8",
                        "--test-images", "50"], capture_output=True, text=True, timeout=200,
                       env=env)
    print(r.stdout, r.stderr)
    assert r.returncode == 0
    assert "step 2 loss" in r.stdout and "version 2" in r.stdout
    assert "test accuracy" in r.stdout
