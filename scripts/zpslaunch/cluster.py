"""zpslaunch.cluster - the cluster file (docs/cluster.md) as the launcher reads and writes it,
and free loopback ports for a fleet on this machine.

parse_cluster mirrors common/cluster.c only as far as launching needs; zps-server and
zps-trainer validate the file fully when they start.
"""
import datetime
import socket

def parse_cluster(path):
    """Servers [(host, port)], trainers [host], job name ('' when absent). Mirrors
    common/cluster.c closely enough for launching; zps-server/zps-trainer validate fully."""
    servers, trainers, job = [], [], ""
    with open(path) as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if "=" not in line:
                raise ValueError(f"{path}:{lineno}: expected 'key = value'")
            key, value = (x.strip() for x in line.split("=", 1))
            if key == "job":
                job = value
            elif key == "server":
                host, _, port = value.rpartition(":")
                if not host or not port.isdigit():
                    raise ValueError(f"{path}:{lineno}: server wants HOST:PORT")
                servers.append((host.strip("[]"), int(port)))
            elif key == "trainer":
                trainers.append(value)
            else:
                raise ValueError(f"{path}:{lineno}: unknown key '{key}'")
    if not trainers:
        raise ValueError(f"{path}: needs at least one trainer (servers may be left out for "
                         "an all-reduce fleet)")
    return servers, trainers, job


def free_ports(n):
    """n distinct free TCP ports on 127.0.0.1 (held together, so distinct; another program
    could still take one before the server binds it)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def write_cluster(path, job, servers, trainers):
    with open(path, "w") as f:
        f.write(f"# written by zps-launch {datetime.datetime.now().isoformat(timespec='seconds')}\n")
        f.write(f"job = {job}\n")
        for h, p in servers:
            f.write(f"server = {h}:{p}\n")
        for h in trainers:
            f.write(f"trainer = {h}\n")
