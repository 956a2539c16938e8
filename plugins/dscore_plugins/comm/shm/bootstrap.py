"""Setting up the same-host transport of a process group: who takes part, and the descriptors' hand-over.

Every rank owns two sealed segments (:mod:`~dscore_plugins.comm.shm.segments`). At set-up, every rank listens on an abstract Unix socket whose name carries a random token of
this job (drawn by group rank 0 and shared through the process group), and hands its two descriptors to
each peer with ``SCM_RIGHTS``; the receiving rank checks the sender's credentials (``SO_PEERCRED``: the
peer's pid and this user's uid), opens a ``pidfd`` of the peer while the socket is still connected (so
the pidfd names that process, never a reused pid), and maps the peer's segments **read-only**. Nothing
goes through ``/proc``; two jobs on one host never learn each other's token or descriptors.

:func:`channel_for` decides once per group, collectively, whether the channel is used: every rank must be
on one Linux host (same host name, boot id and PID namespace), have the ``shm_sync`` op, be able to pass
descriptors to its peers, and not have ``DSCORE_SHM=0``. Otherwise the caller uses plain gloo transfers.
Only CPU tensors ever go through it (a device tensor is never copied through host shared memory).

:func:`flush_pending_sends` delivers every channel's gloo sends before a group is destroyed and at exit.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import secrets
import socket
import struct
import sys
import weakref
from typing import Any

import torch.distributed as dist

from dscore import process
from dscore.comm.objects import all_gather_object
from dscore.errors import DscoreError
from dscore_plugins.comm.shm.channel import ShmChannel
from dscore_plugins.comm.shm.segments import ALIGN, SEALS, Peer, Segment, map_readonly, outbox_limit

__all__ = ["channel_for", "flush_pending_sends", "shm_enabled"]

log = logging.getLogger("dscore.comm")

_ENABLE_ENV = "DSCORE_SHM"

_channels: weakref.WeakKeyDictionary[Any, ShmChannel | None] = weakref.WeakKeyDictionary()
_flush_registered = False
_sync_op: Any = None


def shm_enabled() -> bool:
    """False when ``DSCORE_SHM=0`` or when this platform lacks what the channel needs (Linux ``memfd``,
    ``pidfd_open``, descriptor passing): every payload then goes by TCP."""
    return (
        os.environ.get(_ENABLE_ENV, "1") != "0"
        and sys.platform.startswith("linux")
        and hasattr(os, "memfd_create")
        and hasattr(os, "pidfd_open")
        and hasattr(socket, "send_fds")
        and all(hasattr(fcntl, s) for s in SEALS)
    )


def _sync() -> Any:
    """The ``shm_sync`` op module (built with ninja on first use; cached)."""
    global _sync_op
    if _sync_op is None:
        from dscore.ops import get_op_builder

        _sync_op = get_op_builder("shm_sync").load()
    return _sync_op


def _host_key() -> tuple[str, str, int]:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            boot = fh.read().strip()
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return (socket.gethostname(), f"pid-{os.getpid()}", -1)  # unknown: never matches another process
    return (socket.gethostname(), boot, pid_ns)



def flush_pending_sends(timeout: float = 60.0) -> int:
    """Deliver every channel's gloo sends still in flight (see :meth:`ShmChannel.flush`); run before a
    process group is destroyed and at interpreter exit. Returns the sends left undelivered."""
    left = 0
    for channel in list(_channels.values()):
        if channel is not None and (channel._sends or channel._abandoned):
            left += channel.flush(timeout)
    return left


def channel_for(grp: Any, world: int, rank: int) -> ShmChannel | None:
    """The group's :class:`ShmChannel`, or None when its payloads go by TCP (decided on first use).

    Collective on first use for a group: every rank of ``grp`` must call it at the same point (the
    pairwise collectives do, before their first transfer). Later calls are a dictionary lookup.
    """
    key = grp if grp is not None else dist.group.WORLD
    try:
        return _channels[key]
    except KeyError:
        pass
    global _flush_registered
    channel = _set_up(grp, world, rank) if shm_enabled() else None
    _channels[key] = channel
    if channel is not None and not _flush_registered:
        process.apply("shm_exit_flush", atexit.register, flush_pending_sends)  # runs before the group's hooks
        _flush_registered = True
    return channel


def _socket_name(token: str, rank: int) -> str:
    return f"\0dscore-shm-{token}-{rank}"


def _peer_pid(sock: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of a connected Unix socket (``SO_PEERCRED``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", raw)
    return pid, uid


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise OSError("the peer closed the set-up socket")
        data += chunk
    return data


def _hand_over(rank: int, world: int, token: str, pids: list[int], control: Segment, outbox: Segment,
               listener: socket.socket) -> list[Peer | None]:
    """Pass this rank's two descriptors to every peer and receive theirs (``SCM_RIGHTS``); map the peers'
    segments read-only and open their pidfds. Raises OSError when anything does not check out."""
    uid = os.getuid()
    outgoing: dict[int, socket.socket] = {}
    peers: list[Peer | None] = [None] * world
    try:
        for q in range(world):  # connect completes into the peer's backlog: no one waits for an accept
            if q != rank:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
                s.settimeout(60)
                s.connect(_socket_name(token, q))
                s.sendall(struct.pack("i", rank))
                outgoing[q] = s
        for _ in range(world - 1):
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(60)
                (q,) = struct.unpack("i", _recv_exact(conn, 4))
                pid, peer_uid = _peer_pid(conn)
                if not 0 <= q < world or q == rank or pid != pids[q] or peer_uid != uid:
                    raise OSError(f"a process (pid {pid}, uid {peer_uid}) claiming rank {q} is not a rank of this job")
                socket.send_fds(conn, [b"dscore-shm"], [control.fd, outbox.fd])
        for q, s in outgoing.items():
            msg, fds, _, _ = socket.recv_fds(s, 16, 2)
            try:
                pid, peer_uid = _peer_pid(s)
                if msg != b"dscore-shm" or len(fds) != 2 or pid != pids[q] or peer_uid != uid:
                    raise OSError(f"rank {q}'s set-up socket is held by pid {pid} (uid {peer_uid}), not pid {pids[q]}")
                # the pid is that process, not a reuse: the collective vote after the hand-over needs the
                # peer alive, so it was alive when this pidfd was opened
                pidfd = os.pidfd_open(pid)
                ctrl, cmap = map_readonly(fds[0])
                box, bmap = map_readonly(fds[1])
                peers[q] = Peer(q, pid, pidfd, ctrl, box, [cmap, bmap])
            finally:
                for fd in fds:
                    os.close(fd)
        return peers
    except BaseException:
        for p in peers:
            if p is not None:
                p.close()
        raise
    finally:
        for s in outgoing.values():
            s.close()


def _set_up(grp: Any, world: int, rank: int) -> ShmChannel | None:
    host = _host_key()
    control: Segment | None = None
    outbox: Segment | None = None
    listener: socket.socket | None = None
    token = secrets.token_hex(16)
    sync = None
    try:
        sync = _sync()
        limit = outbox_limit()
        control = Segment(ShmChannel.control_bytes(world), f"dscore-control-rank{rank}")
        outbox = Segment(limit if limit >= ALIGN else 0, f"dscore-outbox-rank{rank}")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    except (OSError, DscoreError) as exc:
        log.info("shared-memory exchange unavailable here (%s); gloo carries the payloads", exc)
    info = all_gather_object((host, os.getpid(), token, listener is not None), grp)
    token = info[0][2]  # group rank 0's: this job's name space
    ok = listener is not None and all(i[0] == host and i[3] for i in info)
    if ok and listener is not None:
        try:
            listener.bind(_socket_name(token, rank))
            listener.listen(world)
            listener.settimeout(60)
        except OSError as exc:
            log.info("cannot listen for shared-memory set-up (%s); gloo carries the payloads", exc)
            ok = False
    votes = all_gather_object(ok, grp)  # everyone listens before anyone connects
    peers: list[Peer | None] = []
    ok = all(votes)
    if ok and control is not None and outbox is not None and listener is not None:
        try:
            peers = _hand_over(rank, world, token, [i[1] for i in info], control, outbox, listener)
        except OSError as exc:
            log.info("cannot pass shared-memory descriptors between the ranks (%s); gloo carries the payloads", exc)
            ok = False
    if listener is not None:
        listener.close()
    votes = all_gather_object(ok, grp)
    if not all(votes) or control is None or outbox is None:
        for p in peers:
            if p is not None:
                p.close()
        for seg in (control, outbox):
            if seg is not None:
                seg.close()
        return None
    log.debug("pairwise exchanges of this %d-rank group go through shared memory", world)
    return ShmChannel(rank, world, control, outbox, peers, sync)
