"""zps.torch in a fleet: 2 trainer processes in sync mode, each with half of every batch,
end with the weights of 1 process with the whole batch (the servers average the 2 gradients of
a step, which is the gradient of the whole batch's mean loss), and both with those of plain
torch.optim.SGD (the servers' momentum is torch's), within float tolerance. async and ssp
fleets finish and move the model. Bounded: every process has a timeout; servers are stopped
by PID (conftest.py)."""
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import HERE

TRAINER = os.path.join(HERE, "fleet_trainer.py")


def _run(tmp_path, tag, n, uris=None, extra=()):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
    procs = []
    for r in range(n):
        cmd = [sys.executable, TRAINER, "--trainer", str(r), "--trainers", str(n),
               "--out", str(tmp_path / ("%s-%d.npz" % (tag, r))), *extra]
        if uris:
            cmd += ["--servers", ",".join(uris)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, o) in enumerate(zip(procs, outs)):
        print("---- %s trainer %d\n%s" % (tag, r, o))
        assert p.returncode == 0, "%s trainer %d failed" % (tag, r)
    return [dict(np.load(tmp_path / ("%s-%d.npz" % (tag, r)))) for r in range(n)]


def _close(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert np.allclose(a[k], b[k], rtol=1e-4, atol=1e-5), "%s: max |diff| %g" % (
            k, np.abs(a[k] - b[k]).max())


def test_sync_fleet_of_two_equals_one_process_with_the_whole_batch(servers, tmp_path):
    fleet = _run(tmp_path, "fleet", 2, servers(2, "--mode", "sync", "--num-trainers", "2"))
    one = _run(tmp_path, "one", 1, servers(2, "--mode", "sync", "--num-trainers", "1"))
    local = _run(tmp_path, "local", 1, extra=["--local"])
    for k in fleet[0]:  # both trainers hold the servers' model
        assert np.array_equal(fleet[0][k], fleet[1][k]), k
    _close(fleet[0], one[0])
    _close(one[0], local[0])
    init = _run(tmp_path, "init", 1, extra=["--local", "--steps", "0"])[0]
    assert not np.allclose(init["0.weight"], one[0]["0.weight"]), "training moved nothing"


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_and_ssp_fleets_finish_and_train(servers, tmp_path, mode):
    uris = servers(1, "--mode", mode, "--num-trainers", "2", "--staleness", "1")
    out = _run(tmp_path, mode, 2, uris, extra=["--mode", mode, "--staleness", "1"])
    local = _run(tmp_path, "local", 1, extra=["--local", "--steps", "0"])
    for o in out:
        assert all(np.isfinite(v).all() for v in o.values())
        assert not np.allclose(o["0.weight"], local[0]["0.weight"])
