"""zpslaunch.commands - the command lines of the fleet: template substitution and the
--curve key material (made by zps-server --keygen).

Only the documented {name} placeholders are replaced, so other braces in user arguments
pass through untouched.
"""
import os
import shlex
import subprocess

def substitute(text, values):
    """Replaces the known {name} placeholders only (other braces are left alone)."""
    for k, v in values.items():
        text = text.replace("{" + k + "}", str(v))
    return text


def build_argv(template, passthrough, values, extra=()):
    argv = [substitute(a, values) for a in shlex.split(template)]
    argv += list(extra)
    argv += [substitute(a, values) for a in shlex.split(passthrough or "")]
    return argv


def make_curve_keys(run_dir, bin_dir, n_trainers):
    """--curve: key pairs for the servers (one, shared), each trainer and zps-ctl (the admin
    key: checkpoint, shutdown) in run_dir/keys, made by zps-server --keygen (keys already
    there from an earlier run in the same folder are kept), and the allow-list of their
    public keys. Returns the extra server
    arguments and a function giving trainer i's. Raises RuntimeError."""
    kdir = os.path.join(run_dir, "keys")
    os.makedirs(kdir, mode=0o700, exist_ok=True)
    os.chmod(kdir, 0o700)
    server = os.path.join(bin_dir, "zps-server")
    names = ["server"] + [f"trainer-{i}" for i in range(n_trainers)] + ["ctl"]
    for name in names:
        prefix = os.path.join(kdir, name)
        if os.path.exists(prefix + ".key") and os.path.exists(prefix + ".pub"):
            continue
        try:
            r = subprocess.run([server, "--keygen", prefix], stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"{server} --keygen {prefix}: {e}")
        if r.returncode != 0:
            raise RuntimeError(f"{server} --keygen {prefix} failed: {r.stderr.strip()}")
    allow = os.path.join(kdir, "allow.txt")
    with open(allow, "w") as f:
        f.write("# trainer public keys admitted by the servers (written by zps-launch --curve);\n"
                "# each key may speak for its own trainer id only\n")
        for i, name in enumerate(names[1:-1]):
            with open(os.path.join(kdir, name + ".pub")) as p:
                f.write(f"{p.read().strip()} trainer={i}  # {name}\n")
        with open(os.path.join(kdir, "ctl.pub")) as p:  # the operator's key, for zps-ctl
            f.write(f"{p.read().strip()} admin  # zps-ctl\n")
    server_args = ["--curve-key", os.path.join(kdir, "server.key"), "--curve-allow", allow]

    def trainer_args(i):
        return ["--curve-server-key", os.path.join(kdir, "server.pub"),
                "--curve-key", os.path.join(kdir, f"trainer-{i}.key")]
    return server_args, trainer_args
