"""``deepspeed.launcher``: ``runner`` (the ``deepspeed`` command, which is ``dscore run``) and ``launch`` (the per-node launcher, :mod:`dscore.launcher.node`)."""

from __future__ import annotations

__all__ = ["launch", "runner"]
