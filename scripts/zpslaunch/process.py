"""zpslaunch.process - starting, signalling, reaping and stopping the fleet's processes.

Invariants: every process runs in its own session/process group created by us (setsid), and
is only ever signalled through that group, never by name. Our stop signals are blocked
across fork so that a stop aimed at a new group before exec is not lost. An ssh process has
a stdin pipe we hold open while it should live (closing it ends the remote side).
"""
import os
import signal
import sys
import threading
import time


def start(p, env):
    if p.held is not None:  # its port, held since it was picked, is the server's from now
        p.held.close()
        p.held = None
    log = open(p.log, "ab", buffering=0)
    if p.pipe_stdin:  # ssh: a pipe we hold open while the process should live
        stdin_r, p.stdin_w = os.pipe()
    else:
        stdin_r = os.open(os.devnull, os.O_RDONLY)
    # Block our stop signals across fork: a SIGTERM aimed at the new group before exec would
    # otherwise hit our Python handler in the child and be lost. The child restores the
    # default actions, then unblocks, so such a signal kills it as intended.
    stop_sigs = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, stop_sigs)
    try:
        pid = os.fork()
    except OSError as e:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        p.error = str(e)
        return
    if pid == 0:  # child: own session/process group, log as stdout+stderr
        try:
            for sig in stop_sigs | {signal.SIGALRM}:
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            os.setsid()
            os.dup2(stdin_r, 0)
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            os.execvpe(p.argv[0], p.argv, env)
        except OSError as e:
            os.write(2, f"zps-launch: cannot run {p.argv[0]}: {e}\n".encode())
            os._exit(127)
    p.pid = pid  # recorded before a pending stop signal can interrupt us
    p.start = time.monotonic()
    os.close(stdin_r)
    log.close()
    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def close_stdin(p):
    """ssh: closes the pipe the remote side watches, which SIGTERMs the remote process."""
    if p.stdin_w is not None:
        try:
            os.close(p.stdin_w)
        except OSError:
            pass
        p.stdin_w = None


def stop_group(p, sig):
    """Signals p's process group (created by us with setsid). Never by name. An ssh process
    is asked to stop by closing its stdin: the remote watcher SIGTERMs the remote process
    and ssh returns its exit status (a signal to ssh itself would end the connection, exit
    255, and lose how the remote process ended)."""
    if not p.running:
        return
    p.stopped = True
    if p.signaller is not None and p.signaller(p, sig):
        return
    if p.stdin_w is not None and sig == signal.SIGTERM:
        close_stdin(p)
        return
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        # the child has not reached setsid() yet: its group does not exist, so signal the
        # process itself (it is our unreaped child, so the pid is still its own)
        try:
            os.kill(p.pid, sig)
        except ProcessLookupError:
            pass
    if sig == signal.SIGKILL:
        close_stdin(p)


REAP_POLL_S = 0.02


def reap_one(procs, timeout=None):
    """Waits up to timeout seconds (None: until one ends; 0: only looks) for one of our
    children to end; returns its Proc, or None when none ended in time or none is left.
    It polls (waitpid WNOHANG every 20 ms) rather than blocking in waitpid under an alarm:
    a signal handler's exception landing between waitpid's return and the bookkeeping
    would lose the status, and the process would read "running" for ever."""
    end = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return None
        if pid:
            for p in procs:
                if p.pid == pid and p.status is None:
                    p.status = status
                    p.end = time.monotonic()
                    close_stdin(p)
                    return p
            continue  # a child that is not a fleet process: look again
        now = time.monotonic()
        if end is not None and now >= end:
            return None
        time.sleep(REAP_POLL_S if end is None else min(REAP_POLL_S, end - now))


def stop_all(procs, which, grace, say):
    """SIGTERM to every running process in `which`, SIGKILL after grace seconds; reaps them."""
    live = [p for p in which if p.running]
    if not live:
        return
    say(f"stopping {', '.join(f'{p.role} {p.index}' for p in live)}")
    for p in live:
        stop_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(p.running for p in live):
        left = deadline - time.monotonic()
        if left <= 0:
            for p in live:
                if p.running:
                    say(f"{p.role} {p.index} ignored SIGTERM for {grace:g} s: SIGKILL")
                    stop_group(p, signal.SIGKILL)
            while any(p.running for p in live):
                if reap_one(procs) is None:
                    break
            break
        reap_one(procs, left)
    # kill anything left in the groups (e.g. a child the leader forked), then close pipes
    for p in live:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        close_stdin(p)


def follow(path, stop_evt, out):
    """Copies a growing log to our stdout until stop_evt (a human watching progress)."""
    pos = 0
    while True:
        try:
            with open(path, "rb") as f:
                f.seek(pos)
                data = f.read()
                pos += len(data)
        except FileNotFoundError:
            data = b""
        if data:
            out.write(data)
            out.flush()
        if stop_evt.wait(0.2) and not data:
            return


def start_followers(specs, procs, stop_evt):
    followers = []
    for spec in specs:
        role, _, idx = spec.partition(":")
        for p in procs:
            if p.role == role and str(p.index) == (idx or "0"):
                t = threading.Thread(target=follow, args=(p.log, stop_evt, sys.stdout.buffer),
                                     daemon=True)
                t.start()
                followers.append(t)
    return followers
