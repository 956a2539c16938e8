"""Manifest of dscore-testdevice: the ``testdev`` accelerator and the ``testnccl`` comm backend.

Torch-free: only specs. The accelerator's priority is below the built-in ``cpu`` (0), so it is never
picked automatically; ask for it with ``"accelerator": "testdev"`` or ``DS_ACCELERATOR=testdev``.
"""

from __future__ import annotations

import shutil

from dscore import hookimpl
from dscore.specs import AcceleratorSpec, CommBackendSpec

__all__ = ["dscore_register_accelerators", "dscore_register_comm_backends", "probe"]


def probe() -> object:
    """Usable where a C++ compiler and ninja exist (the device is compiled on first use); builds nothing."""
    import os

    from dscore.accelerator import ProbeResult

    missing = [tool for tool in ("c++", "ninja") if shutil.which(tool) is None and not _venv_tool(tool)]
    if missing:
        return ProbeResult(False, f"testdev is compiled on first use and needs {', '.join(missing)}", 0)
    count = int(os.environ.get("DSCORE_TESTDEV_COUNT", "8"))
    return ProbeResult(True, f"testdev: {count} emulated device(s) in host memory", count)


def _venv_tool(tool: str) -> bool:
    import sys
    from pathlib import Path

    return (Path(sys.executable).parent / tool).exists()


@hookimpl
def dscore_register_accelerators() -> list[AcceleratorSpec]:
    """Register ``testdev``."""
    return [
        AcceleratorSpec(
            name="testdev",
            device_type="testdev",
            description="test device: a PrivateUse1 device in host memory that is not the host (dscore-testdevice)",
            accelerator="dscore_testdevice.accelerator:TestDeviceAccelerator",
            probe="dscore_testdevice.plugin:probe",
            priority=-10,
        )
    ]


@hookimpl
def dscore_register_comm_backends() -> list[CommBackendSpec]:
    """Register ``testnccl`` (NCCL's rules on testdev tensors, over gloo)."""
    return [
        CommBackendSpec(
            name="testnccl",
            torch_backend="testnccl",
            device_types=("testdev",),
            description="NCCL's rules (device tensors only, no p2p tags, results at wait) over gloo, for testdev",
        )
    ]
