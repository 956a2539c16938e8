"""Manifest of the ``npu`` accelerator (Huawei Ascend through ``torch_npu``)."""

from __future__ import annotations

import importlib.util

from dscore import hookimpl
from dscore.specs import AcceleratorSpec

__all__ = ["dscore_register_accelerators", "probe"]


def probe() -> object:
    """Count Ascend devices; ``torch_npu`` installed with zero devices is reported unavailable."""
    from dscore.accelerator import ProbeResult

    if importlib.util.find_spec("torch_npu") is None:
        return ProbeResult(False, "torch_npu is not installed", 0)
    import torch
    import torch_npu  # noqa: F401 - registers torch.npu

    count = int(torch.npu.device_count())
    if count < 1:
        return ProbeResult(False, "torch.npu sees 0 devices (check ASCEND_RT_VISIBLE_DEVICES)", 0)
    return ProbeResult(True, f"torch.npu sees {count} device(s)", count)


@hookimpl
def dscore_register_accelerators() -> list[AcceleratorSpec]:
    """Register the ``npu`` accelerator."""
    return [
        AcceleratorSpec(
            name="npu",
            aliases=("ascend",),
            device_type="npu",
            description="Huawei Ascend through torch_npu; hccl for collectives",
            accelerator="dscore_accelerators.npu.accelerator:NpuAccelerator",
            probe="dscore_accelerators.npu.plugin:probe",
            priority=80,
        )
    ]
