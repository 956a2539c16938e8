"""Manifest of the ``xpu`` accelerator (Intel GPUs through ``torch.xpu``)."""

from __future__ import annotations

import importlib.util

from dscore import hookimpl
from dscore.specs import AcceleratorSpec

__all__ = ["dscore_register_accelerators", "probe"]


def probe() -> object:
    """Count XPU devices with ``torch.xpu.device_count()`` (no device context is created)."""
    from dscore.accelerator import ProbeResult

    if importlib.util.find_spec("torch") is None:
        return ProbeResult(False, "torch is not installed", 0)
    import torch

    xpu = getattr(torch, "xpu", None)
    if xpu is None or not getattr(torch._C, "_has_xpu", False):
        return ProbeResult(False, f"torch {torch.__version__} was built without XPU support", 0)
    count = int(xpu.device_count())
    if count < 1:
        return ProbeResult(False, "torch.xpu sees 0 devices (check ZE_AFFINITY_MASK and the driver)", 0)
    return ProbeResult(True, f"torch.xpu sees {count} device(s)", count)


@hookimpl
def dscore_register_accelerators() -> list[AcceleratorSpec]:
    """Register the ``xpu`` accelerator."""
    return [
        AcceleratorSpec(
            name="xpu",
            device_type="xpu",
            description="Intel GPUs through torch.xpu; oneCCL (ccl) or xccl for collectives",
            accelerator="dscore_accelerators.xpu.accelerator:XpuAccelerator",
            probe="dscore_accelerators.xpu.plugin:probe",
            priority=90,
        )
    ]
