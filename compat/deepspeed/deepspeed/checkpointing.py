"""``deepspeed.checkpointing`` (activation checkpointing) on :mod:`dscore.checkpointing`."""

from __future__ import annotations

from dscore.checkpointing import *  # noqa: F401,F403
from dscore.checkpointing import __all__  # noqa: F401
