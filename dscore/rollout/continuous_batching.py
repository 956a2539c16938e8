"""Slot scheduling for continuous-batching rollouts (DeepSpeed 0.19.8's ``continuous_batching`` semantics).

A FIFO of requests fills at most ``max_batch_size`` decode slots; every decode step (:meth:`advance`) counts one
token for each active request and retires those that reached ``max_new_tokens`` or were reported finished
(EOS); freed slots are refilled from the queue at once. Survivors keep their order (``keep_slots`` indexes the
previous active list) and admitted requests take the rows after them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from dscore.errors import RolloutError

__all__ = ["ContinuousBatchRequest", "ContinuousBatchScheduler", "ContinuousBatchUpdate"]


@dataclass(frozen=True)
class ContinuousBatchRequest:
    """A request waiting for (or holding) a decode slot."""

    request_id: Hashable


@dataclass(frozen=True)
class ContinuousBatchUpdate:
    """One scheduler transition.

    Attributes:
        active: the requests holding slots now, in row order.
        keep_slots: rows of the previous active list that survive (compact the KV cache with these).
        retired: ids of the requests that left.
        admitted: the requests that joined (they hold the last rows).
    """

    active: tuple[ContinuousBatchRequest, ...]
    keep_slots: tuple[int, ...]
    retired: tuple[Hashable, ...]
    admitted: tuple[ContinuousBatchRequest, ...]

    @property
    def active_ids(self) -> tuple[Hashable, ...]:
        """Ids of :attr:`active`."""
        return tuple(r.request_id for r in self.active)

    @property
    def admitted_slots(self) -> tuple[int, ...]:
        """The rows the admitted requests occupy (to prefill)."""
        first = len(self.active) - len(self.admitted)
        return tuple(range(first, len(self.active)))


class ContinuousBatchScheduler:
    """FIFO admission into ``max_batch_size`` slots with a shared ``max_new_tokens`` budget.

    Raises:
        RolloutError: a non-positive size or budget.
    """

    def __init__(self, max_batch_size: int, max_new_tokens: int) -> None:
        if max_batch_size <= 0:
            raise RolloutError(f"ContinuousBatchScheduler: max_batch_size must be positive; got {max_batch_size}")
        if max_new_tokens <= 0:
            raise RolloutError(f"ContinuousBatchScheduler: max_new_tokens must be positive; got {max_new_tokens}")
        self.max_batch_size = max_batch_size
        self.max_new_tokens = max_new_tokens
        self._queue: deque[ContinuousBatchRequest] = deque()
        self._slots: list[ContinuousBatchRequest] = []
        self._tokens: dict[Hashable, int] = {}
        self._ids: set[Hashable] = set()

    @property
    def active(self) -> tuple[ContinuousBatchRequest, ...]:
        """Requests holding slots, in row order."""
        return tuple(self._slots)

    @property
    def pending(self) -> tuple[ContinuousBatchRequest, ...]:
        """Requests waiting, in arrival order."""
        return tuple(self._queue)

    def submit(self, request: ContinuousBatchRequest) -> None:
        """Queue ``request``.

        Raises:
            TypeError: not a :class:`ContinuousBatchRequest`.
            RolloutError: its id is already queued or active.
        """
        if not isinstance(request, ContinuousBatchRequest):
            raise TypeError(f"submit() takes a ContinuousBatchRequest; got {type(request).__name__}")
        if request.request_id in self._ids:
            raise RolloutError(f"ContinuousBatchScheduler.submit: duplicate request_id {request.request_id!r}")
        self._ids.add(request.request_id)
        self._queue.append(request)

    def _check_active(self, finished_ids: Iterable[Hashable]) -> set[Hashable]:
        finished = set(finished_ids)
        stray = finished - {r.request_id for r in self._slots}
        if stray:
            raise RolloutError(f"ContinuousBatchScheduler: finished request {next(iter(stray))!r} is not active")
        return finished

    def schedule(self, finished_ids: Iterable[Hashable] = ()) -> ContinuousBatchUpdate:
        """Retire ``finished_ids`` and fill free slots from the queue (no token is counted).

        Raises:
            RolloutError: a finished id that is not active.
        """
        finished = self._check_active(finished_ids)
        keep = tuple(i for i, r in enumerate(self._slots) if r.request_id not in finished)
        retired = tuple(r.request_id for r in self._slots if r.request_id in finished)
        slots = [self._slots[i] for i in keep]
        admitted: list[ContinuousBatchRequest] = []
        while self._queue and len(slots) < self.max_batch_size:
            r = self._queue.popleft()
            admitted.append(r)
            slots.append(r)
            self._tokens[r.request_id] = 0
        self._slots = slots
        for rid in retired:
            self._tokens.pop(rid, None)
            self._ids.discard(rid)
        return ContinuousBatchUpdate(tuple(slots), keep, retired, tuple(admitted))

    def advance(self, finished_ids: Iterable[Hashable] = ()) -> ContinuousBatchUpdate:
        """One decode step: count a token for every active request, retire those at the budget or in
        ``finished_ids``, then :meth:`schedule`.

        Raises:
            RolloutError: a finished id that is not active.
        """
        finished = self._check_active(finished_ids)
        for r in self._slots:
            self._tokens[r.request_id] += 1
            if self._tokens[r.request_id] >= self.max_new_tokens:
                finished.add(r.request_id)
        return self.schedule(finished)
