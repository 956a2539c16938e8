"""The ``aio`` section: tuning of the ``async_io`` op (kernel AIO through libaio) used for NVMe offload.

Defaults are DeepSpeed 0.19.8's (``deepspeed/runtime/swap_tensor/constants.py`` and ``aio_config.py``):
``block_size`` 1048576, ``queue_depth`` 8, ``intra_op_parallelism`` 1, ``single_submit`` false,
``overlap_events`` true, ``use_gds`` false. Older DeepSpeed spelled ``intra_op_parallelism`` as
``thread_count``; that spelling is migrated with a warning.

Differences from DeepSpeed, all on the side of refusing what would not work: unknown keys are an error
(DeepSpeed ignores them), ``block_size`` must be a multiple of 4096 (the ``O_DIRECT`` alignment the op
uses), and ``use_gds: true`` is refused (GPUDirect Storage is not implemented: the op moves host memory).

The registered section configures every :class:`dscore_plugins.ops.aio.AsyncIOHandle` built with
``from_config``: the swap-file I/O of ZeRO's NVMe offload (``offload_optimizer`` / ``offload_param`` with
``device: nvme``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import Field, field_validator

from dscore.config.base import PositiveInt, SectionModel, not_implemented
from dscore.errors import ConfigError

__all__ = ["AioConfig", "AIO_ALIGNMENT"]

#: Alignment (bytes) of O_DIRECT transfers in the async_io op; ``block_size`` must be a multiple of it.
AIO_ALIGNMENT = 4096


class AioConfig(SectionModel):
    """``aio``: how the async_io op submits reads and writes of swap files."""

    block_size: PositiveInt = 1048576
    """Bytes per I/O request submitted to the kernel (a multiple of 4096)."""
    queue_depth: PositiveInt = 8
    """Requests each submitting thread keeps in flight."""
    intra_op_parallelism: PositiveInt = 1
    """Threads one read or write is split across (legacy name ``thread_count``)."""
    single_submit: bool = False
    """Submit requests to the kernel one at a time instead of in batches."""
    overlap_events: bool = True
    """Submit new requests as earlier ones complete, instead of submitting a batch and reaping all of it."""
    use_gds: bool = Field(default=False, json_schema_extra=not_implemented("GPUDirect Storage"))
    """GPUDirect Storage; refused when true (dscore's async_io op transfers host memory only)."""

    @field_validator("block_size")
    @classmethod
    def _aligned(cls, value: int) -> int:
        if value % AIO_ALIGNMENT:
            raise ValueError(
                f"must be a multiple of {AIO_ALIGNMENT} (the O_DIRECT alignment), got {value}; "
                f"e.g. {max(AIO_ALIGNMENT, value // AIO_ALIGNMENT * AIO_ALIGNMENT)}"
            )
        return value

    @field_validator("use_gds")
    @classmethod
    def _no_gds(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "GPUDirect Storage is not supported: dscore's async_io op reads and writes host memory "
                "through libaio; set use_gds to false"
            )
        return value

    @classmethod
    def migrate_legacy(cls, value: Any, *, root: dict[str, Any], warn: Callable[[str], None]) -> Any:
        """Rename ``thread_count`` to ``intra_op_parallelism`` (with a warning).

        Raises:
            ConfigError: both spellings are given (``aio.thread_count``).
        """
        if value is None:  # DeepSpeed reads a null block as the defaults
            return {}
        if isinstance(value, dict) and "thread_count" in value:
            if "intra_op_parallelism" in value:
                raise ConfigError(
                    "aio.thread_count: the legacy spelling of aio.intra_op_parallelism; give only one of them",
                    path="aio.thread_count",
                )
            value = dict(value)
            value["intra_op_parallelism"] = value.pop("thread_count")
            warn("'aio.thread_count' is deprecated; use 'aio.intra_op_parallelism' (migrated)")
        return value
