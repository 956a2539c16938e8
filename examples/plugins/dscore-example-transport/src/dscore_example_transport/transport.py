"""The ``counting`` transport: records each collective's bytes and runs it on the transport below it.

Every facade builds one (:func:`make_transport`); the record is per process (:func:`counts`), like the
default process group. Shapes and semantics are the :class:`dscore.protocols.transport.Transport`
contract's: whatever the delegate computes is returned unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from dscore.comm import Work
from dscore.protocols.transport import Transport, TransportContext

__all__ = ["CountingTransport", "counts", "make_transport", "reset"]

_lock = threading.Lock()
_counts: dict[str, dict[str, Any]] = {}


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _record(op: str, nbytes: int, via: str) -> None:
    with _lock:
        row = _counts.setdefault(op, {"calls": 0, "bytes": 0, "via": {}})
        row["calls"] += 1
        row["bytes"] += nbytes
        row["via"][via] = row["via"].get(via, 0) + 1


def counts() -> dict[str, dict[str, Any]]:
    """``{op: {"calls": n, "bytes": b, "via": {transport name: n}}}`` for this process: ``b`` is the bytes
    this rank handed in (the all-reduced tensor, every reduce-scatter chunk, the gathered ``src``)."""
    with _lock:
        return {op: {"calls": r["calls"], "bytes": r["bytes"], "via": dict(r["via"])} for op, r in _counts.items()}


def reset() -> None:
    """Forget the record."""
    with _lock:
        _counts.clear()


class CountingTransport:
    """Accepts every call the facade offers; runs it on ``ctx.delegate(...)``'s transport.

    Args:
        ctx: the factory's context (its ``delegate`` finds the transport that would have run the call).
    """

    name = "counting"

    def __init__(self, ctx: TransportContext) -> None:
        self._ctx = ctx

    def accepts(self, op: str, group: Any, tensors: Sequence[torch.Tensor]) -> bool:
        """True: every call is counted (the delegate decides where it runs)."""
        return True

    def _below(self, op: str, group: Any, tensors: Sequence[torch.Tensor], nbytes: int) -> Transport:
        inner = self._ctx.delegate(op, group, tensors)
        _record(op, nbytes, inner.name)
        return inner

    def all_reduce(self, flat: torch.Tensor, rop: Any, grp: Any, async_op: bool) -> Work | None:
        """Count ``flat``'s bytes, then the delegate's all-reduce."""
        return self._below("all_reduce", grp, [flat], _nbytes([flat])).all_reduce(flat, rop, grp, async_op)

    def reduce_scatter(self, chunks: list[torch.Tensor], output: torch.Tensor, rop: Any, grp: Any,
                       async_op: bool) -> Work | None:
        """Count every chunk's bytes, then the delegate's reduce-scatter."""
        inner = self._below("reduce_scatter", grp, [output, *chunks], _nbytes(chunks))
        return inner.reduce_scatter(chunks, output, rop, grp, async_op)

    def all_gather(self, src: torch.Tensor, outs: Sequence[torch.Tensor], grp: Any, async_op: bool) -> Work | None:
        """Count ``src``'s bytes, then the delegate's all-gather."""
        return self._below("all_gather", grp, [src, *outs], _nbytes([src])).all_gather(src, outs, grp, async_op)

    def flush(self, timeout: float) -> int:
        """0: this transport launches nothing of its own (its delegates flush theirs)."""
        return 0


def make_transport(ctx: TransportContext) -> CountingTransport:
    """The ``counting`` unit's factory."""
    return CountingTransport(ctx)
