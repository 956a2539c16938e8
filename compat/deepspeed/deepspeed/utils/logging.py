"""``deepspeed.utils.logging``: ``logger`` (dscore's root logger), ``log_dist`` and DeepSpeed's level-name helpers
(``log_levels``, ``get_log_level_from_string``, ``set_log_level_from_string``, ``get_current_level``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

__all__ = ["get_current_level", "get_log_level_from_string", "log_dist", "log_levels", "logger",
           "set_log_level_from_string"]

logger = logging.getLogger("dscore")


def log_dist(message: str, ranks: Sequence[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the listed global ranks (None or ``[-1]``: every rank), as DeepSpeed's ``log_dist``."""
    rank = _rank()
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, "[Rank %d] %s", rank, message)


#: DeepSpeed's level names (lower case) and their :mod:`logging` levels.
log_levels = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
              "critical": logging.CRITICAL}


def get_log_level_from_string(log_level_str: str) -> int:
    """The :mod:`logging` level of a name of :data:`log_levels` (any case).

    Raises:
        ValueError: an unknown name (the message lists the valid ones), as DeepSpeed.
    """
    level = log_levels.get(str(log_level_str).lower())
    if level is None:
        raise ValueError(f"log level {log_level_str!r} is not one of the valid logging levels {sorted(log_levels)}")
    return level


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None) -> None:
    """Set ``custom_logger`` (default: :data:`logger`, dscore's) and each of its handlers to the level named
    ``log_level_str`` (``"info"`` -> ``logging.INFO``).

    Raises:
        ValueError: an unknown level name.
    """
    level = get_log_level_from_string(log_level_str)
    target = logger if custom_logger is None else custom_logger
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def get_current_level() -> int:
    """The effective level of :data:`logger`."""
    return logger.getEffectiveLevel()


def _rank() -> int:
    try:
        import torch.distributed as dist

        return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0
    except Exception:  # noqa: BLE001 - logging must not fail
        return 0


def __getattr__(name: str) -> Any:
    raise AttributeError(f"deepspeed.utils.logging.{name} is not provided by dscore's compatibility layer")
