"""The ``freeze`` section (torch-free)."""

from __future__ import annotations

from pydantic import Field

from dscore.config.base import SectionModel

__all__ = ["FreezeConfig"]


class FreezeConfig(SectionModel):
    """``freeze``: parameters to freeze before the optimizer is built."""

    enabled: bool = False
    """Run the transform."""
    patterns: list[str] = Field(default_factory=list)
    """``fnmatch`` patterns matched against full parameter names (``0.weight``, ``encoder.*.bias``)."""

