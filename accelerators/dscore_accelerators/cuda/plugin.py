"""Manifest of the ``cuda`` accelerator (NVIDIA GPUs through ``torch.cuda``; also ROCm builds of torch)."""

from __future__ import annotations

import importlib.util

from dscore import hookimpl
from dscore.specs import AcceleratorSpec

__all__ = ["dscore_register_accelerators", "probe"]


def probe() -> object:
    """Count CUDA devices without creating a CUDA context.

    ``torch.cuda.device_count()`` asks NVML (or the runtime's device count) and does not initialise a
    context; a torch built without CUDA is reported as such without touching the driver.
    """
    from dscore.accelerator import ProbeResult

    if importlib.util.find_spec("torch") is None:
        return ProbeResult(False, "torch is not installed", 0)
    import torch

    if not torch.backends.cuda.is_built():
        return ProbeResult(False, f"torch {torch.__version__} was built without CUDA", 0)
    count = int(torch.cuda.device_count())
    if count < 1:
        return ProbeResult(False, "torch.cuda sees 0 devices (check CUDA_VISIBLE_DEVICES and the driver)", 0)
    return ProbeResult(True, f"torch.cuda sees {count} device(s)", count)


@hookimpl
def dscore_register_accelerators() -> list[AcceleratorSpec]:
    """Register the ``cuda`` accelerator (highest built-in priority)."""
    return [
        AcceleratorSpec(
            name="cuda",
            aliases=("gpu",),
            device_type="cuda",
            description="NVIDIA (or ROCm) GPUs through torch.cuda; nccl for collectives",
            accelerator="dscore_accelerators.cuda.accelerator:CudaAccelerator",
            probe="dscore_accelerators.cuda.plugin:probe",
            priority=100,
        )
    ]
