"""The work handle every asynchronous collective of :class:`dscore.comm.Comm` returns."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["Work", "DONE", "launched"]


class Work:
    """An asynchronous collective (or several launched together) and the step that finishes it.

    ``wait(timeout)`` waits for every underlying handle (torch works, shared-memory arrivals; ``timeout``,
    a ``timedelta``, is passed to each), then runs ``finish`` (e.g. summing received payloads, copying this
    rank's slice out of an all-reduced buffer, dividing for an emulated average) exactly once; later calls
    return at once. A ``Work`` with nothing pending runs ``finish`` immediately. A wait that raises (a
    timeout, a dead peer) leaves the work waitable again.

    Everything a collective exchanges is launched before its ``Work`` exists: waiting only completes, so
    any wait order, and works never waited, leave later collectives right.

    Args:
        works: handles with ``wait([timeout])`` (``None`` entries are ignored).
        finish: a no-argument callable run once everything completed, or None.
    """

    __slots__ = ("_works", "_finish")

    def __init__(self, works: Iterable[Any] = (), finish: Callable[[], Any] | None = None) -> None:
        self._works = [w for w in works if w is not None]
        self._finish = finish
        if not self._works and finish is not None:
            finish()
            self._finish = None

    def wait(self, timeout: Any = None) -> bool:
        """Wait for the collective(s), then run the finishing step once; returns True.

        Raises:
            DistributedError: a shared-memory peer exited or stayed silent past the timeout.
            RuntimeError: torch's own work failed (as ``torch.distributed`` raises it).
        """
        while self._works:
            w = self._works[0]
            if timeout is None:
                w.wait()
            else:
                w.wait(timeout)
            self._works.pop(0)
        if self._finish is not None:
            fin, self._finish = self._finish, None
            fin()
        return True

    def is_completed(self) -> bool:
        """True once :meth:`wait` returned (or when nothing was pending)."""
        return not self._works and self._finish is None


DONE = Work()


def launched(works: list[Any], async_op: bool, finish: Callable[[], Any] | None = None) -> Work | None:
    """Transfers already started: their :class:`Work` (async), or None once waited and finished (sync)."""
    work = Work(works, finish)
    if async_op:
        return work
    work.wait()
    return None
