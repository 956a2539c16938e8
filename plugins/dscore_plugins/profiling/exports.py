"""The user-facing names of the flops profiler: the ``exports`` module of the ``flops_profiler`` unit.

``dscore.profiling.flops_profiler`` (and compat's ``deepspeed.profiling.flops_profiler``) re-export these
through the registry (:func:`dscore.exports.thin_getattr`), so with the ``profiling`` plugin (or the unit
``config_section:flops_profiler``) disabled, importing them raises the registry's error naming it.
Importing this module imports torch.
"""

from __future__ import annotations

from dscore_plugins.profiling.formulas import COUNTED_FUNCTIONS, FlopsProfilerError
from dscore_plugins.profiling.model_profile import get_model_profile
from dscore_plugins.profiling.profiler import FlopsProfiler, ModuleProfile
from dscore_plugins.profiling.report import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = [
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
]
