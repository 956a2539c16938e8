"""Manifest of the ``testdev`` accelerator (the ``testnccl`` comm backend has its own: :mod:`.comm_plugin`).

Torch-free: only specs. The accelerator's priority is below the built-in ``cpu`` (0), so it is never
picked automatically; ask for it with ``"accelerator": "testdev"`` or ``DS_ACCELERATOR=testdev``.
"""

from __future__ import annotations

import shutil

from dscore import hookimpl
from dscore.specs import AcceleratorSpec

__all__ = ["dscore_register_accelerators", "probe"]


def probe() -> object:
    """Usable where a C++ compiler and ninja exist (the device is compiled on first use); builds nothing."""
    import os

    from dscore.accelerator import ProbeResult

    missing = [tool for tool in ("c++", "ninja") if shutil.which(tool) is None and not _venv_tool(tool)]
    if missing:
        return ProbeResult(False, f"testdev is compiled on first use and needs {', '.join(missing)}", 0)
    count = int(os.environ.get("DSCORE_TESTDEV_COUNT", "8"))
    return ProbeResult(True, f"{count} emulated devices", count)


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
