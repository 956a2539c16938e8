"""``deepspeed.launcher``: ``runner`` (the ``deepspeed`` command, which is ``dscore run``)."""

from __future__ import annotations

__all__ = ["runner"]
