"""No copies: pushing and pulling a 256 MiB tensor grows the trainer process's peak resident
memory by a small fraction of the tensor, where one copy would add the whole 256 MiB. The
figures come from a fresh process (its VmHWM, reset through /proc/self/clear_refs just before
the transfer) and are printed."""
import os
import subprocess
import sys

import pytest

from conftest import HERE

SCRIPT = r"""
import sys, torch, zps

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith(("VmHWM", "VmRSS")):
            yield int(line.split()[1]) * 1024

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

n = int(sys.argv[2])
c = zps.Client([sys.argv[1]], 0)
c.register([("big", n)], mode="sync", num_trainers=1)
w = torch.zeros(n)
c.init(w, lr=1.0)
g = torch.full((n,), 0.25)          # touched: resident before the measurement
out = torch.empty(n).fill_(7.0)
reset_peak()
peak0, rss0 = hwm()
c.push(0, g, 0).wait()
peak1, _ = hwm()
reset_peak()
_, rss1 = hwm()
c.pull(0, out, 1).wait()
peak2, _ = hwm()
assert bool((out == -0.25).all()), "wrong values pulled"
print("push_growth", peak1 - rss0, "pull_growth", peak2 - rss1, "tensor", 4 * n)
"""


def test_a_256_mib_tensor_travels_without_a_copy(servers):
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("no /proc/self/clear_refs to reset the peak")
    uri, = servers(1)
    n = 64 << 20
    # ZPS_SHM=0: the server here is on this host, and its shared memory (docs/ps.md "Shared
    # memory") copies a push once into the segment by design; this is the ZeroMQ path's claim
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), ZPS_SHM="0")
    r = subprocess.run([sys.executable, "-c", SCRIPT, uri, str(n)], capture_output=True,
                       text=True, timeout=120, env=env)
    print(r.stdout, r.stderr)
    assert r.returncode == 0
    words = r.stdout.split()
    push, pull, size = (int(words[words.index(k) + 1]) for k in
                        ("push_growth", "pull_growth", "tensor"))
    print("peak RSS growth: push %.1f MiB, pull %.1f MiB, tensor %.0f MiB"
          % (push / 2**20, pull / 2**20, size / 2**20))
    assert push < size / 10 and pull < size / 10
