"""Profilers: the flops profiler (:mod:`dscore.profiling.flops_profiler`).

Nothing is imported here (``import dscore.profiling`` stays torch-free); import the submodule.
"""

from __future__ import annotations

__all__: list[str] = []
