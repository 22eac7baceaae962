"""zpslaunch.ssh - the ssh launcher: `ssh HOST sh -c 'cd DIR && CMD'`.

Invariant: the remote process lives only while the launcher's ssh connection does: a
watcher on the remote side waits for ssh's stdin (a pipe the launcher holds) to close, then
SIGTERMs the process. So stopping or losing the launcher ends the remote side too.
"""
import os
import shlex


def wrap(argv, host, args):
    """The local ssh command that runs argv on host."""
    cmd = shlex.join(argv)
    remote_dir = args.remote_dir or os.getcwd()
    # the watcher kills the process when our ssh's stdin closes (launcher stopped it or
    # died); its output goes to /dev/null so the session ends with the process
    # (fd 3 keeps ssh's stdin: a background list would otherwise read /dev/null)
    script = (f"cd {shlex.quote(remote_dir)} || exit 127; exec 3<&0; "
              f"{cmd} </dev/null 3<&- & p=$!; "
              "{ cat <&3 >/dev/null; kill -TERM $p; } >/dev/null 2>&1 & "
              "exec 3<&-; wait $p")
    return shlex.split(args.ssh) + [host, "sh -c " + shlex.quote(script)]
