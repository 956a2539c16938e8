"""``deepspeed.utils.logging``: ``logger`` (dscore's root logger) and ``log_dist``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

__all__ = ["log_dist", "logger"]

logger = logging.getLogger("dscore")


def log_dist(message: str, ranks: Sequence[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the listed global ranks (None or ``[-1]``: every rank), as DeepSpeed's ``log_dist``."""
    rank = _rank()
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, "[Rank %d] %s", rank, message)


def _rank() -> int:
    try:
        import torch.distributed as dist

        return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0
    except Exception:  # noqa: BLE001 - logging must not fail
        return 0


def __getattr__(name: str) -> Any:
    raise AttributeError(f"deepspeed.utils.logging.{name} is not provided by dscore's compatibility layer")
