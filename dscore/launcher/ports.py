"""The rendezvous port of a single-node run: pick a free one, or check that an explicit one is free.

Rank 0's store listens on this port on every interface; a taken port would fail the job only after every
rank started, so ``dscore run`` checks it before anything starts and names the process holding it.
"""

from __future__ import annotations

import os

from dscore.errors import LauncherError

__all__ = ["check_master_port", "pick_master_port", "port_holder"]


def _bind_error(port: int) -> OSError | None:
    """None when a listening socket could take ``port`` on every interface now, else the bind error.

    Rank 0's store listens on all interfaces (IPv6 dual-stack where available) with SO_REUSEADDR, so the
    probe does the same: a port in TIME_WAIT counts as free, one another process listens on does not.
    """
    import socket

    families = [(socket.AF_INET, "0.0.0.0")]
    if socket.has_ipv6:
        families.append((socket.AF_INET6, "::"))
    for family, host in families:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # family not configured on this machine
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(1)
        except OSError as exc:
            if family == socket.AF_INET6 and exc.errno not in (98,):  # EADDRINUSE only; no IPv6 is fine
                continue
            return exc
        finally:
            sock.close()
    return None


def pick_master_port() -> int:
    """A TCP port nothing listens on now (asked from the kernel), for a single-node run's rendezvous."""
    import socket

    for _ in range(20):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = int(sock.getsockname()[1])
        if _bind_error(port) is None:
            return port
    raise LauncherError("could not find a free TCP port for the rendezvous; pass --master_port")


def port_holder(port: int) -> str:
    """``"pid 123 (python train.py)"`` for the process listening on TCP ``port``, or ``""`` when it cannot
    be seen (another user's process, no /proc, psutil absent and /proc unreadable)."""
    try:
        import psutil  # optional (the launcher extra); /proc below otherwise

        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                return f"pid {conn.pid} ({' '.join(' '.join(psutil.Process(conn.pid).cmdline()).split())[:120]})"
    except Exception:  # noqa: BLE001 - psutil missing or not allowed: try /proc
        pass
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                next(fh, None)
                for line in fh:
                    fields = line.split()
                    if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(fields[9])
        except OSError:
            continue
    if not inodes:
        return ""
    targets = {f"socket:[{inode}]" for inode in inodes}
    for pid in (d for d in os.listdir("/proc") if d.isdigit()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in targets:
                    with open(f"/proc/{pid}/cmdline", "rb") as fh:
                        cmd = " ".join(fh.read().replace(b"\0", b" ").decode(errors="replace").split())
                    return f"pid {pid} ({cmd[:120]})"
            except OSError:
                continue
    return ""


def check_master_port(port: int) -> None:
    """Fail before any rank starts when ``port`` (an explicit ``--master_port``) is taken on this node.

    Raises:
        LauncherError: naming the port, the process holding it when visible, and ``--master_port``.
    """
    if not 0 < port < 65536:
        raise LauncherError(f"--master_port {port} is not a TCP port (1..65535)")
    error = _bind_error(port)
    if error is None:
        return
    holder = port_holder(port)
    raise LauncherError(
        f"--master_port {port} is already in use on this node"
        + (f" by {holder}" if holder else "")
        + f" ({error.strerror or error}); rank 0 could not listen there. Pass another --master_port, or leave "
        "it out to let a single-node run pick a free port."
    )
