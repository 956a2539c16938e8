"""Manifest of the built-in profiling plugin: the ``flops_profiler`` section and its engine hooks.

The section's spec also carries the flops profiler's user-facing names (``exports``): the thin module
``dscore.profiling.flops_profiler`` resolves ``FlopsProfiler``, ``get_model_profile``, ... through it.

The hooks only import :mod:`dscore_plugins.profiling.engine_profiler` (which imports torch) when an
engine is created with ``flops_profiler.enabled``.
"""

from __future__ import annotations

from typing import Any

from dscore import hookimpl
from dscore.specs import ConfigSectionSpec

__all__ = ["dscore_after_optimizer_step", "dscore_engine_created", "dscore_register_config_sections"]


@hookimpl
def dscore_register_config_sections() -> list[ConfigSectionSpec]:
    """The ``flops_profiler`` section (model in :mod:`dscore_plugins.profiling.config`); its ``exports``
    (:mod:`dscore_plugins.profiling.exports`) are what ``dscore.profiling.flops_profiler`` re-exports."""
    return [
        ConfigSectionSpec(
            name="flops_profiler",
            model="dscore_plugins.profiling.config:FlopsProfilerConfig",
            description="per-module params, MACs, flops and latency of one training step (rank 0)",
            exports="dscore_plugins.profiling.exports",
        )
    ]


@hookimpl
def dscore_engine_created(engine: Any) -> None:
    """Attach the flops profiler to ``engine`` when ``flops_profiler.enabled`` (global rank 0 only)."""
    section = engine.config.section("flops_profiler", None)
    if section is None or not section.enabled:
        return
    from dscore_plugins.profiling.engine_profiler import attach

    attach(engine, section)


@hookimpl
def dscore_after_optimizer_step(engine: Any, step_applied: bool) -> None:
    """Print and end the profile after the profiled step (``global_steps`` was ``profile_step``)."""
    profiler = getattr(engine, "flops_profiler", None)
    if profiler is None:
        return
    from dscore_plugins.profiling.engine_profiler import after_step

    after_step(engine)
