"""``deepspeed.profiling.flops_profiler`` on :mod:`dscore.profiling.flops_profiler`."""

from __future__ import annotations

from dscore.profiling.flops_profiler import FlopsProfiler, get_model_profile

__all__ = ["FlopsProfiler", "get_model_profile"]
