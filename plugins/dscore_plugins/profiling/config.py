"""The ``flops_profiler`` section (torch-free; DeepSpeed 0.19.8 keys and defaults)."""

from __future__ import annotations

from pydantic import Field

from dscore.config.base import SectionModel

__all__ = ["FlopsProfilerConfig"]


class FlopsProfilerConfig(SectionModel):
    """``flops_profiler``: profile one training step's forward on global rank 0 and print the report.

    Enabling it also turns on ``wall_clock_breakdown`` (as DeepSpeed does): the report's backward and step
    latencies come from the engine's phase timers.
    """

    enabled: bool = False
    """Profile the forward of step ``profile_step`` on global rank 0."""
    recompute_fwd_factor: float = Field(0.0, ge=0.0)
    """Forward passes recomputed in backward (activation checkpointing: 1.0); the backward flops are
    estimated as ``(2 + recompute_fwd_factor) x`` the forward flops."""
    profile_step: int = Field(1, ge=0)
    """The value of ``engine.global_steps`` whose forward passes are profiled (0 = the first step)."""
    module_depth: int = Field(-1, ge=-1)
    """Deepest level listed in the aggregated profile; -1 lists every level but the innermost (DeepSpeed)."""
    top_modules: int = Field(1, ge=1)
    """Module classes listed per level of the aggregated profile."""
    detailed: bool = True
    """Append the module tree with every module's params, MACs, latency and FLOPS."""
    output_file: str | None = None
    """Write the report to this file (its folder is created) instead of standard output."""
