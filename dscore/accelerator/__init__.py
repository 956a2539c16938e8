"""Accelerators: the :class:`Accelerator` interface, probe results and selection.

``import dscore.accelerator`` does not import torch; concrete accelerators are plugins
(``dscore_accelerators.<name>``) found through the registry.
"""

from __future__ import annotations

from dscore.accelerator.base import (
    Accelerator,
    Capabilities,
    DeviceControl,
    LaunchEnv,
    MemoryStats,
    ProbeResult,
    RngControl,
    StreamsAndEvents,
)
from dscore.accelerator.selection import ENV_VAR, probe_accelerator, select_accelerator

__all__ = [
    "ENV_VAR",
    "Accelerator",
    "Capabilities",
    "DeviceControl",
    "LaunchEnv",
    "MemoryStats",
    "ProbeResult",
    "RngControl",
    "StreamsAndEvents",
    "probe_accelerator",
    "select_accelerator",
]
