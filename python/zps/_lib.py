"""_lib.py — finds libzps.so and declares the C API of include/zps/zps.h for ctypes.

The structs below mirror zps.h field for field; their layout is part of soname libzps.so.0
(zps.h "ABI"), which is why only that major is loaded.

Search order (the first that loads wins): $ZPS_LIB (the .so file, or the directory holding
it); `pkg-config --variable=libdir zps` (an installed prefix, `make install`); the loader's
own search (LD_LIBRARY_PATH, ldconfig's cache); the source tree's build/lib when this
package runs from a checkout (python/zps/ -> ../../build/lib).
"""
import ctypes
import os
import subprocess

SONAME = "libzps.so.0"

c_float_p = ctypes.POINTER(ctypes.c_float)


class Options(ctypes.Structure):
    _fields_ = [
        ("timeout_ms", ctypes.c_int),
        ("max_retries", ctypes.c_int),
        ("backoff_ms", ctypes.c_int),
        ("heartbeat_ms", ctypes.c_int),
        ("heartbeat_thread", ctypes.c_int),
        ("streams", ctypes.c_int),
        ("msg_bytes", ctypes.c_uint64),
        ("push_dtype", ctypes.c_int),
        ("curve_server_key_file", ctypes.c_char_p),
        ("curve_key_file", ctypes.c_char_p),
    ]


class Job(ctypes.Structure):
    _fields_ = [
        ("mode", ctypes.c_int),
        ("num_trainers", ctypes.c_uint32),
        ("replicas_to_aggregate", ctypes.c_uint32),
        ("staleness", ctypes.c_uint32),
    ]


class Optimizer(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int),
        ("lr", ctypes.c_double),
        ("momentum", ctypes.c_double),
        ("nesterov", ctypes.c_int),
        ("decay", ctypes.c_double),
        ("epsilon", ctypes.c_double),
        ("beta1", ctypes.c_double),
        ("beta2", ctypes.c_double),
        ("weight_decay", ctypes.c_double),
        ("initial_accumulator", ctypes.c_double),
        ("sched", ctypes.c_int),
        ("decay_rate", ctypes.c_double),
        ("decay_steps", ctypes.c_uint64),
        ("staircase", ctypes.c_int),
        ("total_steps", ctypes.c_uint64),
        ("min_lr", ctypes.c_double),
        ("warmup_steps", ctypes.c_uint64),
    ]


def _candidates():
    env = os.environ.get("ZPS_LIB")
    if env:
        yield os.path.join(env, SONAME) if os.path.isdir(env) else env
        return  # an explicit choice: no silent fallback to another copy
    try:
        out = subprocess.run(["pkg-config", "--variable=libdir", "zps"], capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            yield os.path.join(out.stdout.strip(), SONAME)
    except (OSError, subprocess.SubprocessError):
        pass
    yield SONAME
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, "..", "..", "build", "lib", SONAME)


def _load():
    tried = []
    for path in _candidates():
        try:
            return ctypes.CDLL(path), path
        except OSError as e:
            tried.append("%s (%s)" % (path, e))
    raise ImportError("zps: cannot load %s; tried: %s. Set ZPS_LIB to the library (make "
                      "builds build/lib/libzps.so.0; make install puts it under PREFIX/lib)"
                      % (SONAME, "; ".join(tried)))


lib, path = _load()

_P = ctypes.c_void_p
_S = ctypes.c_int  # zps_status
_SIGS = {
    "zps_library_version": (ctypes.c_char_p, []),
    "zps_strerror": (ctypes.c_char_p, [ctypes.c_int]),
    "zps_status_name": (ctypes.c_char_p, [ctypes.c_int]),
    "zps_options_default": (None, [ctypes.POINTER(Options)]),
    "zps_optimizer_default": (None, [ctypes.POINTER(Optimizer)]),
    "zps_connect": (_S, [ctypes.POINTER(ctypes.c_char_p), ctypes.c_int, ctypes.c_uint32,
                         ctypes.POINTER(Options), ctypes.POINTER(_P)]),
    "zps_close": (None, [ctypes.POINTER(_P)]),
    "zps_register": (_S, [_P, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_uint64),
                          ctypes.c_int, ctypes.c_uint64, ctypes.POINTER(Job),
                          ctypes.POINTER(Job)]),
    "zps_num_vars": (ctypes.c_int, [_P]),
    "zps_num_elements": (ctypes.c_uint64, [_P]),
    "zps_init": (_S, [_P, _P, ctypes.POINTER(Optimizer), ctypes.POINTER(ctypes.c_int)]),
    "zps_push": (_S, [_P, ctypes.c_int, ctypes.c_int, _P, ctypes.c_int64,
                      ctypes.POINTER(ctypes.c_uint64)]),
    "zps_pull": (_S, [_P, ctypes.c_int, ctypes.c_int, _P, ctypes.c_int64,
                      ctypes.POINTER(ctypes.c_uint64)]),
    "zps_pushpull": (_S, [_P, ctypes.c_int, ctypes.c_int, _P, _P, ctypes.c_int64,
                          ctypes.POINTER(ctypes.c_uint64)]),
    "zps_wait": (_S, [_P, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64)]),
    "zps_wait_all": (_S, [_P]),
    "zps_poll": (_S, [_P, ctypes.c_uint64, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]),
    "zps_barrier": (_S, [_P]),
    "zps_stats": (_S, [_P, ctypes.c_int, ctypes.POINTER(_P)]),
    "zps_leave": (_S, [_P]),
    "zps_last_error": (ctypes.c_char_p, [_P]),
    "zps_free": (None, [_P]),
}
for _name, (_res, _args) in _SIGS.items():
    _f = getattr(lib, _name)
    _f.restype = _res
    _f.argtypes = _args
