"""Rank-aware logging helpers for the engine.

DeepSpeed prints progress only on rank 0 (``log_dist(..., ranks=[0])``). dscore uses :mod:`logging`:
:func:`get_logger` returns a standard logger (``dscore.<name>``) and :func:`log_rank0` emits a record only
on the given rank, prefixed with ``[rank N]`` so interleaved multi-process output stays readable.
Nothing here configures handlers; applications (and the examples) call :func:`logging.basicConfig`.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["get_logger", "log_rank0"]


def get_logger(name: str) -> logging.Logger:
    """The logger ``dscore.<name>`` (``name`` may already start with ``dscore.``)."""
    return logging.getLogger(name if name.startswith("dscore") else f"dscore.{name}")


def log_rank0(logger: logging.Logger, rank: int, msg: str, *args: Any, level: int = logging.INFO) -> None:
    """Log ``msg % args`` at ``level`` only when ``rank == 0``, prefixed with the rank."""
    if rank == 0 and logger.isEnabledFor(level):
        logger.log(level, "[rank %d] " + msg, rank, *args)
