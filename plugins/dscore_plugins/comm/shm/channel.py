"""The exchanges of the same-host transport: :class:`ShmChannel` (one per process group and rank).

gloo moves every byte through TCP, also between processes of one host: on loopback a 2-rank exchange
of 8 MiB per direction took 9 ms (0.9 GB/s), where a memory copy of the same bytes takes 0.3 ms. When
every rank of a group runs on the same host, :class:`ShmChannel` moves the payloads through memory the
ranks share and signals with futexes; gloo is used only when the shared memory cannot take an exchange.

collective contract) and any wait order is legal. Posting copies each payload into a free region of the
outbox, writes a descriptor ``(number, mode, offset, nbytes)`` into the slot of this number for the peer
and stores the number into the peer's *posted* word, waking it with ``FUTEX_WAKE``. A reader waits for
the posted word to reach the number (``FUTEX_WAIT``), reads the descriptor and the payload straight from
the mapped outbox (:meth:`Exchange.payload`) and acknowledges the number in its own control segment
(:meth:`Exchange.done`); a region and a slot are reused only once every peer acknowledged them. Nothing
ever waits for an acknowledgement: while a slot is still held (more than 4096 exchanges in flight) the
descriptor goes by gloo ``isend`` on a tag of the exchange's own, and when the outbox is full the payload
does too. An exchange whose work is dropped without ``wait()`` is acknowledged when it is collected (and
its gloo parts received and discarded at the next post), so it never holds a region or desynchronises
later exchanges.

**Memory ordering** is written in C++ (the ``shm_sync`` op, ``csrc/comm/shm_sync.cpp``, built with ninja
like the other ops): descriptors and posted words are published with a full fence then a release store
(so even non-temporal stores of the payload copy are visible first), read with acquire loads; an
acknowledgement is a release store the writer reads with an acquire load before it reuses a region.
futex return codes are checked (a failing call raises; ``EINTR``/``EAGAIN``/``ETIMEDOUT`` are expected).

**Failures.** A waiting rank checks its peer's pidfd at least every 0.2 s: a peer that exited before
posting makes the wait raise :class:`~dscore.errors.DistributedError` naming the rank within a fraction
of a second (a payload it posted before exiting is still read: the mapping keeps the memory). A peer
that stays silent for ``DSCORE_SHM_TIMEOUT`` seconds (default 1800, gloo's default), or for the timeout
given to ``Work.wait(timeout)``, raises the same error with the timeout named.

The segments are :mod:`~dscore_plugins.comm.shm.segments`'s; the set-up that builds a channel (and decides
whether a group has one) is :mod:`~dscore_plugins.comm.shm.bootstrap`'s.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dscore.errors import DistributedError
from dscore_plugins.comm.shm.segments import ALIGN, Peer, Segment

__all__ = ["Exchange", "ShmChannel"]

log = logging.getLogger("dscore.comm")

_MODE_SHM = 1
_MODE_TCP = 2
_PAYLOAD_TAG_BASE = 1 << 24
_PAYLOAD_TAG_SPAN = 1 << 20
_TIMEOUT_ENV = "DSCORE_SHM_TIMEOUT"
_RING = 4096  # descriptor and acknowledgement slots per peer
_DESC = 4  # int64 words of a descriptor: exchange number, mode, offset, nbytes
_PEER_WORDS = 8 + _DESC * _RING + _RING  # per peer in a control segment: posted word (+pad), descriptors, acks
_LIVENESS_POLL_S = 0.2  # how often a waiting rank checks that the peer process still exists


def _timeout() -> float:
    raw = os.environ.get(_TIMEOUT_ENV, "").strip()
    try:
        value = float(raw) if raw else 1800.0
    except ValueError:
        value = -1.0
    if not value > 0:
        raise DistributedError(f"environment variable {_TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return value


def _seconds(timeout: Any) -> float | None:
    """A ``Work.wait`` timeout (timedelta, seconds, or None) in seconds."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return float(timeout)



def _payload_tag(seq: int) -> int:
    """The tag of exchange ``seq``'s TCP parts: its own, so they match their receives in any wait order."""
    return _PAYLOAD_TAG_BASE + seq % _PAYLOAD_TAG_SPAN



class ShmChannel:
    """The shared-memory transport of one process group on this rank (see the module docstring).

    Built by :func:`channel_for`; not thread-safe (collectives of one group are launched from one thread).

    Args:
        rank / world: this rank's rank in the group and the group's size.
        control: this rank's control segment (:meth:`control_bytes` bytes).
        outbox: this rank's outbox segment (its size is the outbox limit; may be 0 bytes: all TCP).
        peers: what this rank holds of every other rank (index = group rank; None at this rank's own).
        sync: the ``shm_sync`` op module.
    """

    def __init__(self, rank: int, world: int, control: Segment, outbox: Segment, peers: list[Peer | None],
                 sync: Any) -> None:
        self.rank = rank
        self.world = world
        self.control = control
        self.outbox = outbox
        self.extents = [outbox] if outbox.size else []
        self.limit = outbox.size
        self.peers = peers
        self.pids = [os.getpid() if p is None else p.pid for p in peers]
        self._sync = sync
        self._own = control.bytes.data_ptr()
        self._ring: deque[tuple[int, int, int]] = deque()  # outbox regions in posting order: (start, end, number)
        self._posted = 0  # exchanges launched (the last one's number)
        # gloo sends in flight: (work, what it reads, peer, exchange number, descriptor in the slot?)
        self._sends: deque[tuple[Any, torch.Tensor, int, int, bool]] = deque()
        self._abandoned: list[tuple[int, list[tuple[int, int]], Any]] = []  # exchanges dropped unwaited
        self._timeout = _timeout()
        self.shm_bytes = 0
        self.tcp_bytes = 0
        self.overflows = 0  # descriptors sent by gloo because their slot was still held

    @staticmethod
    def control_bytes(world: int) -> int:
        """Bytes of one rank's control segment: a header, then per peer a posted word (on its own cache
        line), :data:`_RING` descriptors of exchanges posted to it and :data:`_RING` acknowledgements of
        exchanges read from it."""
        return 8 * (8 + world * _PEER_WORDS)

    # byte offsets into a control segment; posted words and descriptors live in the sender's segment,
    # acknowledgements in the reader's
    @staticmethod
    def _posted_off(receiver: int) -> int:
        return 8 * (8 + receiver * _PEER_WORDS)

    @staticmethod
    def _slot_off(receiver: int, seq: int) -> int:
        return 8 * (8 + receiver * _PEER_WORDS + 8 + _DESC * (seq % _RING))

    @staticmethod
    def _ack_off(sender: int, seq: int) -> int:
        return 8 * (8 + sender * _PEER_WORDS + 8 + _DESC * _RING + seq % _RING)

    def _peer(self, q: int) -> Peer:
        peer = self.peers[q]
        assert peer is not None
        return peer

    def _acked(self, q: int, seq: int) -> bool:
        """Whether rank ``q`` acknowledged exchange ``seq`` of this rank (acquire: its reads came first).
        A later number in the slot also counts: the reader is past ``seq`` for good."""
        return int(self._sync.load_acquire(self._peer(q).ctrl.data_ptr() + self._ack_off(self.rank, seq))) >= seq

    # ------------------------------------------------------------------ outbox regions
    def _release_read_regions(self) -> None:
        # regions are freed from the oldest until one is unread: O(1) per exchange; an unread old region
        # holds later ones back a little, never wrongly
        ring = self._ring
        while ring and all(self._acked(q, ring[0][2]) for q in range(self.world) if q != self.rank):
            ring.popleft()

    def _allocate(self, nbytes: int, seq: int) -> int | None:
        """Offset of a free outbox region of ``nbytes`` (a ring buffer going back to its start as soon as
        the oldest region moved far enough: the pages in use stay near the bytes in flight), or None."""
        need = -(-nbytes // ALIGN) * ALIGN
        size, ring = self.outbox.size, self._ring
        if not ring:
            start: int | None = 0 if need <= size else None
        else:
            first, last = ring[0], ring[-1]
            if last[0] >= first[0]:  # regions ascend from the oldest to the newest
                start = 0 if need <= first[0] else (last[1] if last[1] + need <= size else None)
            else:  # wrapped: the gap between the newest and the oldest
                start = last[1] if last[1] + need <= first[0] else None
        if start is not None:
            ring.append((start, start + need, seq))
        return start

    # ------------------------------------------------------------------ waiting
    def _await(self, q: int, seq: int, timeout: float | None) -> None:
        """Sleep until rank ``q`` posted exchange ``seq`` to this rank.

        Raises:
            DistributedError: ``q`` exited without posting it, or ``timeout`` (default
                ``DSCORE_SHM_TIMEOUT``) seconds passed.
        """
        peer = self._peer(q)
        addr = peer.ctrl.data_ptr() + self._posted_off(self.rank)
        sync = self._sync
        seen = int(sync.load_acquire(addr))
        if seen >= seq:
            return
        limit = self._timeout if timeout is None else min(timeout, self._timeout)
        deadline = time.monotonic() + limit
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                named = f"{_TIMEOUT_ENV}" if timeout is None or timeout >= self._timeout else "the wait's timeout"
                raise DistributedError(
                    f"shared-memory exchange {seq}: rank {q} (pid {peer.pid}) posted nothing for {limit:g} s "
                    f"({named}); the ranks may be calling different collectives, or rank {q} is stopped"
                )
            rc = sync.futex_wait(addr, seen, min(left, _LIVENESS_POLL_S))
            seen = int(sync.load_acquire(addr))
            if seen >= seq:
                return
            if rc == 3:  # EINTR: let Python run its signal handlers (KeyboardInterrupt) before sleeping again
                time.sleep(0)
            if not peer.alive():
                if int(sync.load_acquire(addr)) >= seq:
                    return  # posted just before it exited: the payload is still readable
                raise DistributedError(
                    f"shared-memory exchange {seq}: rank {q} (pid {peer.pid}) exited before posting its part "
                    "(the process is gone)"
                )

    # ------------------------------------------------------------------ exchanges
    def post(self, payloads: Sequence[torch.Tensor | None], grp: Any) -> Exchange:
        """Launch one exchange: ``payloads[q]`` (flat, contiguous, CPU) goes to group rank ``q`` (None at this
        rank's own index). The same tensor object given for several peers is copied once. Never blocks on a
        peer. Returns the :class:`Exchange`; its :attr:`Exchange.works` complete once every peer posted.
        """
        self._posted += 1
        seq = self._posted
        self._drain_abandoned()
        self._release_read_regions()
        self._release_sends()
        sync = self._sync
        placed: dict[int, tuple[int, int, int]] = {}  # id(tensor) -> (mode, offset, nbytes)
        for q, t in enumerate(payloads):
            if q == self.rank or t is None:
                continue
            slot_addr = self._own + self._slot_off(q, seq)
            occupant = int(sync.load_acquire(slot_addr))
            # the slot is free once its exchange was acknowledged; a slow reader keeps it, and this
            # exchange's descriptor goes by gloo instead
            by_slot = occupant == 0 or self._acked(q, occupant)
            nbytes = t.numel() * t.element_size()
            head = placed.get(id(t)) if by_slot else None
            if head is None:
                off = self._allocate(nbytes, seq) if nbytes and by_slot else None
                if off is None:
                    head = (_MODE_TCP, 0, nbytes)
                    self.tcp_bytes += nbytes
                else:
                    self.outbox.bytes[off : off + nbytes].view(t.dtype).copy_(t.view(-1))
                    head = (_MODE_SHM, off, nbytes)
                    self.shm_bytes += nbytes
                if by_slot:
                    placed[id(t)] = head
            if not by_slot or (head[0] == _MODE_TCP and nbytes):  # gloo carries part of this exchange
                peer = q if grp is None else dist.get_global_rank(grp, q)
                if not by_slot:
                    self.overflows += 1
                    desc = torch.tensor((seq, *head), dtype=torch.int64, device="cpu")
                    self._sends.append((dist.isend(desc, dst=peer, group=grp, tag=_payload_tag(seq)), desc, q, seq, False))
                if head[0] == _MODE_TCP and nbytes:
                    copy = t.detach().clone()  # the caller may reuse its tensor once the work completes
                    work = dist.isend(copy, dst=peer, group=grp, tag=_payload_tag(seq))
                    self._sends.append((work, copy, q, seq, by_slot))
            if by_slot:
                sync.publish_descriptor(slot_addr, seq, list(head))
            sync.store_release_and_wake(self._own + self._posted_off(q), seq)
        expect = [(q, t.numel() * t.element_size()) for q, t in enumerate(payloads) if q != self.rank and t is not None]
        return Exchange(self, seq, grp, expect)

    def _release_sends(self) -> None:
        """Drop the gloo sends their peer has received, with the copies they read. gloo reports a send
        complete only once it was waited, so the peer's acknowledgement tells: an exchange whose
        descriptor went through the slot is acknowledged only after the reader received its gloo part
        (and its slot is reused only after that, so the acknowledgement word is this exchange's). The
        wait then returns at once. A descriptor that went by gloo (its slot was still held: more than
        :data:`_RING` exchanges in flight) is never acknowledged by number; its sends stay until
        :meth:`flush`."""
        if not self._sends:
            return
        keep: deque[tuple[Any, torch.Tensor, int, int, bool]] = deque()
        for entry in self._sends:
            if entry[4] and self._acked(entry[2], entry[3]):
                entry[0].wait()
            else:
                keep.append(entry)
        self._sends = keep

    def _read_desc(self, q: int, seq: int, grp: Any) -> tuple[list[int], bool]:
        peer = self._peer(q)
        desc = list(self._sync.read_descriptor(peer.ctrl.data_ptr() + self._slot_off(self.rank, seq), seq, _DESC))
        if desc:
            return desc, True
        got = torch.empty(_DESC, dtype=torch.int64, device="cpu")  # the slot was busy: it came by gloo
        self._recv(got, q, grp, seq)
        desc = [int(v) for v in got.tolist()]
        if desc[0] != seq:
            raise DistributedError(f"shared-memory exchange {seq}: rank {q} sent the descriptor of exchange {desc[0]}")
        return desc, False

    def _recv(self, out: torch.Tensor, q: int, grp: Any, seq: int) -> None:
        src = q if grp is None else dist.get_global_rank(grp, q)
        try:
            dist.recv(out, src=src, group=grp, tag=_payload_tag(seq))
        except RuntimeError as exc:
            raise DistributedError(
                f"shared-memory exchange {seq}: receiving rank {q}'s part by gloo failed "
                f"({'the process exited' if not self._peer(q).alive() else exc})"
            ) from exc

    def _payload(self, q: int, like: torch.Tensor, grp: Any, seq: int) -> tuple[torch.Tensor, bool]:
        """Rank ``q``'s payload of exchange ``seq`` (already posted) and whether it came through the slot."""
        desc, by_slot = self._read_desc(q, seq, grp)
        _, mode, off, nbytes = desc
        want = like.numel() * like.element_size()
        if nbytes != want:
            raise DistributedError(
                f"pairwise exchange {seq}: rank {q} sent {nbytes} bytes where {want} were expected; the ranks "
                "launched different collectives (every rank must launch the same collectives in the same order)"
            )
        if mode == _MODE_TCP:
            out = torch.empty(like.numel(), dtype=like.dtype, device="cpu")
            if nbytes:
                self._recv(out, q, grp, seq)
            return out, by_slot
        return self._peer(q).outbox[off : off + nbytes].view(like.dtype), by_slot

    def _acknowledge(self, seq: int, peers: Sequence[int]) -> None:
        for q in peers:
            self._sync.store_release(self._own + self._ack_off(q, seq), seq)

    def _abandon(self, seq: int, expect: list[tuple[int, int]], grp: Any) -> None:
        """An exchange dropped without being read: drained at the next post or flush (it may still need
        gloo receives, which must not run inside a garbage collection)."""
        self._abandoned.append((seq, expect, grp))

    def _drain_abandoned(self) -> None:
        """Read (and discard) what peers posted for exchanges dropped unwaited, acknowledging it; a gloo
        part is received so its sender's send completes. Parts not posted yet are kept for later."""
        keep = []
        for seq, expect, grp in self._abandoned:
            left = []
            for q, nbytes in expect:
                peer = self._peer(q)
                if int(self._sync.load_acquire(peer.ctrl.data_ptr() + self._posted_off(self.rank))) < seq:
                    if peer.alive():
                        left.append((q, nbytes))  # not posted yet: try again at a later post
                    continue
                _, by_slot = self._payload(q, torch.empty(nbytes, dtype=torch.uint8, device="cpu"), grp, seq)
                if by_slot:
                    self._acknowledge(seq, [q])
            if left:
                keep.append((seq, left, grp))
        self._abandoned = keep

    def flush(self, timeout: float) -> int:
        """Wait (at most ``timeout`` seconds in all) for this rank's gloo sends still in flight (a peer
        receives them only when it reads the exchange, so a rank that is done must not exit before),
        while receiving the gloo parts of exchanges this rank dropped unwaited (so its peers' sends
        complete too: two ranks flushing at exit never wait for each other). Returns how many sends were
        left undelivered (0 normally)."""
        deadline = time.monotonic() + timeout
        while self._abandoned and time.monotonic() < deadline:  # first: peers' parts (they posted at launch)
            try:
                self._drain_abandoned()
            except DistributedError as exc:  # a peer is gone: what it posted can no longer be received
                log.warning("shared-memory exchange: could not drain an unwaited exchange: %s", exc)
                self._abandoned = []
            if self._abandoned:
                time.sleep(0.01)  # a peer has not launched that exchange yet
        while self._sends:
            w = self._sends[0][0]
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
        """Wait for this rank's gloo sends, unmap every segment (its and its peers'); unusable afterwards."""
        self.flush(60.0)
        self._sends.clear()
        self._ring.clear()
        for p in self.peers:
            if p is not None:
                p.close()
        self.outbox.close()
        self.control.close()
        self.extents = []

    def __repr__(self) -> str:
        return (
            f"ShmChannel(rank={self.rank}, world={self.world}, outbox={self.outbox.size}, "
            f"shm_bytes={self.shm_bytes}, tcp_bytes={self.tcp_bytes}, posted={self._posted})"
        )


class _Arrival:
    """Waits for rank ``q`` to post exchange ``seq`` (a work handle: ``wait(timeout)``, ``is_completed()``)."""

    __slots__ = ("_channel", "_q", "_seq")

    def __init__(self, channel: ShmChannel, q: int, seq: int) -> None:
        self._channel = channel
        self._q = q
        self._seq = seq

    def is_completed(self) -> bool:
        ch = self._channel
        addr = ch._peer(self._q).ctrl.data_ptr() + ch._posted_off(ch.rank)
        return int(ch._sync.load_acquire(addr)) >= self._seq

    def wait(self, timeout: Any = None) -> bool:
        """Block until posted; ``timeout`` (a timedelta or seconds) bounds the wait.

        Raises:
            DistributedError: the peer exited without posting, or the timeout passed.
        """
        self._channel._await(self._q, self._seq, _seconds(timeout))
        return True


class Exchange:
    """One launched exchange: wait :attr:`works`, read each peer's payload, then :meth:`done`.

    Dropped without :meth:`done` (a work never waited), it is acknowledged and drained later, so it holds
    no region and desynchronises nothing.

    Attributes:
        works: one handle per peer, complete once that peer posted its payload.
    """

    __slots__ = ("_channel", "_seq", "works", "_grp", "_by_slot", "_expect", "_finished", "__weakref__")

    def __init__(self, channel: ShmChannel, seq: int, grp: Any, expect: list[tuple[int, int]]) -> None:
        self._channel = channel
        self._seq = seq
        self.works = [_Arrival(channel, q, seq) for q in range(channel.world) if q != channel.rank]
        self._grp = grp
        self._by_slot: list[int] = []
        self._expect = expect
        self._finished = False

    def payload(self, q: int, like: torch.Tensor) -> torch.Tensor:
        """Rank ``q``'s payload as a flat tensor of ``like``'s element count and dtype: a read-only view of
        the peer's outbox, valid until :meth:`done` (or a temporary received by gloo). Call once per peer.

        Raises:
            DistributedError: the peer sent another size (the ranks launched different collectives).
        """
        out, by_slot = self._channel._payload(q, like, self._grp, self._seq)
        self._expect = [e for e in self._expect if e[0] != q]  # read: nothing left to drain from q
        if by_slot:
            self._by_slot.append(q)
        return out

    def done(self) -> None:
        """Mark the payloads read: acknowledged to the peers that posted through their slot, which may
        then reuse the slot and the region."""
        self._channel._acknowledge(self._seq, self._by_slot)
        self._by_slot = []
        self._finished = True

    def __del__(self) -> None:
        if not self._finished:
            try:
                if self._by_slot:  # read but not acknowledged (the finishing step raised)
                    self._channel._acknowledge(self._seq, self._by_slot)
                if self._expect:
                    self._channel._abandon(self._seq, self._expect, self._grp)
            except Exception:  # noqa: BLE001 - never raise from a finaliser
                pass

