"""``deepspeed.ops.aio``: ``AsyncIOBuilder``, DeepSpeed's builder of the ``async_io`` op (kernel AIO for NVMe
offload), here :class:`deepspeed.ops.op_builder.AsyncIOBuilder` over dscore's ``async_io`` op builder."""

from __future__ import annotations

from deepspeed.ops.op_builder import AsyncIOBuilder

__all__ = ["AsyncIOBuilder"]
