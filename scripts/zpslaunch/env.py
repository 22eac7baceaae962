"""zpslaunch.env - the environment of the fleet's processes: the ZPS_* variables the launcher
sets (ZPS_RUN_DIR, ZPS_JOB, then per incarnation ZPS_ROLE, ZPS_INDEX, ZPS_RESTART) and the
user's `-x VAR` / `-x VAR=VALUE` (like mpirun).

Invariant: every launcher gives a process the same variables. local and slurm pass the
whole environment (srun propagates it), so they need nothing more; ssh starts the remote
side with sshd's clean environment, so forwarded() picks what must travel in the remote
command line: every ZPS_* variable and every -x name.
"""
import re

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def parse_x(specs, environ):
    """-x VAR (the launcher's value) / -x VAR=VALUE, in order (a later one wins), as a dict.
    Raises ValueError (a usage error) on a bad name or a VAR the launcher does not have."""
    out = {}
    for spec in specs:
        name, eq, value = spec.partition("=")
        if not NAME.match(name):
            raise ValueError(f"-x {spec}: '{name}' is not a variable name "
                             "([A-Za-z_][A-Za-z0-9_]*)")
        if not eq:
            if name not in environ:
                raise ValueError(f"-x {name}: {name} is not set here (give -x {name}=VALUE)")
            value = environ[name]
        out[name] = value
    return out


def fleet_env(environ, run_dir, job, extra):
    """What every process of the fleet gets: ours, the job's ZPS_* and the -x variables."""
    return dict(environ, ZPS_RUN_DIR=run_dir, ZPS_JOB=job, **extra)


def process_env(env, p):
    """fleet_env plus the variables of p's next incarnation."""
    return dict(env, ZPS_ROLE=p.role, ZPS_INDEX=str(p.index), ZPS_RESTART=str(p.restarts))


def forwarded(env, extra):
    """The variables a launcher whose remote side starts from a clean environment (ssh) must
    pass itself: every ZPS_* and the -x names (dict, sorted by name)."""
    keep = {k: v for k, v in env.items() if k.startswith("ZPS_") and NAME.match(k)}
    keep.update((k, env[k]) for k in extra)
    return dict(sorted(keep.items()))
