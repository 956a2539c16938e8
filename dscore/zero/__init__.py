"""User-facing ZeRO helpers: ``dscore.zero.Init`` and ``dscore.zero.GatheredParameters``.

``import dscore; dscore.zero.Init`` loads this package lazily (it imports torch). The storage model
shared with the stage-3 plugin lives in :mod:`dscore.zero.partition`.
"""

from __future__ import annotations

from dscore.zero.init import GatheredParameters, Init
from dscore.zero.partition import FlatUnit, is_partitioned, unit_of

__all__ = ["Init", "GatheredParameters", "FlatUnit", "is_partitioned", "unit_of"]
