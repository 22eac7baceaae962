"""conftest.py — fixtures of the Python client's tests (tests/test_python.c runs them).

Servers are zps-server processes ($ZPS_BIN, else the source tree's build/bin) on ephemeral
127.0.0.1 ports; each is stopped by its PID when the test ends (SIGTERM, then SIGKILL after
10 s), whatever the test's outcome. The package is imported from this checkout (python/) and
the library found as zps/_lib.py says ($ZPS_LIB when set).
"""
import os
import select
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))


def zps_bin(prog):
    return os.path.join(os.environ.get("ZPS_BIN") or os.path.join(ROOT, "build", "bin"), prog)


def start_server(*args, timeout=10.0):
    """(Popen, uri) of a zps-server started with args; waits for its "listening on" line."""
    p = subprocess.Popen([zps_bin("zps-server"), "--bind", "tcp://127.0.0.1:0",
                          "--log-level", "warn", "--stats-every", "0", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    end, buf = time.monotonic() + timeout, b""
    while time.monotonic() < end:
        r, _, _ = select.select([p.stdout], [], [], max(0.0, end - time.monotonic()))
        if not r:
            break
        chunk = os.read(p.stdout.fileno(), 4096)
        if not chunk:
            break
        buf += chunk
        for line in buf.decode(errors="replace").splitlines():
            if line.startswith("zps-server listening on "):
                return p, line.split()[-1]
    stop(p)
    raise RuntimeError("zps-server did not start: %s" % buf.decode(errors="replace"))


def stop(p):
    """SIGTERM, then SIGKILL after 10 s; reaps the process."""
    if p.poll() is None:
        os.kill(p.pid, signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
    if p.stdout:
        p.stdout.close()


@pytest.fixture
def servers():
    """start(n, *args) -> list of n server URIs; every server is stopped at the end."""
    procs = []

    def start(n=1, *args):
        uris = []
        for _ in range(n):
            p, uri = start_server(*args)
            procs.append(p)
            uris.append(uri)
        return uris

    yield start
    for p in procs:
        stop(p)
