"""Profilers: the flops profiler (:mod:`dscore.profiling.flops_profiler`, thin names over the built-in
``profiling`` plugin).

Nothing is imported here (``import dscore.profiling`` stays torch-free); import the submodule.
"""

from __future__ import annotations

__all__: list[str] = []
