"""The shared memory of the same-host transport: sealed ``memfd`` segments and the peers' read-only maps.

Each rank owns two ``memfd`` segments (anonymous shared memory, freed by the kernel when the last process
holding them exits, so a crash leaks nothing): an *outbox* (``DSCORE_SHM_BYTES``, default 256 MiB of
address space; pages cost memory only once written) and a *control segment* (posted words, descriptors, acknowledgements). Both are sealed against shrinking and
growing (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``), so a peer's mapping can never be cut under a
reader.

Peers receive them by descriptor passing (:mod:`~dscore_plugins.comm.shm.bootstrap`) and map them
read-only; the exchanges that use them are :mod:`~dscore_plugins.comm.shm.channel`'s.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import select
import warnings
from typing import Any

import torch

from dscore.errors import DistributedError

__all__ = ["ALIGN", "DEFAULT_LIMIT", "LIMIT_ENV", "SEALS", "Peer", "Segment", "map_readonly", "outbox_limit"]

ALIGN = 64  # bytes: regions start on cache-line boundaries
DEFAULT_LIMIT = 256 << 20
LIMIT_ENV = "DSCORE_SHM_BYTES"
SEALS = ("F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_SEAL")


def outbox_limit() -> int:
    """The outbox size (``DSCORE_SHM_BYTES``, default 256 MiB).

    Raises:
        DistributedError: the variable is not a number of bytes (>= 0).
    """
    raw = os.environ.get(LIMIT_ENV, "").strip()
    try:
        value = int(raw) if raw else DEFAULT_LIMIT
    except ValueError:
        value = -1
    if value < 0:
        raise DistributedError(f"environment variable {LIMIT_ENV}={raw!r} must be a number of bytes (>= 0)")
    return value


class Segment:
    """A sealed ``memfd`` of ``size`` bytes mapped read-write into its owner as a uint8 tensor."""

    def __init__(self, size: int, name: str) -> None:
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self.size = size
            self.map: mmap.mmap | None = mmap.mmap(self.fd, size) if size else None
        except OSError:
            os.close(self.fd)
            raise
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8) if self.map is not None else torch.empty(0, dtype=torch.uint8)

    def close(self) -> None:
        self.bytes = torch.empty(0, dtype=torch.uint8)
        try:
            if self.map is not None:
                self.map.close()
        except BufferError:  # a view is still alive somewhere; the kernel frees it with the process
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def map_readonly(fd: int) -> tuple[torch.Tensor, mmap.mmap | None]:
    """A received segment mapped read-only (a uint8 tensor that must never be written)."""
    size = os.fstat(fd).st_size
    if size == 0:
        return torch.empty(0, dtype=torch.uint8), None
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if not seals & fcntl.F_SEAL_SHRINK:
        raise OSError("a peer's segment is not sealed against shrinking")
    mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "buffer is not writable": the channel only reads it
        return torch.frombuffer(mm, dtype=torch.uint8), mm


class Peer:
    """What this rank holds of one peer: its pidfd and its segments mapped read-only."""

    __slots__ = ("rank", "pid", "pidfd", "ctrl", "outbox", "_maps")

    def __init__(self, rank: int, pid: int, pidfd: int, ctrl: torch.Tensor, outbox: torch.Tensor, maps: list[Any]):
        self.rank = rank
        self.pid = pid
        self.pidfd = pidfd
        self.ctrl = ctrl
        self.outbox = outbox
        self._maps = maps

    def alive(self) -> bool:
        """False once the peer process exited (its pidfd becomes readable; a zombie counts as exited)."""
        ready, _, _ = select.select([self.pidfd], [], [], 0)
        return not ready

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1

