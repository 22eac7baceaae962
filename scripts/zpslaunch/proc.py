"""zpslaunch.proc - one slot of the fleet (Proc), the launcher's exit codes and the two
exceptions its signal handlers raise.

A Proc is a role and index (server 1, trainer 0) plus its current incarnation: after a
restart the same Proc holds the new pid; `restarts` counts the incarnations after the first.
Its status words (how/describe) are what the summary table and summary.json show, so tests
and users read the same text.
"""
import os
import re
import signal

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_TIMEOUT, EXIT_INTERRUPTED = 0, 1, 2, 124, 130


class Interrupted(Exception):
    """Ctrl-C or SIGTERM reached the launcher."""


class TimedOut(Exception):
    """--timeout expired."""


NEVER_RESTART = {2, 126, 127}  # usage error, cannot run: a restart fails the same way
BACKOFF_CAP = 30.0


class Proc:
    """One slot of the fleet (a server or trainer index) and its current incarnation."""

    def __init__(self, role, index, host, port, cmd, log):
        self.role, self.index, self.host, self.port = role, index, host, port
        self.cmd = cmd            # the command, before the launcher wraps it
        self.restart_cmd = cmd    # what a restart runs (servers: with --restore)
        self.argv = cmd           # what runs here (wrapped; set at each start)
        self.log = log            # path of its log
        self.pid = None           # pid of the process we started (leader of its group)
        self.start = None         # monotonic start time
        self.end = None           # monotonic end time
        self.status = None        # raw wait status once reaped
        self.stopped = False      # we sent it a signal
        self.error = None         # could not start: why
        self.stdin_w = None       # ssh: write end of its stdin (closing it ends the remote)
        self.pipe_stdin = False   # ssh: give it a stdin pipe (start() makes it)
        self.restarts = 0         # incarnations started after the first
        self.restart_at = None    # monotonic time a pending restart is due
        self.early = False        # a server that ended while trainers still ran
        self.tolerated = False    # a dead trainer the job went on without (continue)
        self.node = host          # where it runs (slurm: the node's name, whatever host says)
        self.step = None          # its name in the job (slurm: its step's name)
        self.signaller = None     # slurm: signals its step; True when that was enough
        self.cancelled = False    # slurm: Slurm ended the job while it ran
        self.shut_down = None     # a server that exited 0 on a SHUTDOWN request: from whom
        self.held = None          # the socket holding its port until it (re)starts (own_port)
        self.own_port = False     # the launcher picked its port on 127.0.0.1: it holds the
                                  # port before the first start and while a restart is due

    @property
    def running(self):
        return self.pid is not None and self.status is None

    def reset(self):
        """Forgets the dead incarnation before a restart."""
        self.pid = self.start = self.end = self.status = self.error = None
        self.stopped = self.early = False
        self.restart_at = self.shut_down = None

    def signalled(self):
        """The signal that ended the last incarnation, None when it exited. Over ssh a
        remote death by signal N arrives as the remote shell's exit status 128 + N."""
        if not os.WIFEXITED(self.status):
            return os.WTERMSIG(self.status)
        code = os.WEXITSTATUS(self.status)
        return code - 128 if self.pipe_stdin and 128 < code < 128 + 65 else None

    def ok(self):
        """Finished successfully, was stopped by us after the trainers succeeded, or is a
        dead trainer the job was told to go on without."""
        if self.tolerated:
            return True
        if self.error or self.cancelled or self.status is None or self.early:
            return False
        if os.WIFEXITED(self.status) and os.WEXITSTATUS(self.status) == 0:
            return True
        return self.stopped and self.signalled() is not None

    def how(self):
        """How the last incarnation ended, in a few words."""
        if self.error:
            return "failed to start"
        if self.status is None:
            return "running" if self.pid else "not started"
        sig = self.signalled()
        if sig is None:
            code = os.WEXITSTATUS(self.status)
            return "ok" if code == 0 else f"exit {code}"
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return f"killed by {name}"

    def death(self):
        """How a dead incarnation ended, for the events: exit status or signal."""
        how = self.how()
        return "exit 0 (early)" if how == "ok" and self.early else how

    def describe(self):
        text = self.how()
        if self.status is not None and not self.error:
            if self.early:
                text = ("exit 0" if text == "ok" else text) + " (early)"
            elif self.stopped:
                text = "stopped" if self.signalled() is not None else (
                    text if text == "ok" else text + " (stopped)")
        if self.tolerated:
            text += " (job went on)"
        if self.shut_down:
            text += f" (shut down by {self.shut_down})"
        if self.cancelled:  # Slurm signalled it: an exit 0 is a stop, not a finished run
            text = ("stopped" if text in ("ok", "stopped") else text) + " (job cancelled)"
        return text

    def shutdown_requester(self):
        """For a server that exited 0: who asked it to (its log's last "SHUTDOWN from WHO"
        line: zps-ctl, or trainer 0 with --shutdown-servers), else None."""
        if self.role != "server" or self.exit_code() != 0:
            return None
        try:
            with open(self.log, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 65536))
                tail = f.read().decode(errors="replace")
        except OSError:
            return None
        found = re.findall(r"SHUTDOWN from (zps-ctl|trainer \d+)", tail)
        return found[-1] if found else None

    def exit_code(self):
        if self.status is None:
            return None
        sig = self.signalled()
        return os.WEXITSTATUS(self.status) if sig is None else -sig
