"""``deepspeed.comm.reduce_op``: DeepSpeed's :class:`ReduceOp` Enum (every ``deepspeed.comm`` reducing call, and
:func:`dscore.comm.reduce_op`, maps its members by name onto ``torch.distributed.ReduceOp``)."""

from __future__ import annotations

from enum import Enum

__all__ = ["ReduceOp"]


class ReduceOp(Enum):
    """DeepSpeed's reduce operations (its own Enum, values as DeepSpeed's); ``UNUSED`` is refused."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    AVG = 7
    UNUSED = 8
