"""The flops profiler (DeepSpeed's ``deepspeed.profiling.flops_profiler``): params, MACs, flops and latency
of every module, counted by DeepSpeed 0.19.8's rules.

``FlopsProfiler(model)`` (start / stop / end, totals, ``print_model_profile``) and
``get_model_profile(model, input_shape=...)`` keep this import path; their code is the built-in
``profiling`` plugin's (:mod:`dscore_plugins.profiling`: counting rules, profiler, report). These are thin
names: on first access each resolves through the ``exports`` module of the ``config_section`` unit
``flops_profiler`` in the registry (:mod:`dscore.exports`), so with the plugin disabled
(``DSCORE_DISABLE_PLUGINS=profiling``) importing one raises the registry's error naming the unit and how
to re-enable it. Importing a name imports torch.
"""

from __future__ import annotations

from dscore.exports import thin_getattr

#: The names provided by the ``flops_profiler`` unit's ``exports`` module (resolved by ``__getattr__``).
_PROVIDED = (
    "COUNTED_FUNCTIONS",
    "FlopsProfiler",
    "FlopsProfilerError",
    "ModuleProfile",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
)

__all__ = [*_PROVIDED]

__getattr__ = thin_getattr(__name__, "config_section", "flops_profiler", _PROVIDED)
