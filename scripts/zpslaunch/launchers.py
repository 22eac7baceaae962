"""zpslaunch.launchers - how each process is started: the command that actually runs on this
machine for the chosen --launcher (local: the command itself; ssh and slurm: wrapped, see
their modules). Every launcher yields one local child per fleet process, so supervision,
signalling and reaping are the same for all of them.

The command is wrapped again at each start, with that incarnation's environment, because
ssh carries the variables in the command line (env.py).
"""
from zpslaunch import slurm, ssh
from zpslaunch.env import forwarded


def wrap(argv, host, args, job, env, step=None):
    """The command that actually runs here, for the chosen launcher; env is the process's
    environment (env.process_env), step its name in the job (slurm's step name)."""
    if args.launcher == "local":
        return argv
    if args.launcher == "ssh":
        return ssh.wrap(argv, host, args, forwarded(env, args.x_env))
    if args.launcher == "slurm":
        return slurm.wrap(argv, host, args, step or job)
    raise ValueError(args.launcher)


def command(p, args, env):
    """What runs here for p's next incarnation (a restart runs p.restart_cmd); {restart} in
    it becomes the incarnation's number (0 first)."""
    cmd = [a.replace("{restart}", str(p.restarts))
           for a in (p.restart_cmd if p.restarts else p.cmd)]
    return wrap(cmd, p.node, args, env["ZPS_JOB"], env, p.step)
