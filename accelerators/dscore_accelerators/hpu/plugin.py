"""Manifest of the ``hpu`` accelerator (Intel Gaudi through ``habana_frameworks.torch``)."""

from __future__ import annotations

import importlib.util

from dscore import hookimpl
from dscore.specs import AcceleratorSpec

__all__ = ["dscore_register_accelerators", "probe"]


def probe() -> object:
    """Count Gaudi devices; the vendor package being importable is not enough (zero devices = unavailable)."""
    from dscore.accelerator import ProbeResult

    if importlib.util.find_spec("habana_frameworks") is None:
        return ProbeResult(False, "habana_frameworks (the Gaudi PyTorch bridge) is not installed", 0)
    import habana_frameworks.torch.hpu as hpu

    count = int(hpu.device_count())
    if count < 1:
        return ProbeResult(False, "habana_frameworks.torch.hpu sees 0 devices", 0)
    return ProbeResult(True, f"habana_frameworks.torch.hpu sees {count} device(s)", count)


@hookimpl
def dscore_register_accelerators() -> list[AcceleratorSpec]:
    """Register the ``hpu`` accelerator."""
    return [
        AcceleratorSpec(
            name="hpu",
            aliases=("gaudi",),
            device_type="hpu",
            description="Intel Gaudi through habana_frameworks.torch; hccl for collectives",
            accelerator="dscore_accelerators.hpu.accelerator:HpuAccelerator",
            probe="dscore_accelerators.hpu.plugin:probe",
            priority=70,
        )
    ]
