"""Failures arrive as Python exceptions: a server's refusal as zps.ZpsError carrying the
status and the server's own message; a buffer that would need a copy as TypeError."""
import numpy as np
import pytest
import torch

import zps


def _client(uri, trainer=0, counts=(("w", 100), ("b", 4))):
    c = zps.Client([uri], trainer)
    c.register(list(counts), mode="sync", num_trainers=2)
    return c


def test_nan_push_raises_the_servers_message(servers):
    uri, = servers(1)
    c = _client(uri)
    c.init(np.ones(104, np.float32))
    g = np.zeros(100, np.float32)
    g[17] = np.nan
    with pytest.raises(zps.ZpsError) as e:
        c.push("w", g, 0).wait()
    assert e.value.name == "ZPS_ERR_NONFINITE" and e.value.status < 0
    assert "NaN or Inf in the payload" in e.value.message  # the server's words
    assert "server 0 (%s)" % uri in str(e.value)
    c.close()


def test_a_different_model_is_refused_with_the_plan_mismatch(servers):
    uri, = servers(1)
    a = _client(uri, 0)
    with pytest.raises(zps.ZpsError) as e:
        _client(uri, 1, counts=(("w", 100), ("b", 5)))
    assert e.value.name == "ZPS_ERR_PLAN"
    assert "plan mismatch: trainer 1 has plan" in e.value.message
    a.close()


def test_a_second_optimizer_is_refused(servers):
    uri, = servers(1)
    a, b = _client(uri, 0), _client(uri, 1)
    assert a.init(np.ones(104, np.float32), optimizer="sgd", lr=0.1)
    with pytest.raises(zps.ZpsError) as e:
        b.init(np.ones(104, np.float32), optimizer="adam", lr=0.1)
    assert e.value.name == "ZPS_ERR_CONFIG" and e.value.message
    a.close()
    b.close()


def test_buffers_that_would_need_a_copy_are_refused(servers):
    uri, = servers(1)
    c = _client(uri)
    with pytest.raises(TypeError, match="float32"):
        c.push("w", np.zeros(100, np.float64), 0)
    with pytest.raises(TypeError, match="contiguous"):
        c.push("w", np.zeros(200, np.float32)[::2], 0)
    with pytest.raises(TypeError, match="float32"):
        c.push("w", torch.zeros(100, dtype=torch.bfloat16), 0)
    with pytest.raises(TypeError, match="writable"):
        ro = np.zeros(100, np.float32)
        ro.flags.writeable = False
        c.pull("w", ro)
    with pytest.raises(ValueError, match="variable boundary"):
        c.push("w", np.zeros(101, np.float32), 0)
    c.close()


def test_connect_failure_says_why():
    with pytest.raises(zps.ZpsError) as e:
        zps.Client(["tcp://127.0.0.1:1"], 0, curve_server_key="/nonexistent.pub",
                   curve_key="/nonexistent.key")
    assert "/nonexistent" in e.value.message


def test_the_c_api_refuses_a_bad_range_with_a_message(servers):
    """The layer under zps.Client answers misuse with ZPS_ERR_INVALID, not an abort."""
    import ctypes
    from zps import _lib
    uri, = servers(1)
    c = zps.Client([uri], 0)
    buf = np.zeros(4, np.float32)
    t = ctypes.c_uint64()
    st = _lib.lib.zps_push(c._h, 0, 1, buf.ctypes.data, 0, ctypes.byref(t))
    assert _lib.lib.zps_status_name(st) == b"ZPS_ERR_INVALID"
    assert b"before zps_register" in _lib.lib.zps_last_error(c._h)
    c.register([("w", 100), ("b", 4)], mode="sync", num_trainers=1)
    st = _lib.lib.zps_pull(c._h, 1, 5, buf.ctypes.data, 0, ctypes.byref(t))
    assert _lib.lib.zps_status_name(st) == b"ZPS_ERR_INVALID"
    assert b"variables [1, 6) outside the model's 2" in _lib.lib.zps_last_error(c._h)
    c.close()
