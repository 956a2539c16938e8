"""The flops profiler inside a training run (DeepSpeed 0.19.8's engine integration).

On global rank 0, every forward through the engine while ``engine.global_steps == profile_step`` is
profiled (each restarts the counts, so with gradient accumulation the report shows the last micro batch,
as DeepSpeed's); the step that ends that window prints the report (``profile_step`` in the header)
with the forward, backward and step latencies of the whole window from the engine's phase timers, then
the profiler is removed. As DeepSpeed 0.19.8, the header names the step count after that step
(``Profile Summary at step 3`` for ``profile_step: 2``). ``engine.flops_profiler`` is the :class:`FlopsProfiler` on every rank
(DeepSpeed's attribute), so user code may also drive it by hand.
"""

from __future__ import annotations

import logging
from typing import Any

from dscore.errors import ConfigError
from dscore_plugins.profiling.profiler import FlopsProfiler

__all__ = ["attach", "after_step"]

log = logging.getLogger("dscore_plugins.profiling")

# the attribute of the engine holding the profile run (rank 0, until the report is printed)
_RUN_ATTR = "dscore_flops_profile_run"


class _ProfileRun:
    """Trigger hooks on the engine and the state of the one profiled step."""

    def __init__(self, engine: Any, section: Any, profiler: FlopsProfiler) -> None:
        self.section = section
        self.profiler = profiler
        self.window_start: dict[str, float] | None = None
        self.done = False
        # on the engine (not its module): the profiler's own hooks are in place before the module runs
        self.handles = [
            engine.register_forward_pre_hook(self._before_forward),
            engine.register_forward_hook(self._after_forward),
        ]

    def _active(self, engine: Any) -> bool:
        return not self.done and int(engine.global_steps) == int(self.section.profile_step)

    def _before_forward(self, engine: Any, inputs: Any) -> None:
        if not self._active(engine):
            return
        if self.window_start is None:
            timers = engine.phase_timers
            self.window_start = timers.lifetime_totals() if timers is not None else {}
        self.profiler.start_profile(ignore_list=None)

    def _after_forward(self, engine: Any, inputs: Any, output: Any) -> None:
        if self.profiler.func_patched:
            self.profiler.stop_profile()

    def finish(self, engine: Any) -> None:
        """Print the report (the profiled step just ended) and remove every hook."""
        profiler = self.profiler
        timers = engine.phase_timers
        if timers is not None and self.window_start is not None:
            now = timers.lifetime_totals()
            profiler.engine_latencies = {
                phase: now.get(phase, 0.0) - self.window_start.get(phase, 0.0)
                for phase in ("forward", "backward", "step")
            }
        section = self.section
        try:
            profiler.print_model_profile(
                # DeepSpeed 0.19.8 prints global_steps after the increment (profile_step + 1): kept so logs
                # compare line for line
                profile_step=int(engine.global_steps),
                module_depth=section.module_depth,
                top_modules=section.top_modules,
                detailed=section.detailed,
                output_file=section.output_file,
            )
        finally:
            profiler.end_profile()
            self.close()

    def close(self) -> None:
        self.done = True
        for handle in self.handles:
            handle.remove()
        self.handles = []


def attach(engine: Any, section: Any) -> None:
    """Give ``engine`` its ``flops_profiler`` and, on global rank 0, the hooks that run it.

    Args:
        engine: a dscore engine (needs ``module``, ``global_steps``, ``global_rank``, ``phase_timers``).
        section: the validated ``flops_profiler`` block.

    Raises:
        ConfigError: the engine lacks what the profiler reads (an engine plugin without DeepSpeed's counters).
    """
    missing = [name for name in ("module", "global_steps", "global_rank", "phase_timers") if not hasattr(engine, name)]
    if missing:
        raise ConfigError(
            f"flops_profiler.enabled: the {type(engine).__name__} engine has no {', '.join(missing)}; the flops "
            "profiler runs with the standard engine (set flops_profiler.enabled to false)"
        )
    accelerator = engine.runtime.accelerator
    profiler = FlopsProfiler(
        engine.module, ds_engine=engine, recompute_fwd_factor=section.recompute_fwd_factor,
        synchronize=accelerator.synchronize,
    )  # fmt: skip
    engine.flops_profiler = profiler
    if int(engine.global_rank) == 0:
        setattr(engine, _RUN_ATTR, _ProfileRun(engine, section, profiler))
        log.info("flops profiler: profiling step %d on rank 0", section.profile_step)


def after_step(engine: Any) -> None:
    """Called after every optimizer step: print the report when the profiled step has just ended."""
    run = engine.__dict__.get(_RUN_ATTR)
    if run is None:
        return
    if int(engine.global_steps) - 1 == int(run.section.profile_step) and run.profiler.started:
        del engine.__dict__[_RUN_ATTR]
        run.finish(engine)
    elif int(engine.global_steps) - 1 > int(run.section.profile_step):
        del engine.__dict__[_RUN_ATTR]
        run.close()  # the profiled step never ran a forward through the engine (resumed past it)
