"""zpslaunch.cluster - the cluster file (docs/cluster.md) as the launcher reads and writes it,
and free loopback ports for a fleet on this machine, held until their servers start.

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


def hold_free_ports(n):
    """n sockets bound to distinct free TCP ports on 127.0.0.1, held: the caller closes each
    just before its server starts (process.start, Proc.held). While held, no other bind and
    no connect() from this machine can take the port; after the close only the few
    milliseconds until the server binds it are open to that."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return socks
    except OSError:
        for s in socks:
            s.close()
        raise


def hold_port(port):
    """A socket bound to 127.0.0.1:port (SO_REUSEADDR: the dead server's closing connections
    do not stand in the way), or None when another program holds the port."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        return s
    except OSError:
        s.close()
        return None


def write_cluster(path, job, servers, trainers):
    with open(path, "w") as f:
        f.write(f"# written by zps-launch {datetime.datetime.now().isoformat(timespec='seconds')}\n")
        f.write(f"job = {job}\n")
        for h, p in servers:
            f.write(f"server = {h}:{p}\n")
        for h in trainers:
            f.write(f"trainer = {h}\n")
