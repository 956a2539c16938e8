"""The few collectives a save or load needs, and how ranks agree on success or failure.

Every phase of a save/load that can fail on one rank ends with :meth:`Collectives.agree`: each rank
contributes its outcome (None or an error) through one ``all_gather_object`` and, when any rank failed,
every rank raises the same error. So a failure on rank 1 (disk full, bad client state) is an error on all
ranks instead of a hang of the others in the next collective.
"""

from __future__ import annotations

import logging
from typing import Any

from dscore.errors import CheckpointError, CheckpointNotFoundError, DscoreError

__all__ = ["Collectives", "RankFailure"]

logger = logging.getLogger("dscore.checkpoint")

_ERROR_TYPES: dict[str, type[Exception]] = {
    "CheckpointNotFoundError": CheckpointNotFoundError,
    "CheckpointError": CheckpointError,
}


class RankFailure:
    """A picklable description of one rank's failure."""

    def __init__(self, exc: BaseException) -> None:
        self.type_name = type(exc).__name__ if type(exc).__name__ in _ERROR_TYPES else "CheckpointError"
        self.own = isinstance(exc, DscoreError)
        self.message = str(exc) if self.own else f"{type(exc).__name__}: {exc}"


class Collectives:
    """Rank, world size and object all-gather over the engine's process group.

    Uses the runtime's comm facade (:class:`dscore.comm.Comm`: ``get_rank()``, ``get_world_size()``,
    ``all_gather_object(obj) -> list``) when given and initialised, otherwise ``torch.distributed``'s
    default group when it is initialised, otherwise a single process (rank 0 of 1).
    """

    def __init__(self, comm: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist if dist.is_available() and dist.is_initialized() else None
        usable = comm is not None and all(
            callable(getattr(comm, n, None)) for n in ("get_rank", "get_world_size", "all_gather_object")
        )
        is_init = getattr(comm, "is_initialized", None)
        if usable and callable(is_init) and not is_init():
            usable = False
        self._comm = comm if usable else None
        if self._comm is not None:
            self.rank = int(self._comm.get_rank())
            self.world_size = int(self._comm.get_world_size())
        elif self._dist is not None:
            self.rank = self._dist.get_rank()
            self.world_size = self._dist.get_world_size()
        else:
            self.rank, self.world_size = 0, 1

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (picklable objects; small)."""
        if self.world_size == 1:
            return [obj]
        if self._comm is not None:
            return list(self._comm.all_gather_object(obj))
        assert self._dist is not None
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj)
        return out

    def agree(self, error: BaseException | None, what: str, payload: Any = None) -> list[Any]:
        """All-gather ``(failure, payload)``; raise on every rank when any rank failed.

        Args:
            error: this rank's exception in the phase, or None.
            what: the phase, for the message ("writing the checkpoint files").
            payload: picklable data to share with the other ranks on success.

        Returns:
            every rank's ``payload`` in rank order.

        Raises:
            CheckpointError / CheckpointNotFoundError: one or more ranks failed; the message names each
                failing rank and its error (the local exception is chained when this rank failed).
        """
        mine = (RankFailure(error) if error is not None else None, payload)
        gathered = self.all_gather(mine)
        failures = [(r, f) for r, (f, _) in enumerate(gathered) if f is not None]
        if failures:
            if len(failures) == 1 or all(f.message == failures[0][1].message for _, f in failures):
                r0, f0 = failures[0]
                where = (
                    ""
                    if self.world_size == 1
                    else (f" (on rank {r0})" if len(failures) == 1 else f" (on ranks {[r for r, _ in failures]})")
                )
                message = f"{f0.message}{where}" if f0.own else f"{what} failed{where}: {f0.message}"
            else:
                message = f"{what} failed on {len(failures)} rank(s): " + "; ".join(
                    f"rank {r}: {f.message}" for r, f in failures
                )
            cls = _ERROR_TYPES.get(failures[0][1].type_name, CheckpointError)
            raise cls(message) from error
        return [p for _, p in gathered]
