"""Manifest of the ``cpu`` accelerator: always available, lowest priority (the essential fallback)."""

from __future__ import annotations

from dscore import hookimpl
from dscore.specs import AcceleratorSpec

__all__ = ["dscore_register_accelerators", "probe"]


def probe() -> object:
    """The host CPU is always usable: ``ProbeResult(True, ..., device_count=1)``."""
    from dscore.accelerator import ProbeResult

    return ProbeResult(True, "the host CPU is always usable", 1)


@hookimpl
def dscore_register_accelerators() -> list[AcceleratorSpec]:
    """Register the ``cpu`` accelerator."""
    return [
        AcceleratorSpec(
            name="cpu",
            device_type="cpu",
            description="host CPU; gloo (or oneCCL when installed) for collectives",
            accelerator="dscore_accelerators.cpu.accelerator:CpuAccelerator",
            probe="dscore_accelerators.cpu.plugin:probe",
            priority=0,
        )
    ]
