"""The ``comms_logger`` section (torch-free; DeepSpeed 0.19.8 defaults)."""

from __future__ import annotations

from pydantic import Field

from dscore.config.base import SectionModel

__all__ = ["CommsLoggerConfig"]


class CommsLoggerConfig(SectionModel):
    """``comms_logger``: record the size and latency of collectives."""

    enabled: bool = False
    """Record collectives."""
    prof_all: bool = True
    """Record every collective (false: only those in ``prof_ops``)."""
    prof_ops: list[str] = Field(default_factory=list)
    """Names of the collectives to record when ``prof_all`` is false (``"all_reduce"``, ...)."""
    verbose: bool = False
    """Log every recorded collective as it happens."""
    debug: bool = False
    """Include the calling function in records."""
