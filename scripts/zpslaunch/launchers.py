"""zpslaunch.launchers - how each process is started: the command that actually runs on this
machine for the chosen --launcher (local: the command itself; ssh and slurm: wrapped, see
their modules). Every launcher yields one local child per fleet process, so supervision,
signalling and reaping are the same for all of them.
"""
from zpslaunch import slurm, ssh


def wrap(argv, host, args, job, step):
    """The command that actually runs here, for the chosen launcher (step: the process's
    name within the job, e.g. zps-server-0)."""
    if args.launcher == "local":
        return argv
    if args.launcher == "ssh":
        return ssh.wrap(argv, host, args)
    if args.launcher == "slurm":
        return slurm.wrap(argv, host, args, step)
    raise ValueError(args.launcher)
