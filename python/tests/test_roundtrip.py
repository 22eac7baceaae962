"""Push/pull round trips through real servers, bit for bit: the servers' SGD step
(w - lr * g in float32, no FMA: ps/optim.h) recomputed here in float32, for float32 pushes and
for bfloat16 pushes (the gradient rounded to nearest even first, as torch rounds), from NumPy
arrays and torch tensors, with several tickets in flight and the versions they report."""
import numpy as np
import pytest
import torch

import zps

LR = 0.1  # not a power of two: the rounding of lr * g is part of what is compared
COUNTS = [("conv.weight", 3000), ("conv.bias", 7), ("fc.weight", 5000), ("fc.bias", 1)]


def _bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _expected(w, g, dtype):
    if dtype == "bf16":
        g = torch.from_numpy(g).to(torch.bfloat16).to(torch.float32).numpy()
    return (w - np.float32(LR) * g).astype(np.float32)


def _job(servers, dtype, n_servers=2):
    uris = servers(n_servers)
    c = zps.Client(uris, 0, push_dtype=dtype)
    job = c.register(COUNTS, mode="sync", num_trainers=1, chunk_bytes=8192)
    assert job["mode"] == "sync" and job["num_trainers"] == 1
    rng = np.random.default_rng()
    w0 = rng.standard_normal(c.num_elements).astype(np.float32)
    assert c.init(w0, optimizer="sgd", lr=LR) is True
    return c, w0, rng


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_numpy_push_then_pull_is_bit_exact(servers, dtype):
    c, w, rng = _job(servers, dtype)
    for step in range(3):
        g = (rng.standard_normal(c.num_elements) * 1e-2).astype(np.float32)
        tickets, off = [], 0
        for i, (_, n) in enumerate(COUNTS):  # one push per variable, all in flight at once
            tickets.append(c.push(i, g[off:off + n], step))
            off += n
        for t in tickets:
            c.wait(t)
        out = np.empty_like(w)
        version = c.pull(0, out, step + 1).wait()
        assert version == step + 1
        w = _expected(w, g, dtype)
        assert np.array_equal(_bits(out), _bits(w)), "step %d differs at %s" % (
            step, np.flatnonzero(_bits(out) != _bits(w))[:5])
    c.leave()
    c.close()


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_torch_pushpull_by_name_is_bit_exact(servers, dtype):
    c, w, rng = _job(servers, dtype, n_servers=1)
    params = [torch.empty(n) for _, n in COUNTS]
    for i, p in enumerate(params):
        c.pull(i, p).wait()
    assert np.array_equal(_bits(torch.cat(params).numpy()), _bits(w))
    g = [torch.randn(n) * 1e-2 for _, n in COUNTS]
    tickets = [c.pushpull(name, gi, p, 0) for (name, _), gi, p in zip(COUNTS, g, params)]
    assert all(c.wait(t) == 1 for t in tickets)
    want = _expected(w, torch.cat(g).numpy(), dtype)
    assert np.array_equal(_bits(torch.cat(params).numpy()), _bits(want))
    c.close()


def test_tickets_poll_and_a_range_of_variables(servers):
    c, w, _ = _job(servers, "f32")
    out = np.zeros(COUNTS[1][1] + COUNTS[2][1], np.float32)  # variables 1 and 2 together
    t = c.pull("conv.bias", out)
    while not t.done(timeout_ms=100):
        pass
    t.wait()
    a = COUNTS[0][1]
    assert np.array_equal(out, w[a:a + out.size])
    c.close()
