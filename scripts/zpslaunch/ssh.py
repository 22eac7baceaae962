"""zpslaunch.ssh - the ssh launcher: `ssh HOST sh -c 'cd DIR && VAR=... CMD'`, and the check
that every host can run its commands before any starts.

Invariants: the remote process lives only while the launcher's ssh connection does: a
watcher on the remote side waits for ssh's stdin (a pipe the launcher holds) to close, then
SIGTERMs the process (SIGKILL after --grace). So stopping or losing the launcher ends the
remote side too. sshd gives the remote side a clean environment (AcceptEnv is off by
default), so the variables the process must see travel in the command line, quoted, under
names checked by env.NAME.
"""
import os
import shlex
import subprocess

CHECK_TIMEOUT_S = 60  # one ssh per host, all at once: bounds a host that never answers


def remote_dir(args):
    return args.remote_dir or os.getcwd()


def wrap(argv, host, args, env):
    """The local ssh command that runs argv on host with the variables env (a dict)."""
    assign = "".join(f"{k}={shlex.quote(v)} " for k, v in env.items())
    cmd = assign + shlex.join(argv)
    # the watcher stops the process when our ssh's stdin closes (launcher stopped it or
    # died): SIGTERM, SIGKILL after --grace, as the local launcher does; its output goes to
    # /dev/null so the session ends with the process (fd 3 keeps ssh's stdin: a background
    # list would otherwise read /dev/null). The shell ends the watcher once the process
    # is gone, so its SIGKILL never reaches a pid the system has handed out again.
    script = (f"cd {shlex.quote(remote_dir(args))} || exit 127; exec 3<&0; "
              f"{cmd} </dev/null 3<&- & p=$!; "
              "{ cat <&3 >/dev/null; kill -TERM $p; "
              f"sleep {args.grace:g}; kill -KILL $p; }} >/dev/null 2>&1 & w=$!; "
              "exec 3<&-; wait $p; s=$?; kill $w 2>/dev/null; exit $s")
    return shlex.split(args.ssh) + [host, "sh -c " + shlex.quote(script)]


def s_check_script(directory, programs):
    """Prints each program that is not an executable file (a name without '/' is looked up in
    PATH); exit 3 when the directory is missing."""
    progs = " ".join(shlex.quote(p) for p in programs)
    d = shlex.quote(directory)
    return (f"cd {d} 2>/dev/null || {{ echo 'no directory' {d}; exit 3; }}; "
            f"for f in {progs}; do if [ -n \"${{f##*/*}}\" ]; then "
            "command -v \"$f\" >/dev/null 2>&1 || echo \"$f\"; "
            "elif [ ! -f \"$f\" ] || [ ! -x \"$f\" ]; then echo \"$f\"; fi; done")


def check_hosts(procs, args):
    """One ssh per distinct host, all in parallel: is every process's program there and
    executable (and the remote directory there)? Returns the problems, one line per host
    ("HOST: ..."), empty when every host is ready. Nothing is started on any host."""
    programs = {}
    for p in procs:
        progs = programs.setdefault(p.host, [])
        if p.cmd[0] not in progs:
            progs.append(p.cmd[0])
    running = {}
    for host, progs in programs.items():
        argv = shlex.split(args.ssh) + [host, "sh -c " + shlex.quote(
            s_check_script(remote_dir(args), progs))]
        try:
            running[host] = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                             text=True)
        except OSError as e:
            running[host] = e
    return [line for host, r in running.items() for line in s_check_result(host, r)]


def s_check_result(host, r):
    """The problem lines of one host's check (r: its Popen, or the OSError of starting it)."""
    if isinstance(r, OSError):
        return [f"{host}: cannot run ssh: {r}"]
    try:
        out, err = r.communicate(timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        r.kill()  # our own child, by its pid
        r.communicate()
        return [f"{host}: no answer from ssh in {CHECK_TIMEOUT_S} s"]
    lines = [x for x in out.splitlines() if x]
    if r.returncode == 3 and lines:
        return [f"{host}: {lines[0]}"]
    if r.returncode != 0:
        why = (err.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        return [f"{host}: cannot run a command there over ssh: {why}"]
    return [f"{host}: missing or not executable: {x}" for x in lines]
