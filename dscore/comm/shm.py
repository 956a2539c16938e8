"""Same-host payloads of the gloo pairwise collectives through shared memory.

gloo moves every byte through TCP, also between processes of one host: on loopback a 2-rank exchange
of 8 MiB per direction took 9 ms (0.9 GB/s), where a memory copy of the same bytes takes 0.3 ms. When
every rank of a group runs on the same host, :class:`ShmChannel` moves the payloads through memory the
ranks share and signals with futexes; gloo is used only when the shared memory cannot take an exchange:

* each rank owns an **outbox**: ``memfd`` extents (anonymous shared memory, freed by the kernel when the
  process exits, so a crash leaks nothing) that its peers map through ``/proc/<pid>/fd/<fd>``;
* a pairwise exchange (:meth:`ShmChannel.post`) copies each payload into a free region of the outbox and
  *posts* it to every peer through a **control segment** (also ``memfd``, mapped by the peers): a
  descriptor ``(number, mode, fd, offset, nbytes)`` in the slot of this exchange's number, then the exchange
  number in the peer's *posted* word, then a ``FUTEX_WAKE`` on that word. A peer waiting for the payload
  sleeps in ``FUTEX_WAIT`` on the word (microseconds to wake, where a gloo point-to-point token took
  0.3-0.7 ms on this 2-core machine) and reads the payload straight from the mapped region
  (:meth:`Exchange.payload`);
* exchanges are numbered in posting order, the same on every rank (the collective contract). A reader
  acknowledges each exchange it read in its own control segment (a ring of 4096 slots per peer); a slot
  and a region are reused once acknowledged. Nothing ever waits for an acknowledgement: while a slot
  is still held (more than 4096 exchanges in flight, or a work never waited) the exchange sends its
  descriptor and payload by gloo ``isend`` on a tag of its own, as without shared memory.
* when the outbox is at its limit (``DSCORE_SHM_BYTES``, default 256 MiB of address space; pages
  cost memory only once written) the payload goes by gloo ``isend`` on a tag of its own (mode 2), as
  without shared memory. A peer that never waits its work only holds regions, it cannot block anyone.
  Such gloo sends are waited lazily (waiting them in order could deadlock ranks that wait exchanges in
  different orders) and delivered by :func:`flush_pending_sends` before dscore destroys a group and at exit.

:func:`channel_for` decides once per group, collectively, whether the channel is used: every rank must
be on one host (same host name, boot id and PID namespace), able to map a peer's extent, and not have
``DSCORE_SHM=0``. Otherwise (or for CUDA tensors) the caller uses plain gloo transfers.

Memory ordering: a payload and its descriptor are stored before the posted word, and read after the
posted word was seen; x86-64 keeps stores in program order and loads ahead of later stores (and glibc
fences its non-temporal copies), so the channel is enabled on Linux x86-64 only; elsewhere gloo carries
the payloads. A peer that exits, or stays silent for ``DSCORE_SHM_TIMEOUT`` seconds (default 1800, gloo's
default timeout), makes the wait raise :class:`~dscore.errors.DistributedError` naming the rank.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import mmap
import os
import platform
import socket
import sys
import time
import weakref
from collections import deque
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dscore.errors import DistributedError

__all__ = ["Exchange", "ShmChannel", "channel_for", "flush_pending_sends", "shm_enabled"]

log = logging.getLogger("dscore.comm")

_MODE_SHM = 1
_MODE_TCP = 2
_ALIGN = 64  # bytes: regions start on cache-line boundaries
_EXTENT_MIN = 16 << 20  # bytes of address space per extent (pages are allocated when written)
_DEFAULT_LIMIT = 256 << 20
_PAYLOAD_TAG_BASE = 1 << 24
_PAYLOAD_TAG_SPAN = 1 << 20
_LIMIT_ENV = "DSCORE_SHM_BYTES"
_ENABLE_ENV = "DSCORE_SHM"
_TIMEOUT_ENV = "DSCORE_SHM_TIMEOUT"
_RING = 4096  # descriptor and acknowledgement slots per peer
_DESC = 5  # int64 words of a descriptor: exchange number, mode, fd, offset, nbytes
_PEER_WORDS = 1 + _DESC * _RING + _RING  # per peer in a control segment: posted, descriptors, acks
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1

_channels: weakref.WeakKeyDictionary[Any, ShmChannel | None] = weakref.WeakKeyDictionary()
_flush_registered = False


def shm_enabled() -> bool:
    """False when ``DSCORE_SHM=0`` or off Linux x86-64 (module docstring): every payload then goes by TCP."""
    return (
        os.environ.get(_ENABLE_ENV, "1") != "0"
        and hasattr(os, "memfd_create")
        and sys.platform.startswith("linux")
        and platform.machine() in ("x86_64", "AMD64")
    )


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc: Any = None


def _futex(addr: int, op: int, val: int, timeout: float | None = None) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    ts = None
    if timeout is not None:
        ts = ctypes.byref(_Timespec(int(timeout), int((timeout % 1) * 1e9)))
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), ctypes.c_int(op), ctypes.c_int(val), ts, None, ctypes.c_int(0))


def _low32(v: int) -> int:
    """The low half of a 64-bit word as the signed 32-bit value ``FUTEX_WAIT`` compares (little-endian)."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def _alive(pid: int) -> bool:
    """False once ``pid`` has exited (also while it is a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            state = fh.read().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _timeout() -> float:
    raw = os.environ.get(_TIMEOUT_ENV, "").strip()
    try:
        return float(raw) if raw else 1800.0
    except ValueError:
        raise DistributedError(f"environment variable {_TIMEOUT_ENV}={raw!r} must be a number of seconds") from None


def _host_key() -> tuple[str, str, int]:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            boot = fh.read().strip()
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return (socket.gethostname(), f"pid-{os.getpid()}", -1)  # unknown: never matches another process
    return (socket.gethostname(), boot, pid_ns)


def _payload_tag(seq: int) -> int:
    """The tag of exchange ``seq``'s TCP payload: its own, so a payload matches its receive whatever order
    the exchanges are finished in."""
    return _PAYLOAD_TAG_BASE + seq % _PAYLOAD_TAG_SPAN


def _limit() -> int:
    raw = os.environ.get(_LIMIT_ENV, "").strip()
    try:
        return int(raw) if raw else _DEFAULT_LIMIT
    except ValueError:
        raise DistributedError(f"environment variable {_LIMIT_ENV}={raw!r} must be an integer number of bytes") from None


class _Extent:
    """One ``memfd`` segment of an outbox, mapped into this process as a uint8 tensor."""

    def __init__(self, size: int, rank: int) -> None:
        self.fd = os.memfd_create(f"dscore-outbox-rank{rank}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.size = size
        self.map = mmap.mmap(self.fd, size)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        # the mapping keeps the memory; the descriptor is only how peers open it: close it with the extent
        self._close_fd = weakref.finalize(self, os.close, self.fd)

    def close(self) -> None:
        self.bytes = torch.empty(0, dtype=torch.uint8)
        try:
            self.map.close()
        except BufferError:  # a view is still alive somewhere; the kernel frees it with the process
            pass
        self._close_fd()


def _map_peer(pid: int, fd: int) -> torch.Tensor:
    """A peer's extent as a uint8 tensor (raises OSError when it cannot be opened)."""
    own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    try:
        size = os.fstat(own).st_size
        mm = mmap.mmap(own, size)
    finally:
        os.close(own)
    return torch.frombuffer(mm, dtype=torch.uint8)


class ShmChannel:
    """The shared-memory outbox of one process group on this rank (see the module docstring).

    Built by :func:`channel_for`; not thread-safe (collectives of one group are posted from one thread).

    Args:
        rank / world: this rank's rank in the group and the group's size.
        control: this rank's control segment (an :class:`_Extent` of :func:`control_bytes` bytes).
        peer_controls: every rank's control segment as mapped here (int64 tensors; this rank's own at
            its index).
        pids: the process id of every group rank.
        limit: the most bytes of outbox address space (beyond: TCP).
    """

    def __init__(self, rank: int, world: int, control: _Extent, peer_controls: list[torch.Tensor],
                 pids: Sequence[int], limit: int) -> None:
        self.rank = rank
        self.world = world
        self.pids = list(pids)
        self.limit = limit
        self.control = control
        self._ctrl = [c.view(torch.int64) for c in peer_controls]
        self.extents: list[_Extent] = []
        self._rings: list[deque[tuple[int, int, int]]] = []  # per extent: (start, end, exchange number)
        self._peer_maps: dict[tuple[int, int], torch.Tensor] = {}
        self._posted = 0  # exchanges posted (the last one's number)
        self._sends: deque[tuple[Any, torch.Tensor]] = deque()  # gloo sends in flight, with the tensor they read
        self._timeout = _timeout()
        self.shm_bytes = 0
        self.tcp_bytes = 0
        self.overflows = 0  # descriptors sent by gloo because their slot was still held

    @staticmethod
    def control_bytes(world: int) -> int:
        """Bytes of one rank's control segment: per peer a posted word, :data:`_RING` descriptors of
        exchanges posted to that peer and :data:`_RING` acknowledgements of exchanges read from it."""
        return 8 * (8 + world * _PEER_WORDS)

    # int64 indices into a control segment; posted words and descriptors live in the sender's segment,
    # acknowledgements in the reader's
    @staticmethod
    def _posted_word(receiver: int) -> int:
        return 8 + receiver * _PEER_WORDS

    @staticmethod
    def _slot(receiver: int, seq: int) -> int:
        return 8 + receiver * _PEER_WORDS + 1 + _DESC * (seq % _RING)

    @staticmethod
    def _ack(sender: int, seq: int) -> int:
        return 8 + sender * _PEER_WORDS + 1 + _DESC * _RING + seq % _RING

    # ------------------------------------------------------------------ outbox regions
    def _read_by_all(self, seq: int) -> bool:
        # an acknowledgement slot holding a later number also frees seq: the reader is past it, and if it
        # never read seq it never will without finding the descriptor replaced
        slot = self._ack(self.rank, seq)
        return all(int(self._ctrl[q][slot]) >= seq for q in range(self.world) if q != self.rank)

    def _release_read_regions(self) -> None:
        # each extent's regions are a ring in posting order; freeing from the oldest until one is unread
        # keeps this O(1) per exchange (an unread old region holds later ones back a little, never wrongly)
        for ring in self._rings:
            while ring and self._read_by_all(ring[0][2]):
                ring.popleft()

    @staticmethod
    def _ring_fit(ring: deque[tuple[int, int, int]], size: int, need: int) -> int | None:
        """Where ``need`` bytes fit in a ring of regions taken and freed in order (None: they do not)."""
        if not ring:
            return 0 if need <= size else None
        first, last = ring[0], ring[-1]
        if last[0] >= first[0]:  # regions ascend from the oldest to the newest
            if need <= first[0]:
                return 0  # back to the start: the pages in use stay near the bytes in flight
            return last[1] if last[1] + need <= size else None
        return last[1] if last[1] + need <= first[0] else None  # wrapped: the gap between newest and oldest

    def _allocate(self, nbytes: int, seq: int) -> tuple[int, int] | None:
        """(extent index, offset) of a free region of ``nbytes``, or None when the limit is reached.

        Each extent is a ring buffer (regions are freed in the order they were taken) that goes back to
        its start as soon as the oldest region has moved far enough, and the lowest extent that fits is
        used: the pages in use stay near the bytes in flight, not the extents' size."""
        need = -(-nbytes // _ALIGN) * _ALIGN
        for ei, (ring, ext) in enumerate(zip(self._rings, self.extents)):  # lowest extent first
            start = self._ring_fit(ring, ext.size, need)
            if start is not None:
                ring.append((start, start + need, seq))
                return ei, start
        size = max(_EXTENT_MIN, need)
        if sum(x.size for x in self.extents) + size > self.limit:
            return None
        self.extents.append(_Extent(size, self.rank))
        self._rings.append(deque([(0, need, seq)]))
        return len(self.extents) - 1, 0

    # ------------------------------------------------------------------ waiting
    def _await(self, what: str, q: int, ready: Any) -> None:
        """Sleep until ``ready()``; the futex word is rank ``q``'s posted word for this rank."""
        if ready():
            return
        word = self._posted_word(self.rank)
        addr = self._ctrl[q].data_ptr() + 8 * word
        deadline = time.monotonic() + self._timeout
        while not ready():
            seen = int(self._ctrl[q][word])
            if ready():
                return
            _futex(addr, _FUTEX_WAIT, _low32(seen), 0.5)
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"shared-memory exchange: rank {q} (pid {self.pids[q]}) gave no {what} for "
                    f"{self._timeout:.0f} s ({_TIMEOUT_ENV}); the ranks may be calling different collectives"
                )
            if not _alive(self.pids[q]):
                raise DistributedError(
                    f"shared-memory exchange: rank {q} (pid {self.pids[q]}) exited while this rank waited for its {what}"
                )

    # ------------------------------------------------------------------ exchanges
    def post(self, payloads: Sequence[torch.Tensor | None], grp: Any) -> Exchange:
        """Start one pairwise exchange: ``payloads[q]`` (flat, contiguous, CPU) goes to group rank ``q``
        (None at this rank's own index). The same tensor object given for several peers is copied once.
        Never blocks. Returns the :class:`Exchange` whose :attr:`Exchange.works` must complete before its
        payloads are read.
        """
        self._posted += 1
        seq = self._posted
        self._release_read_regions()
        while self._sends and self._sends[0][0].is_completed():  # oldest first: they complete in order
            self._sends.popleft()
        placed: dict[int, tuple[int, int, int, int]] = {}  # id(tensor) -> descriptor (mode, fd, offset, nbytes)
        own = self._ctrl[self.rank]
        for q, t in enumerate(payloads):
            if q == self.rank or t is None:
                continue
            slot = self._slot(q, seq)
            occupant = int(own[slot])
            # the slot is free once its exchange was read (acknowledged in q's segment); a slow or never
            # waited exchange keeps it, and this one goes by gloo instead (descriptor and payload)
            by_slot = occupant == 0 or int(self._ctrl[q][self._ack(self.rank, occupant)]) >= occupant
            nbytes = t.numel() * t.element_size()
            head = placed.get(id(t)) if by_slot else None
            if head is None:
                spot = self._allocate(nbytes, seq) if nbytes and by_slot else None
                if spot is None:
                    head = (_MODE_TCP, -1, 0, nbytes)
                    self.tcp_bytes += nbytes
                else:
                    ei, off = spot
                    ext = self.extents[ei]
                    ext.bytes[off : off + nbytes].view(t.dtype).copy_(t.view(-1))
                    head = (_MODE_SHM, ext.fd, off, nbytes)
                    self.shm_bytes += nbytes
                if by_slot:
                    placed[id(t)] = head
            if not by_slot or (head[0] == _MODE_TCP and nbytes):  # gloo carries part of this exchange
                peer = q if grp is None else dist.get_global_rank(grp, q)
                if not by_slot:
                    self.overflows += 1
                    desc = torch.tensor((seq, *head), dtype=torch.int64)
                    self._sends.append((dist.isend(desc, dst=peer, group=grp, tag=_payload_tag(seq)), desc))
                if head[0] == _MODE_TCP and nbytes:
                    copy = t.detach().clone()  # the caller may reuse its tensor once the work completes
                    self._sends.append((dist.isend(copy, dst=peer, group=grp, tag=_payload_tag(seq)), copy))
            if by_slot:
                own[slot : slot + _DESC] = torch.tensor((seq, *head), dtype=torch.int64)
            word = self._posted_word(q)
            own[word] = seq  # after the payload and its descriptor
            _futex(own.data_ptr() + 8 * word, _FUTEX_WAKE, 1 << 30)
        arrivals = [_Arrival(self, q, seq) for q in range(self.world) if q != self.rank]
        return Exchange(self, seq, arrivals, grp)

    def _payload(self, q: int, like: torch.Tensor, grp: Any, seq: int) -> tuple[torch.Tensor, bool]:
        """Rank ``q``'s payload of exchange ``seq`` and whether its descriptor came through the slot."""
        slot = self._slot(self.rank, seq)
        desc = self._ctrl[q][slot : slot + _DESC].tolist()
        by_slot = int(desc[0]) == seq
        peer = q if grp is None else dist.get_global_rank(grp, q)
        if not by_slot:  # the slot was busy on the sender's side: the descriptor came by gloo
            got = torch.empty(_DESC, dtype=torch.int64)
            dist.recv(got, src=peer, group=grp, tag=_payload_tag(seq))
            desc = got.tolist()
            if int(desc[0]) != seq:
                raise DistributedError(f"shared-memory exchange {seq}: rank {q} sent the descriptor of exchange {desc[0]}")
        _, mode, fd, off, nbytes = (int(v) for v in desc)
        want = like.numel() * like.element_size()
        if nbytes != want:
            raise DistributedError(
                f"pairwise exchange: rank {q} sent {nbytes} bytes where {want} were expected; the ranks "
                "posted different collectives (every rank must call the same collectives in the same order)"
            )
        if mode == _MODE_TCP:
            out = torch.empty(like.numel(), dtype=like.dtype)
            if nbytes:
                dist.recv(out, src=peer, group=grp, tag=_payload_tag(seq))
            return out, by_slot
        region = self._peer_maps.get((q, fd))
        if region is None:
            region = self._peer_maps[(q, fd)] = _map_peer(self.pids[q], fd)
        return region[off : off + nbytes].view(like.dtype), by_slot

    def _acknowledge(self, seq: int, peers: Sequence[int]) -> None:
        own = self._ctrl[self.rank]
        for q in peers:
            own[self._ack(q, seq)] = seq

    def flush(self, timeout: float) -> int:
        """Wait (at most ``timeout`` seconds in all) for this rank's gloo sends still in flight: a peer
        receives them only when it waits the exchange, so a rank that is done must not exit before.
        Returns how many were left undelivered (0 normally)."""
        deadline = time.monotonic() + timeout
        while self._sends:
            w, _ = self._sends[0]
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                w.wait(timedelta(seconds=left))
            except RuntimeError as exc:  # the peer is gone or the wait timed out: nothing more to deliver
                log.warning("shared-memory exchange: a send to a peer did not complete: %s", exc)
                break
            self._sends.popleft()
        return len(self._sends)

    def close(self) -> None:
        """Wait for this rank's gloo sends, unmap every extent (its and its peers'); unusable afterwards."""
        for w, _ in self._sends:
            w.wait()
        self._sends.clear()
        self._peer_maps.clear()
        self._rings.clear()
        for ext in self.extents:
            ext.close()
        self.extents.clear()

    def __repr__(self) -> str:
        return (
            f"ShmChannel(rank={self.rank}, world={self.world}, extents={len(self.extents)}, "
            f"shm_bytes={self.shm_bytes}, tcp_bytes={self.tcp_bytes}, posted={self._posted})"
        )


class _Arrival:
    """Waits for rank ``q`` to post exchange ``seq`` (a work handle: ``wait()``, ``is_completed()``)."""

    __slots__ = ("_channel", "_q", "_seq", "_word")

    def __init__(self, channel: ShmChannel, q: int, seq: int) -> None:
        self._channel = channel
        self._q = q
        self._seq = seq
        self._word = channel._posted_word(channel.rank)

    def is_completed(self) -> bool:
        return int(self._channel._ctrl[self._q][self._word]) >= self._seq

    def wait(self, timeout: Any = None) -> bool:
        self._channel._await(f"payload of exchange {self._seq}", self._q, self.is_completed)
        return True


class Exchange:
    """One posted exchange: wait :attr:`works`, read each peer's payload, then :meth:`done`.

    Attributes:
        works: one handle per peer, complete once that peer posted its payload.
    """

    __slots__ = ("_channel", "_seq", "works", "_grp", "_by_slot")

    def __init__(self, channel: ShmChannel, seq: int, works: list[Any], grp: Any) -> None:
        self._channel = channel
        self._seq = seq
        self.works = works
        self._grp = grp
        self._by_slot: list[int] = []

    def payload(self, q: int, like: torch.Tensor) -> torch.Tensor:
        """Rank ``q``'s payload as a flat tensor of ``like``'s element count and dtype: a view of the peer's
        outbox, valid until :meth:`done` (or a temporary received by gloo). Call once per peer.

        Raises:
            DistributedError: the peer sent another size (the ranks posted different collectives).
        """
        out, by_slot = self._channel._payload(q, like, self._grp, self._seq)
        if by_slot:
            self._by_slot.append(q)
        return out

    def done(self) -> None:
        """Mark the payloads read: acknowledged to the peers that posted through their slot, which may
        then reuse the slot and the region."""
        self._channel._acknowledge(self._seq, self._by_slot)
        self._by_slot = []


def flush_pending_sends(timeout: float = 60.0) -> int:
    """Deliver every channel's gloo sends still in flight (see :meth:`ShmChannel.flush`); run before a
    process group is destroyed and at interpreter exit. Returns the sends left undelivered."""
    left = 0
    for channel in list(_channels.values()):
        if channel is not None and channel._sends:
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
        atexit.register(flush_pending_sends)  # after the group's own exit hooks: runs before them
        _flush_registered = True
    return channel


def _set_up(grp: Any, world: int, rank: int) -> ShmChannel | None:
    host = _host_key()
    try:
        control: _Extent | None = _Extent(ShmChannel.control_bytes(world), rank)
        limit = _limit()
    except OSError as exc:
        log.info("shared-memory exchange unavailable here (%s); gloo carries the payloads", exc)
        control = None
    info: list[Any] = [None] * world
    dist.all_gather_object(info, (host, os.getpid(), control.fd if control is not None else -1), group=grp)
    ok = control is not None and all(i[0] == host and i[2] >= 0 for i in info)
    maps: list[torch.Tensor] = []
    if ok and control is not None:
        for q, (_, pid, fd) in enumerate(info):
            if q == rank:
                maps.append(control.bytes)
                continue
            try:
                maps.append(_map_peer(pid, fd))
            except OSError as exc:
                log.info("cannot map rank %d's shared memory (%s); gloo carries the payloads", q, exc)
                ok = False
                break
    votes: list[Any] = [None] * world
    dist.all_gather_object(votes, ok, group=grp)
    if not all(votes) or control is None:
        if control is not None:
            maps.clear()
            control.close()
        return None
    log.debug("pairwise exchanges of this %d-rank group go through shared memory", world)
    return ShmChannel(rank, world, control, maps, [pid for _, pid, _ in info], limit)
