"""zps — Python client of the zps parameter servers (docs/ps.md "Python client").

A thin layer over libzps.so's C API (include/zps/zps.h) through ctypes. Buffers are never
copied: a push hands the library the address of the array's (or CPU tensor's) own memory,
which the library reads when it sends; a pull has the library write the values into the
array's memory. Hence the rules of zps.h, enforced here where Python can:
  - a buffer must be float32 and C-contiguous (a NumPy array, anything with the buffer
    protocol, or a torch CPU tensor); anything else is a TypeError, never a silent copy;
  - a pushed buffer must not change, and a pulled one must not be read, until its ticket is
    waited for. The client keeps a reference to each buffer in flight until then, so a
    buffer cannot be freed under the library.
Errors come back as ZpsError: the status (an int and its name) and the message, which for a
server's refusal is the server's own reason.
"""
import ctypes
import json
import sys

import numpy as np

from . import _lib

__version__ = _lib.lib.zps_library_version().decode()
__all__ = ["Client", "Ticket", "ZpsError", "MODES", "OPTIMIZERS"]

MODES = {None: 0, "sync": 1, "async": 2, "ssp": 3}
_MODE_NAMES = {v: k for k, v in MODES.items()}
DTYPES = {"f32": 0, "bf16": 1}
OPTIMIZERS = {"sgd": 0, "momentum": 1, "rmsprop": 2, "adam": 3, "adagrad": 4}
SCHEDULES = {"constant": 0, "exponential": 1, "cosine": 2}


class ZpsError(RuntimeError):
    """A failed zps call. status: the zps_status (negative int); name: e.g. "ZPS_ERR_PLAN";
    message: why (for a server's refusal, the server's message)."""

    def __init__(self, status, message, what=""):
        self.status = status
        self.name = (_lib.lib.zps_status_name(status) or b"ZPS_ERR_?").decode()
        self.message = message
        text = "%s: %s" % (self.name, _lib.lib.zps_strerror(status).decode())
        if message:
            text += ": " + message
        super().__init__(("%s: " % what if what else "") + text)


def _check(st, handle, what):
    if st != 0:
        raise ZpsError(st, (_lib.lib.zps_last_error(handle) or b"").decode(errors="replace"),
                       what)


def _buffer(obj, writable):
    """(address, elements) of obj's own float32 memory; TypeError when that would need a
    copy (wrong dtype, not contiguous, not on the CPU) or, for a pull, is read-only."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu" or obj.dtype != torch.float32 or not obj.is_contiguous():
            raise TypeError("zps: a tensor must be float32, contiguous and on the CPU (got %s "
                            "%s%s)" % (obj.dtype, obj.device,
                                       "" if obj.is_contiguous() else ", not contiguous"))
        return obj.data_ptr(), obj.numel()
    if not isinstance(obj, np.ndarray):
        try:
            obj = np.asarray(memoryview(obj))
        except TypeError:
            raise TypeError("zps: %s has no buffer (give a NumPy array, a buffer or a torch "
                            "tensor)" % type(obj).__name__) from None
    if obj.dtype != np.float32 or not obj.flags.c_contiguous:
        raise TypeError("zps: an array must be float32 and C-contiguous (got %s%s)"
                        % (obj.dtype, "" if obj.flags.c_contiguous else ", not contiguous"))
    if writable and not obj.flags.writeable:
        raise TypeError("zps: a pull needs a writable array")
    return obj.__array_interface__["data"][0], obj.size


class Ticket:
    """An operation in flight (push, pull, pushpull). wait() blocks until every server
    answered and returns the smallest model version they reported."""

    __slots__ = ("client", "id", "op")

    def __init__(self, client, tid, op):
        self.client, self.id, self.op = client, tid, op

    def wait(self):
        return self.client.wait(self)

    def done(self, timeout_ms=0):
        return self.client.poll(self, timeout_ms)

    def __repr__(self):
        return "<zps.Ticket %d %s>" % (self.id, self.op)


class Client:
    """One trainer's connection to a fleet of servers (servers[i] is server i of the job).

    Options (zps.h zps_options): timeout_ms, max_retries, backoff_ms, heartbeat_ms,
    heartbeat_thread, streams, msg_bytes, push_dtype ("f32" or "bf16": gradients travel as
    bfloat16, rounded to nearest even by the library; values always travel as f32),
    curve_server_key / curve_key (CURVE key files). Not thread-safe: one client per thread.
    """

    def __init__(self, servers, trainer_id=0, push_dtype="f32", curve_server_key=None,
                 curve_key=None, **opts):
        if isinstance(servers, str):
            servers = [servers]
        o = _lib.Options()
        _lib.lib.zps_options_default(ctypes.byref(o))
        for k, v in opts.items():
            if k not in dict(_lib.Options._fields_) or k.startswith("curve") or k == "push_dtype":
                raise TypeError("zps.Client: unknown option %r" % k)
            setattr(o, k, int(v))
        if push_dtype not in DTYPES:
            raise ValueError("push_dtype: 'f32' or 'bf16', not %r" % (push_dtype,))
        o.push_dtype = DTYPES[push_dtype]
        o.curve_server_key_file = curve_server_key.encode() if curve_server_key else None
        o.curve_key_file = curve_key.encode() if curve_key else None
        arr = (ctypes.c_char_p * len(servers))(*[s.encode() for s in servers])
        h = ctypes.c_void_p()
        st = _lib.lib.zps_connect(arr, len(servers), trainer_id, ctypes.byref(o), ctypes.byref(h))
        _check(st, None, "connect")
        self._h = h
        self.servers = list(servers)
        self.trainer_id = trainer_id
        self.names, self.counts, self._offsets = [], [], [0]
        self._inflight = {}  # ticket id -> the buffers the library still reads or writes

    # ---- lifecycle

    def close(self):
        """Drops whatever is in flight and disconnects (idempotent)."""
        if getattr(self, "_h", None):
            _lib.lib.zps_close(ctypes.byref(self._h))
            self._h = None
        self._inflight = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass

    def _handle(self):
        if not self._h:
            raise ValueError("zps.Client is closed")
        return self._h

    # ---- the job

    def register(self, variables, mode=None, num_trainers=0, replicas_to_aggregate=0,
                 staleness=0, chunk_bytes=0):
        """REGISTER the model: variables is a list of (name, element count) pairs, or a dict
        name -> count or array (insertion order). mode: "sync", "async", "ssp" or None (the
        servers'). Returns the job the servers run as a dict."""
        if isinstance(variables, dict):
            variables = list(variables.items())
        names = [str(n) for n, _ in variables]
        counts = [int(c if isinstance(c, (int, np.integer)) else np.prod(np.shape(c)))
                  for _, c in variables]
        if mode not in MODES:
            raise ValueError("mode: sync, async, ssp or None, not %r" % (mode,))
        job = _lib.Job(MODES[mode], num_trainers, replicas_to_aggregate, staleness)
        got = _lib.Job()
        n = len(names)
        st = _lib.lib.zps_register(self._handle(), (ctypes.c_char_p * n)(*[s.encode() for s in names]),
                                   (ctypes.c_uint64 * n)(*counts), n, chunk_bytes,
                                   ctypes.byref(job), ctypes.byref(got))
        _check(st, self._h, "register")
        self.names, self.counts = names, counts
        self._offsets = list(np.cumsum([0] + counts))
        return {"mode": _MODE_NAMES.get(got.mode, got.mode), "num_trainers": got.num_trainers,
                "replicas_to_aggregate": got.replicas_to_aggregate, "staleness": got.staleness}

    @property
    def num_elements(self):
        return int(self._offsets[-1])

    def init(self, values, optimizer="sgd", lr=0.01, schedule="constant", **fields):
        """INIT the servers with the whole model and the optimizer (fields of zps_optimizer:
        momentum, nesterov, decay, epsilon, beta1, beta2, weight_decay, ...). values: one
        float32 buffer of num_elements, or a list of per-variable arrays/tensors (joined into
        one buffer: a copy, once). First writer wins: True when this call initialised them."""
        opt = _lib.Optimizer()
        _lib.lib.zps_optimizer_default(ctypes.byref(opt))
        opt.kind, opt.lr, opt.sched = OPTIMIZERS[optimizer], lr, SCHEDULES[schedule]
        for k, v in fields.items():
            if k not in dict(_lib.Optimizer._fields_):
                raise TypeError("zps.Client.init: unknown optimizer field %r" % k)
            setattr(opt, k, v)
        if isinstance(values, (list, tuple)):
            values = np.concatenate([_as_numpy(v).reshape(-1) for v in values])
        addr, n = _buffer(values, False)
        if n != self.num_elements:
            raise ValueError("init: %d values for a model of %d" % (n, self.num_elements))
        first = ctypes.c_int()
        st = _lib.lib.zps_init(self._handle(), addr, ctypes.byref(opt), ctypes.byref(first))
        _check(st, self._h, "init")
        return bool(first.value)

    # ---- pushes and pulls

    def _range(self, var, n):
        """(first_var, n_vars) whose elements add up to n, starting at var (index or name)."""
        first = self.names.index(var) if isinstance(var, str) else int(var)
        if not 0 <= first < len(self.names):
            raise IndexError("variable %r not in the registered model" % (var,))
        base = self._offsets[first]
        for k in range(first + 1, len(self._offsets)):
            if self._offsets[k] - base == n:
                return first, k - first
            if self._offsets[k] - base > n:
                break
        raise ValueError("a buffer of %d elements does not end on a variable boundary from "
                         "variable %d (%s)" % (n, first, self.names[first]))

    def _issue(self, op, var, step, push=None, pull=None):
        bufs = [b for b in (push, pull) if b is not None]
        gaddr, n = _buffer(push, False) if push is not None else (None, None)
        vaddr, m = _buffer(pull, True) if pull is not None else (None, None)
        if n is not None and m is not None and n != m:
            raise ValueError("pushpull: %d gradients, %d values" % (n, m))
        first, nv = self._range(var, n if n is not None else m)
        t = ctypes.c_uint64()
        h = self._handle()
        if op == "push":
            st = _lib.lib.zps_push(h, first, nv, gaddr, step, ctypes.byref(t))
        elif op == "pull":
            st = _lib.lib.zps_pull(h, first, nv, vaddr, step, ctypes.byref(t))
        else:
            st = _lib.lib.zps_pushpull(h, first, nv, gaddr, vaddr, step, ctypes.byref(t))
        _check(st, h, op)
        self._inflight[t.value] = bufs
        return Ticket(self, t.value, op)

    def push(self, var, grads, step):
        """Pushes the gradients of variable var (index or name) and of as many following
        variables as grads holds; returns a Ticket at once. step: zps.h "Steps"."""
        return self._issue("push", var, step, push=grads)

    def pull(self, var, out, step=-1):
        """Pulls the values of variable var (and the following ones out holds) into out;
        returns a Ticket at once: out is written by the time its wait() returns."""
        return self._issue("pull", var, step, pull=out)

    def pushpull(self, var, grads, out, step):
        """Push, then receive the values after it was applied (sync: after step's update)."""
        return self._issue("pushpull", var, step, push=grads, pull=out)

    def wait(self, ticket):
        """Blocks until the ticket completed; returns the smallest model version the servers
        reported, or raises ZpsError with the first failure (the GIL is released)."""
        v = ctypes.c_uint64()
        try:
            st = _lib.lib.zps_wait(self._handle(), ticket.id, ctypes.byref(v))
        finally:
            self._inflight.pop(ticket.id, None)
        _check(st, self._h, ticket.op)
        return v.value

    def wait_all(self):
        try:
            st = _lib.lib.zps_wait_all(self._handle())
        finally:
            self._inflight.clear()
        _check(st, self._h, "wait_all")

    def poll(self, ticket, timeout_ms=0):
        """True once the ticket completed (its wait() then returns at once)."""
        done = ctypes.c_int()
        _check(_lib.lib.zps_poll(self._handle(), ticket.id, timeout_ms, ctypes.byref(done)),
               self._h, "poll")
        return bool(done.value)

    # ---- everything else

    def barrier(self):
        _check(_lib.lib.zps_barrier(self._handle()), self._h, "barrier")

    def stats(self, server=0):
        """Server `server`'s STATS as a dict."""
        p = ctypes.c_void_p()
        _check(_lib.lib.zps_stats(self._handle(), server, ctypes.byref(p)), self._h, "stats")
        try:
            return json.loads(ctypes.string_at(p).decode())
        finally:
            _lib.lib.zps_free(p)

    def leave(self):
        _check(_lib.lib.zps_leave(self._handle()), self._h, "leave")


def _as_numpy(v):
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(v, torch.Tensor):
        return v.detach().cpu().to(torch.float32).numpy()
    return np.asarray(v, dtype=np.float32)
