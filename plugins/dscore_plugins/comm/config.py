"""The ``comms_logger`` section (torch-free; DeepSpeed 0.19.8 defaults)."""

from __future__ import annotations

from pydantic import Field, field_validator

from dscore.config.base import SectionModel
from dscore_plugins.comm.comms_logger import LOGGED_OPS

__all__ = ["CommsLoggerConfig"]


class CommsLoggerConfig(SectionModel):
    """``comms_logger``: record the count, size, latency and bandwidth of collectives
    (:mod:`dscore_plugins.comm.comms_logger`); ``engine.print_comms_summary()`` / ``dscore.comm.log_summary()``
    print the table."""

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

    @field_validator("prof_ops")
    @classmethod
    def _known_ops(cls, value: list[str]) -> list[str]:
        unknown = sorted(set(value) - LOGGED_OPS)
        if unknown:
            raise ValueError(f"unknown collective(s) {unknown}; recorded collectives: {sorted(LOGGED_OPS)}")
        return value
