"""Manifest of the ``mps`` accelerator (Apple silicon GPUs through ``torch.mps``)."""

from __future__ import annotations

import importlib.util
import sys

from dscore import hookimpl
from dscore.specs import AcceleratorSpec

__all__ = ["dscore_register_accelerators", "probe"]


def probe() -> object:
    """``torch.backends.mps.is_available()``: a macOS check that creates no Metal context."""
    from dscore.accelerator import ProbeResult

    if sys.platform != "darwin":
        return ProbeResult(False, "MPS exists only on macOS", 0)
    if importlib.util.find_spec("torch") is None:
        return ProbeResult(False, "torch is not installed", 0)
    import torch

    if not torch.backends.mps.is_built():
        return ProbeResult(False, f"torch {torch.__version__} was built without MPS", 0)
    if not torch.backends.mps.is_available():
        return ProbeResult(False, "torch.backends.mps reports no usable Metal device", 0)
    return ProbeResult(True, "torch.backends.mps is available (1 device)", 1)


@hookimpl
def dscore_register_accelerators() -> list[AcceleratorSpec]:
    """Register the ``mps`` accelerator."""
    return [
        AcceleratorSpec(
            name="mps",
            device_type="mps",
            description="Apple silicon GPU through torch.mps; gloo for collectives",
            accelerator="dscore_accelerators.mps.accelerator:MpsAccelerator",
            probe="dscore_accelerators.mps.plugin:probe",
            priority=60,
        )
    ]
