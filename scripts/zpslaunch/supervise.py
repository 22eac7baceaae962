"""zpslaunch.supervise - runs the fleet until the trainers are done: reaps deaths, applies
the restart policies (servers with --restore, trainers per --on-trainer-exit), starts due
restarts, enforces --timeout, then runs --before-stop.

Invariant: a death is recorded as an event (what, when, how, what was done) exactly once,
when it is reaped; Interrupted comes from the signal handlers installed by cli, TimedOut
from run() once --timeout is reached.
"""
import signal
import subprocess
import time

from zpslaunch.cluster import hold_port
from zpslaunch.commands import substitute
from zpslaunch.env import process_env
from zpslaunch.launchers import command
from zpslaunch.proc import (BACKOFF_CAP, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_TIMEOUT,
                            NEVER_RESTART, Interrupted, TimedOut)
from zpslaunch.process import reap_one, start, start_followers

class Supervisor:
    """Runs the fleet until the trainers are done: reaps deaths, applies the restart
    policies, starts due restarts, enforces --timeout. Raises Interrupted / TimedOut."""

    def __init__(self, procs, args, env, say):
        self.procs, self.args, self.env, self.say = procs, args, env, say
        self.trainers = [p for p in procs if p.role == "trainer"]
        self.t0 = time.monotonic()
        self.t_end = self.t0 + args.timeout if args.timeout > 0 else None
        self.events = []   # what died, when, how, what was done (summary.json "events")
        self.code = EXIT_OK
        self.ending = None  # slurm: returns the job's state while Slurm ends the job
        self.ended = None   # that state, once seen

    def job_ended(self, dead=None):
        """True when the scheduler is ending the job (slurm: scancel, time limit): every
        process still running, and `dead` (just reaped), was signalled by it, so none is
        restarted and none reads "ok"; the job ends (exit 130)."""
        if self.ending is None:
            return False
        if self.ended is None:
            self.ended = self.ending()
            if self.ended is None:
                return False
            self.say(f"Slurm is ending the job (state {self.ended}): Slurm signalled every "
                     "process")
        for p in self.procs:
            if p.running or p is dead:
                p.cancelled = True
        if dead is not None:
            self.record(dead, f"none (Slurm job {self.ended})")
        self.code = EXIT_INTERRUPTED
        return True

    def start(self, p):
        """Starts p's next incarnation; False when it cannot start."""
        env = process_env(self.env, p)
        p.argv = command(p, self.args, env)  # ssh: the variables travel in the command
        start(p, env)
        if p.error:
            self.say(f"{p.role} {p.index}: cannot start: {p.error}")
            return False
        extra = f" (restart {p.restarts}{', --restore' if p.role == 'server' else ''})" \
            if p.restarts else ""
        self.say(f"started {p.role} {p.index} pid {p.pid} on {p.host}: log {p.log}{extra}")
        return True

    def start_all(self):
        for p in self.procs:  # servers first: they bind before trainers connect
            if not self.start(p):
                self.code = EXIT_FAILED
                return

    def busy(self):
        """Trainers still running or waiting for a restart."""
        return any(p.running or p.restart_at is not None for p in self.trainers)

    def limit(self, p):
        a = self.args
        if p.role == "server":
            return a.restart_servers
        return a.restart_trainers if a.on_trainer_exit == "restart" else 0

    def decide(self, p):
        """What to do about p, which died while trainers ran: restart, continue or stop."""
        code = p.exit_code() if not p.error else 127
        if p.role == "trainer" and self.args.on_trainer_exit == "continue":
            return "continue"
        if code in NEVER_RESTART or p.restarts >= self.limit(p):
            return "stop"
        return "restart"

    def record(self, p, action):
        at = time.monotonic() - self.t0
        ev = {"t_s": round(at, 3), "role": p.role, "index": p.index, "pid": p.pid,
              "how": p.death(), "exit_code": p.exit_code(), "action": action}
        self.events.append(ev)
        return ev

    def on_death(self, p):
        if self.job_ended(p):
            return
        if p.role == "trainer" and p.ok():
            self.say(f"trainer {p.index} finished (ok, {p.end - p.start:.1f} s)")
            return
        if p.role == "server":
            p.shut_down = p.shutdown_requester()
            if p.shut_down:  # asked to stop: the trainers end on their own, as told
                self.record(p, f"none (shut down by {p.shut_down})")
                self.say(f"server {p.index} shut down by {p.shut_down} (exit 0)")
                return
            p.early = True  # whatever its status: the trainers still need it
        what = self.decide(p)
        if what == "restart":
            delay = min(self.args.restart_backoff * 2 ** p.restarts, BACKOFF_CAP)
            action = (f"restart {p.restarts + 1} of {self.limit(p)} in {delay:g} s"
                      + (" with --restore" if p.role == "server" else ""))
            p.restart_at = time.monotonic() + delay
            if p.role == "server" and p.own_port and p.held is None:  # until the restart
                p.held = hold_port(p.port)
                if p.held is None:
                    action += f" (port {p.port} was taken while it was down: it may not bind)"
        elif what == "continue":
            action = "job goes on without it (--on-trainer-exit continue)"
            p.tolerated = True
        else:
            why = ("no restart left" if self.limit(p) else "restarts off") \
                if p.exit_code() not in NEVER_RESTART else "not restartable"
            action = f"stopping the job ({why})"
            self.code = EXIT_FAILED
        ev = self.record(p, action)
        self.say(f"{p.role} {p.index} failed: {ev['how']} at {ev['t_s']:.1f} s (log {p.log}): "
                 f"{action}")
        if what == "continue" and not any(q.running or q.restart_at for q in self.trainers):
            if not any(q.ok() and not q.tolerated for q in self.trainers):
                self.code = EXIT_FAILED

    def restart_due(self):
        now = time.monotonic()
        for p in self.procs:
            if p.restart_at is not None and p.restart_at <= now:
                p.reset()
                p.restarts += 1
                with open(p.log, "ab") as f:
                    f.write(f"---- zps-launch: restart {p.restarts} of {p.role} {p.index} at "
                            f"{now - self.t0:.1f} s\n".encode())
                if not self.start(p):
                    self.code = EXIT_FAILED

    def wake_in(self):
        """Seconds until the next deadline (timeout or due restart), None if none."""
        times = [p.restart_at for p in self.procs if p.restart_at is not None]
        if self.t_end is not None:
            times.append(self.t_end)
        return max(min(times) - time.monotonic(), 0.001) if times else None

    def run(self):
        while self.code == EXIT_OK and self.busy():
            if self.t_end is not None and time.monotonic() >= self.t_end:
                raise TimedOut()
            self.restart_due()
            p = reap_one(self.procs, self.wake_in())  # None at a deadline: look what is due
            if p is not None:
                self.on_death(p)
        if self.code == EXIT_OK:
            self.say("all trainers finished")

    def cancel_restarts(self):
        for p in self.procs:
            p.restart_at = None


def run_hook(cmd, values, env, t_end, say):
    """--before-stop: runs cmd (a template, through sh -c) to the end, bounded by the
    launcher's --timeout; True when it exited 0."""
    text = substitute(cmd, values)
    say(f"before-stop: {text}")
    left = None if t_end is None else max(t_end - time.monotonic(), 0.1)
    try:
        r = subprocess.run(["/bin/sh", "-c", text], env=env, timeout=left)
    except subprocess.TimeoutExpired:
        say("before-stop: --timeout reached")
        return False
    if r.returncode != 0:
        say(f"before-stop failed: exit {r.returncode}")
    return r.returncode == 0


def supervise(sup, args, common, env, say, followers, stop_evt):
    """Starts the fleet, runs it, then --before-stop; the exit code so far."""
    try:
        sup.start_all()
        followers += start_followers(args.follow, sup.procs, stop_evt)
        if sup.code == EXIT_OK:
            sup.run()
        code = sup.code
        if code == EXIT_OK and args.before_stop:
            if not run_hook(args.before_stop, dict(common, index="", host="", port=""), env,
                            sup.t_end, say):
                code = EXIT_FAILED
    except Interrupted as e:
        say(f"interrupted by {signal.Signals(e.args[0]).name}")
        code = EXIT_INTERRUPTED
        sup.job_ended()
    except TimedOut:
        say(f"timeout of {args.timeout:g} s reached")
        code = EXIT_TIMEOUT
    return code
